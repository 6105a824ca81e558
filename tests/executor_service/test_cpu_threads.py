"""The CPU thread governor: heavy steps get every core the others leave, light ones leave one (pure logic)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from executor_service.cpu_threads import (
    HEAVY_STEP_CPU_MS,
    LARGE_STEP_TOKENS,
    LIGHT_STEP_CPU_MS,
    OPENMP_SPIN_COUNT,
    OTHERS_BUSY_CORES,
    OtherLoad,
    ThreadGovernor,
    prefer_brief_openmp_spin,
)


def make(cores: int, others: float = 0.3) -> tuple[ThreadGovernor, list[int]]:
    """A governor on ``cores`` cores, with other processes keeping ``others`` cores busy (by default
    a co-located scheduler and its clients: less than half a core)."""
    applied: list[int] = []
    return ThreadGovernor(cores, applied.append, lambda stepped_s: others), applied


def test_starts_with_all_cores_but_one_and_applies_each_change_once() -> None:
    governor, applied = make(4)
    governor.before_step()
    governor.before_step()
    assert applied == [3]


def test_heavy_steps_get_every_core_and_light_ones_give_one_back() -> None:
    governor, applied = make(2)
    governor.before_step()
    governor.after_step(HEAVY_STEP_CPU_MS / 1000)  # one thread, heavy: next step gets both cores
    governor.before_step()
    assert applied == [1, 2]
    # Two threads halve the heavy step: its work (time x threads) stays above the light mark.
    governor.after_step(HEAVY_STEP_CPU_MS / 1000 / 2 * 1.05)
    assert governor.current == 2
    governor.after_step(LIGHT_STEP_CPU_MS / 1000 / 2 * 0.9)
    governor.before_step()
    assert applied == [1, 2, 1]


def test_between_the_marks_the_choice_stands() -> None:
    governor, _ = make(2)
    middle = (HEAVY_STEP_CPU_MS + LIGHT_STEP_CPU_MS) / 2 / 1000
    governor.after_step(middle)
    assert governor.current == 1
    governor.after_step(1.0)
    governor.after_step(middle / 2)  # two threads: the same work as ``middle`` on one
    assert governor.current == 2


def test_a_large_step_predicted_heavy_gets_a_heavy_steps_threads_before_it_runs() -> None:
    governor, applied = make(2)
    governor.before_step(512)  # nothing learned yet: the current (light) choice
    governor.after_step(0.05, 512)  # 50 ms of work on one thread: light, and about 0.1 ms a token
    assert governor.current == 1
    governor.before_step(2000)  # predicted about 195 ms of work: heavy, so both cores now
    assert applied == [1, 2]
    governor.after_step(0.128, 2000)  # judged with the two threads it had: heavy
    assert governor.current == 2
    governor.before_step(8)
    governor.after_step(0.003, 8)  # a decode step: light again
    governor.before_step(8)
    assert applied == [1, 2, 1]


def test_small_steps_and_large_steps_predicted_light_keep_the_current_choice() -> None:
    governor, applied = make(2)
    governor.before_step(LARGE_STEP_TOKENS)
    governor.after_step(0.05, LARGE_STEP_TOKENS)  # about 0.2 ms a token
    governor.before_step(LARGE_STEP_TOKENS - 1)  # predicted heavy, but not a large step
    governor.before_step(LARGE_STEP_TOKENS)  # a large step predicted light (about 50 ms)
    assert applied == [1]


def test_a_predicted_heavy_step_leaves_the_cores_other_processes_keep_busy() -> None:
    governor, applied = make(2, others=1.0)  # another executor keeps a core busy
    governor.before_step(512)
    governor.after_step(0.05, 512)
    governor.before_step(4000)
    assert applied == [1]


def test_heavy_steps_leave_the_cores_other_processes_keep_busy() -> None:
    beside_another_executor, _ = make(2, others=1.0)
    beside_another_executor.after_step(HEAVY_STEP_CPU_MS / 1000)
    assert beside_another_executor.current == 1
    many, _ = make(8, others=2.6)  # rounded to whole cores: three held
    many.after_step(HEAVY_STEP_CPU_MS / 1000)
    assert many.current == 5
    unknown, _ = make(2, others=math.inf)  # just after a pause, no other executor here: every core
    unknown.after_step(HEAVY_STEP_CPU_MS / 1000)
    assert unknown.current == 2


def test_while_the_load_is_unknown_a_heavy_step_leaves_a_core_to_each_other_executor_here() -> None:
    applied: list[int] = []
    paused = ThreadGovernor(2, applied.append, lambda stepped_s: math.inf, peers=lambda: 1)
    paused.after_step(HEAVY_STEP_CPU_MS / 1000)  # a burst reaches both executors at once
    assert paused.current == 1
    paused.after_step(0.05, 512)
    paused.before_step(4000)  # the look-ahead as well: predicted heavy, still one thread
    assert applied == [1]
    known = ThreadGovernor(8, applied.append, lambda stepped_s: 0.02, peers=lambda: 3)
    known.after_step(HEAVY_STEP_CPU_MS / 1000)  # measured: the other executors are idle
    assert known.current == 8
    crowded = ThreadGovernor(2, applied.append, lambda stepped_s: math.inf, peers=lambda: 5)
    crowded.after_step(HEAVY_STEP_CPU_MS / 1000)
    assert crowded.current == 1  # never fewer than one


def test_light_steps_take_every_core_when_nothing_else_needs_one() -> None:
    governor, _ = make(2, others=OTHERS_BUSY_CORES / 2)  # an executor alone on its host
    governor.after_step(LIGHT_STEP_CPU_MS / 1000 / 10)
    assert governor.current == 2
    busy, _ = make(2, others=OTHERS_BUSY_CORES)  # the scheduler and clients on the same cores
    busy.after_step(LIGHT_STEP_CPU_MS / 1000 / 10)
    assert busy.current == 1


def test_other_load_is_unknown_until_a_window_of_stepping_has_passed() -> None:
    now = [0.0]
    load = OtherLoad(interval_s=0.5, clock=lambda: now[0])
    assert load() == math.inf  # nothing measured yet: counted as busy
    for now[0] in (0.2, 0.4):
        assert load() == math.inf
    now[0] = 0.6
    measured = load()
    assert 0.0 <= measured < math.inf
    now[0] = 0.7
    assert load() == measured  # the figure holds until the next window ends
    now[0] = 5.0  # the engine sat idle: that window says nothing about the load beside a step
    assert load() == math.inf


def test_a_step_longer_than_the_window_is_no_pause() -> None:
    now = [0.0]
    load = OtherLoad(interval_s=0.25, clock=lambda: now[0])
    for step in range(1, 4):  # steps of 0.4 s, each longer than the window
        now[0] = 0.4 * step
        measured = load(stepped_s=0.4)
    assert 0.0 <= measured < math.inf


def test_one_core_is_one_thread_whatever_the_step() -> None:
    governor, _ = make(1)
    governor.after_step(10.0)
    assert (governor.few, governor.many, governor.current) == (1, 1, 1)


def test_rejects_no_cores() -> None:
    with pytest.raises(ValueError, match="cores"):
        ThreadGovernor(0, lambda n: None)


def test_openmp_spins_briefly_unless_the_operator_chose_a_policy() -> None:
    env: dict[str, str] = {}
    prefer_brief_openmp_spin(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT)}
    own_spin = {"GOMP_SPINCOUNT": "0"}
    prefer_brief_openmp_spin(own_spin)
    assert own_spin == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    # A chosen policy keeps its own spin: GOMP_SPINCOUNT would override it.
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    prefer_brief_openmp_spin(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_module_does_not_load_torch() -> None:
    """It must run before torch loads libgomp, so importing it may not import torch."""
    code = "import sys, executor_service.cpu_threads; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
