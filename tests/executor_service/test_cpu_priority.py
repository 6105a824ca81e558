"""``lower_cpu_priority``: every thread of the process, those already running and those started later,
runs at the executor's nice value; each case runs in a child process, so the test's own priority stays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from executor_service.cpu_priority import lower_cpu_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")

_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    from executor_service.cpu_priority import lower_cpu_priority

    started = threading.Event()
    release = threading.Event()
    seen = {}

    def before():
        started.set()
        release.wait()

    def after():
        seen["after"] = os.getpriority(os.PRIO_PROCESS, 0)

    early = threading.Thread(target=before)
    early.start()
    started.wait()
    result = lower_cpu_priority(int(sys.argv[1]))
    seen["before"] = os.getpriority(os.PRIO_PROCESS, early.native_id)
    late = threading.Thread(target=after)
    late.start()
    late.join()
    release.set()
    early.join()
    print(result, os.getpriority(os.PRIO_PROCESS, 0), seen["before"], seen["after"])
    """
)


def _child(nice: int, start_at: int = 0) -> list[int]:
    """(returned, main thread, a thread started before, a thread started after) in a child at ``start_at``."""
    run = [sys.executable, "-c", _CHILD, str(nice)]
    out = subprocess.run(
        ["nice", "-n", str(start_at), *run] if start_at else run, capture_output=True, text=True, check=True
    )
    return [int(v) for v in out.stdout.split()]


def test_every_thread_runs_at_the_nice_value() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    expected = max(own, 10)
    assert _child(10) == [expected] * 4


def test_a_process_started_nicer_keeps_its_own() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    expected = min(19, max(own + 15, 15))
    assert _child(10, start_at=15) == [expected] * 4


def test_zero_leaves_the_priority_alone() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert _child(0) == [own] * 4


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may start a process at a negative nice value")
def test_zero_keeps_a_negative_nice_the_operator_gave() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert _child(0, start_at=-5) == [max(-20, own - 5)] * 4


@pytest.mark.parametrize("nice", [-1, 20])
def test_out_of_range_is_refused(nice: int) -> None:
    with pytest.raises(ValueError, match="nice must be 0-19"):
        lower_cpu_priority(nice)
