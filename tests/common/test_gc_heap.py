"""``freeze_startup_heap``: the objects alive at startup leave the collector's full passes."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from common.gc_heap import freeze_startup_heap


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    # Only the services' entry points freeze; the test process must not keep a frozen heap.
    yield
    gc.unfreeze()


@pytest.mark.usefixtures("unfrozen_after")
def test_startup_objects_leave_the_full_passes() -> None:
    kept = [[i] for i in range(1000)]
    frozen = freeze_startup_heap()
    # Frozen objects still die by reference counting (another thread's may, at any moment), so
    # the count only bounds what is still alive.
    assert frozen >= len(kept) and gc.get_freeze_count() >= len(kept)
    # What the collector still walks is what came after the freeze, not the startup heap.
    assert len(gc.get_objects()) < frozen


@pytest.mark.usefixtures("unfrozen_after")
def test_garbage_is_collected_before_the_freeze() -> None:
    class Cycle:
        pass

    a, b = Cycle(), Cycle()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    gone = weakref.ref(a)
    del a, b
    freeze_startup_heap()
    assert gone() is None, "a cycle that was already garbage must not be frozen for good"
