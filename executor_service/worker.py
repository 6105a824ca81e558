"""Runs the engine in its own thread so the gRPC event loop never blocks on a model step.

The thread never waits for a plan while it has work: it applies whatever plans arrived by the
iteration boundary and steps again. Only an idle engine blocks, briefly, on the plan inbox.

A step that raises ends the thread: after an exception the engine's state (its KV blocks, its
running set) cannot be trusted, so nothing here tries to go on. ``on_failure`` tells the server,
which takes the executor out of the fleet so its requests are re-queued and run elsewhere
(``server.RunningExecutor.withdraw``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from executor_service.engine import Engine
from executor_service.engine_io import PlanUpdate, StepOutput

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        on_output: Callable[[StepOutput], None],
        on_failure: Callable[[BaseException], None] = lambda exc: None,  # called on the engine thread
    ) -> None:
        self.engine = engine
        self._on_output = on_output
        self._on_failure = on_failure
        self._inbox: queue.SimpleQueue[PlanUpdate] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="baton-engine", daemon=True)
        self.error: BaseException | None = None

    def submit(self, plan: PlanUpdate) -> None:
        """Thread-safe: queue a plan for the next iteration boundary."""
        self._inbox.put(plan)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _apply_pending(self, block: bool) -> None:
        try:
            plan = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self.engine.apply(plan)
        while True:
            try:
                self.engine.apply(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._apply_pending(block=not engine.has_work and not engine.has_news)
                if engine.has_work:
                    self._on_output(engine.step())
                elif engine.has_news:
                    self._on_output(engine.drain())
        except BaseException as exc:  # the thread must not die silently: the servicer reports UNAVAILABLE
            log.exception("engine thread failed")
            self.error = exc
            self._on_failure(exc)
