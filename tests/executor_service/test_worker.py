"""The engine thread keeps decoding when no plan arrives, and applies plans between iterations."""

from __future__ import annotations

import queue
import time
from pathlib import Path

from executor_service.engine_io import PlanUpdate, StepOutput
from executor_service.worker import EngineWorker
from tests.executor_service.test_engine import admit, make_engine, prompts


def test_worker_decodes_without_further_plans(tiny_model_dir: Path) -> None:
    outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
    worker = EngineWorker(make_engine(tiny_model_dir), outputs.put)
    worker.start()
    try:
        worker.submit(PlanUpdate(seq=1, admit=(admit("solo", prompts(1)[0], 40),)))
        tokens = 0
        deadline = time.monotonic() + 60
        finished = False
        while not finished and time.monotonic() < deadline:
            out = outputs.get(timeout=30)
            tokens += sum(len(t.token_ids) for t in out.tokens)
            finished = any(f.request_id == "solo" for f in out.finished)
        assert finished and tokens == 40  # one plan, then 40 iterations with none
    finally:
        worker.stop()
    assert worker.error is None


def test_worker_applies_plans_arriving_mid_run(tiny_model_dir: Path) -> None:
    outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
    worker = EngineWorker(make_engine(tiny_model_dir), outputs.put)
    worker.start()
    try:
        worker.submit(PlanUpdate(seq=1, admit=(admit("first", prompts(1)[0], 200),)))
        outputs.get(timeout=30)
        worker.submit(PlanUpdate(seq=2, admit=(admit("second", prompts(1, seed=2)[0], 3),)))
        seen: set[str] = set()
        plan_seqs: list[int] = []
        while "second" not in seen:
            out = outputs.get(timeout=30)
            plan_seqs.append(out.plan_seq)
            seen.update(f.request_id for f in out.finished)
        assert plan_seqs[-1] == 2
        assert "first" not in seen  # it kept running while the new plan was applied
    finally:
        worker.stop()


def test_a_step_that_raises_ends_the_thread_and_reports_the_failure(tiny_model_dir: Path) -> None:
    failures: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
    engine = make_engine(tiny_model_dir)
    worker = EngineWorker(engine, lambda out: None, failures.put)

    def broken_step() -> StepOutput:
        raise RuntimeError("injected engine failure")

    engine.step = broken_step  # type: ignore[method-assign]
    worker.start()
    try:
        worker.submit(PlanUpdate(seq=1, admit=(admit("doomed", prompts(1)[0], 4),)))
        failure = failures.get(timeout=30)
    finally:
        worker.stop()
    assert isinstance(failure, RuntimeError) and worker.error is failure
    assert not worker.alive
