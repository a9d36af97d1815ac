"""MainThreadCore: the main thread on one core during each iteration only, its whole mask back after (real engines)."""

from __future__ import annotations

import os
import threading

import pytest
from ignite.engine import Engine, Events

from monai_fast.handlers import MainThreadCore
from monai_fast.openmp import free_core

ALL = os.sched_getaffinity(0)
needs_two = pytest.mark.skipif(len(ALL) < 2, reason="needs 2 or more CPUs to tell one core from all")


def _engine(seen: list, fail_at: int | None = None) -> Engine:
    def step(engine: Engine, batch: int) -> int:
        seen.append(os.sched_getaffinity(0))
        if batch == fail_at:
            raise RuntimeError(f"batch {batch} failed")
        return batch

    engine = Engine(step)
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(("between", os.sched_getaffinity(0))))
    return engine


@needs_two
def test_the_main_thread_computes_on_its_core_and_gets_every_cpu_back_between_iterations_and_after():
    core = {min(ALL)}
    seen: list = []
    engine = _engine(seen)
    MainThreadCore(core).attach(engine)
    engine.run([1, 2, 3], max_epochs=2)
    inside = [s for s in seen if not isinstance(s, tuple)]
    assert inside == [core] * 6
    assert [s for s in seen if isinstance(s, tuple)] == [("between", ALL)] * 2
    assert os.sched_getaffinity(0) == ALL


@needs_two
def test_an_iteration_that_raises_still_gives_the_mask_back_and_the_error_out():
    engine = _engine([], fail_at=2)
    MainThreadCore({min(ALL)}).attach(engine)
    with pytest.raises(RuntimeError, match="batch 2 failed"):
        engine.run([1, 2, 3], max_epochs=1)
    assert os.sched_getaffinity(0) == ALL


@needs_two
def test_an_engine_run_on_another_thread_is_left_alone():
    seen: list = []
    engine = _engine(seen)
    MainThreadCore({min(ALL)}).attach(engine)
    t = threading.Thread(target=engine.run, args=([1, 2],), kwargs={"max_epochs": 1})
    t.start()
    t.join()
    assert [s for s in seen if not isinstance(s, tuple)] == [ALL, ALL]


def test_no_pinned_thread_no_core_and_a_core_outside_the_mask_is_refused():
    assert free_core() is None  # nothing in this process is pinned
    handler = MainThreadCore()
    assert handler.core is None
    engine = _engine([])
    handler.attach(engine)
    assert engine.run([1], max_epochs=1).output == 1
    with pytest.raises(ValueError, match="not within this thread's CPUs"):
        MainThreadCore({max(ALL) + 1})
    with pytest.raises(ValueError, match="not within"):
        MainThreadCore(set())
