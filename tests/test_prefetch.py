"""Batches made ahead in the loader thread or on demand in the training thread, and the measured choice."""

import logging
import threading
import time

import pytest
import torch
from ignite.engine import Engine, Events
from monai.data import Dataset
from monai.transforms import Compose, RandGaussianNoised
from torch.utils.data import DataLoader

from monai_fast.data.loaders import SafeThreadDataLoader, prefetch_pays
from monai_fast.handlers import FastTraining, PrefetchChoice


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "monai-fast-loader"]


class _Made:
    """A data set that notes which thread made each item, and when; ``busy`` is set while it makes one."""

    def __init__(self, n: int, cost: float = 0.0) -> None:
        self.n, self.cost, self.log, self.busy = n, cost, [], threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.busy.set()
        start = time.perf_counter()
        if self.cost:  # no sleep(0): on a busy host it gives up the CPU, a cost only a batch made on demand pays
            time.sleep(self.cost)
        self.log.append((i, threading.current_thread().name, start, time.perf_counter()))
        self.busy.clear()
        return {"x": torch.tensor([float(i)])}


def _consume(loader, work_s: float, stop_after: int | None = None):
    got, windows = [], []
    for b in loader:
        start = time.perf_counter()
        time.sleep(work_s)
        windows.append((start, time.perf_counter()))
        got.append(int(b["x"]))
        if stop_after is not None and len(got) == stop_after:
            break
    return got, windows


def _made_during(log, windows):
    return [i for i, _, s, e in log if any(s < we and e > ws for ws, we in windows)]


def test_on_demand_makes_every_batch_in_the_training_thread_and_none_while_it_works():
    ds = _Made(6, cost=0.005)
    got, windows = _consume(SafeThreadDataLoader(ds, batch_size=1, prefetch=False), work_s=0.02)
    assert got == list(range(6))
    assert {name for _, name, _, _ in ds.log} == {threading.current_thread().name}
    assert _made_during(ds.log, windows) == [] and _loader_threads() == []


def test_prefetch_makes_the_next_batch_in_the_loader_thread_while_the_training_thread_works():
    ds = _Made(6, cost=0.005)
    got, windows = _consume(SafeThreadDataLoader(ds, batch_size=1, prefetch=True), work_s=0.02)
    assert got == list(range(6))
    assert {name for _, name, _, _ in ds.log} == {"monai-fast-loader"}
    assert len(_made_during(ds.log, windows)) >= 4 and _loader_threads() == []


def _noisy_batches(prefetch: bool, switch: bool = False):
    data = [{"x": torch.full((4,), float(i))} for i in range(9)]
    chain = Compose([RandGaussianNoised(keys="x", prob=1.0)])  # its seed comes from the loader's generator
    loader = SafeThreadDataLoader(
        Dataset(data, chain), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1), prefetch=prefetch
    )
    batches = []
    for b in loader:
        if switch:
            loader.prefetch = not loader.prefetch  # read when the next batch arrives
        batches.append(b["x"])
    return batches


def test_ahead_on_demand_and_switching_every_batch_give_the_same_batches():
    ahead, on_demand, switching = _noisy_batches(True), _noisy_batches(False), _noisy_batches(True, switch=True)
    assert len(ahead) == len(on_demand) == len(switching) == 5
    for a, b, c in zip(ahead, on_demand, switching):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not any(torch.equal(a, a.round()) for a in ahead)  # the items are whole numbers plus noise: it is there
    assert _loader_threads() == []


def test_a_slow_batch_made_on_demand_is_named_in_an_error_log(caplog):
    ds = _Made(2, cost=0.5)
    with caplog.at_level(logging.ERROR, logger="monai_fast.data.loaders"):
        got, _ = _consume(SafeThreadDataLoader(ds, batch_size=1, prefetch=False, timeout_s=0.2), work_s=0)
    assert got == [0, 1]  # a batch made in the training thread cannot be cut short: it still arrives
    stuck = [r.getMessage() for r in caplog.records if "timeout_s=0.2" in r.getMessage()]
    assert len(stuck) == 2 and "loading item 0" in stuck[0] and "loading item 1" in stuck[1]


def test_stopping_wakes_an_idle_loader_thread_at_once():
    ds = _Made(50)
    modes = iter([True] + [False] * 49)  # the thread makes batches 0-2, then waits idle for a request that never comes
    loader = SafeThreadDataLoader(ds, batch_size=1)
    start = None
    for i, _ in enumerate(loader):
        loader.prefetch = next(modes)
        if i == 3:
            time.sleep(0.1)
            start = time.perf_counter()
            break
    assert time.perf_counter() - start < 2.0  # an idle thread re-checks on its own only every 5 s
    assert [name for _, name, _, _ in ds.log] == ["monai-fast-loader"] * 3 + [threading.current_thread().name]
    assert _loader_threads() == []


def test_prefetch_surely_pays_on_a_gpu_and_is_measured_on_a_cpu():
    assert prefetch_pays("cuda")[0] is True
    pays, why = prefetch_pays("cpu")
    assert pays is False and f"{torch.get_num_threads()} intra-op threads" in why


def _choose(step, item_cost: float, pairs: int = 2, epochs: int = 3, per_epoch: int = 8):
    ds = _Made(per_epoch, cost=item_cost)
    loader = SafeThreadDataLoader(ds, batch_size=1, prefetch=False)
    engine = Engine(lambda e, b: step(ds))
    chosen = []
    choice = PrefetchChoice(loader, pairs=pairs, on_choice=lambda p, why: chosen.append((p, why)))
    choice.attach(engine)
    after = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: after.append(loader.prefetch) if choice.prefetch is not None else None
    )
    engine.run(loader, max_epochs=epochs)
    assert engine.state.iteration == epochs * per_epoch and _loader_threads() == []
    assert len(chosen) == 1 and all(len(t) == pairs for t in choice.times.values())
    assert after and set(after) == {choice.prefetch} and loader.prefetch is choice.prefetch
    return choice, chosen[0]


def test_the_choice_keeps_prefetch_when_making_batches_ahead_hides_their_cost():
    choice, (prefetch, why) = _choose(lambda ds: time.sleep(0.03), item_cost=0.03)
    assert prefetch is True and why.startswith("prefetch: ")
    ahead, asked = (float(x.split(" s")[0]) for x in why.split(": ", 1)[1].split(" against "))
    assert ahead < asked


def test_the_choice_goes_on_demand_when_a_batch_made_alongside_slows_the_step():
    # stands in for a CPU whose every core runs the step's OpenMP team: a batch made during the step
    # costs the step more than the batch itself (measured for real in benchmarks/loader_overlap.py)
    def step(ds):
        made = len(ds.log)
        time.sleep(0.02)
        if ds.busy.is_set() or len(ds.log) != made:
            time.sleep(0.04)

    choice, (prefetch, why) = _choose(step, item_cost=0.005)
    assert prefetch is False and why.startswith("on demand: ")


@pytest.mark.parametrize("gated", [True, False])
def test_nothing_is_timed_while_a_cache_fills_in_the_background(gated):
    # while the fill runs, a batch asked for on demand waits for its item (slow), which a batch made
    # ahead hides; once the cache is full, a batch made alongside the step slows it (the OpenMP stand-in
    # above) and on demand is faster. Timed during the fill, the choice would keep the wrong setting.
    filling = {"on": True}

    class Filling(_Made):
        def __getitem__(self, i):
            self.cost = 0.08 if filling["on"] else 0.002
            return super().__getitem__(i)

    def step(ds):
        made = len(ds.log)
        time.sleep(0.04)
        if ds.busy.is_set() or len(ds.log) != made:
            time.sleep(0.04)

    ds = Filling(8)
    loader = SafeThreadDataLoader(ds, batch_size=1, prefetch=False)
    engine = Engine(lambda e, b: step(ds))
    choice = PrefetchChoice(loader, pairs=2, ready=(lambda: not filling["on"]) if gated else None)
    choice.attach(engine)
    timed_while_filling, settings_while_filling = [], []
    engine.add_event_handler(
        Events.ITERATION_STARTED, lambda e: settings_while_filling.append(loader.prefetch) if filling["on"] else None
    )

    @engine.on(Events.EPOCH_COMPLETED(once=1))
    def fill_done(_):
        timed_while_filling.append(sum(len(t) for t in choice.times.values()))
        filling["on"] = False

    engine.run(loader, max_epochs=3)
    if gated:
        assert timed_while_filling == [0] and choice.prefetch is False and choice.reason.startswith("on demand: ")
        assert set(settings_while_filling) == {False}  # the loader's own setting, held while nothing is timed
    else:  # the same run timed during the fill: it keeps prefetch (this is what the gate is for)
        assert timed_while_filling == [4] and choice.prefetch is True


def test_epochs_too_short_to_time_keep_the_loaders_setting():
    loader = SafeThreadDataLoader(_Made(2), batch_size=1, prefetch=False)
    engine = Engine(lambda e, b: None)
    chosen = []
    choice = PrefetchChoice(loader, on_choice=lambda p, why: chosen.append((p, why)))
    choice.attach(engine)
    engine.run(loader, max_epochs=3)
    assert chosen == [(False, "on demand kept: epochs of 2 iteration(s) are too short to time both ways")]
    assert loader.prefetch is False and choice.times == {True: [], False: []}


def test_prefetch_choice_refuses_what_it_cannot_measure():
    with pytest.raises(TypeError, match="SafeThreadDataLoader"):
        PrefetchChoice(DataLoader(list(range(3))))
    with pytest.raises(ValueError, match="pairs must be an integer >= 1"):
        PrefetchChoice(SafeThreadDataLoader(list(range(3))), pairs=0)
    with pytest.raises(ValueError, match="prefetch must be 'auto', True or False"):
        FastTraining(prefetch="yes")
    with pytest.raises(TypeError, match="prefetch must be True or False"):
        SafeThreadDataLoader(list(range(3)), prefetch="auto")


def test_fast_training_sets_the_loaders_prefetch_and_says_why(tiny_files):
    from test_fast_training import _user_trainer

    trainer, evaluator = _user_trainer(tiny_files)
    fast = FastTraining(prefetch=False)
    fast.attach(trainer, evaluator)
    assert trainer.data_loader.prefetch is False and evaluator.data_loader.prefetch is False
    assert fast.applied["prefetch"] == {"applied": True, "setting": "on demand", "reason": "requested prefetch=False"}
    assert not any(isinstance(h, PrefetchChoice) for h in fast._helpers)

    trainer, evaluator = _user_trainer(tiny_files)
    fast = FastTraining()
    fast.attach(trainer, evaluator)
    choices = [h for h in fast._helpers if isinstance(h, PrefetchChoice)]
    assert (
        fast.applied["prefetch"]["setting"] == "measuring" and "intra-op threads" in fast.applied["prefetch"]["reason"]
    )
    assert {c.loader for c in choices} == {trainer.data_loader, evaluator.data_loader}
    assert trainer.data_loader.prefetch is False  # on demand until the measurement says otherwise


def test_fast_training_keeps_batches_ahead_where_worker_processes_make_them(tiny_files):
    from monai.data import DataLoader, list_data_collate
    from test_fast_training import _chain, _user_trainer

    loader = DataLoader(Dataset(tiny_files[0], _chain(True)), batch_size=2, num_workers=1, collate_fn=list_data_collate)
    trainer, evaluator = _user_trainer(tiny_files, train_loader=loader)
    fast = FastTraining(cache="none")
    fast.attach(trainer, evaluator)
    assert trainer.data_loader.num_workers == 1 and trainer.data_loader.prefetch is True
    assert fast.applied["prefetch"] == {
        "applied": True,
        "setting": "ahead",
        "reason": "1 worker processes make the batches ahead",
    }
    assert [h.loader for h in fast._helpers if isinstance(h, PrefetchChoice)] == [evaluator.data_loader]


@pytest.mark.parametrize("own", [False, True])
def test_a_near_tie_keeps_the_loaders_own_setting(own):
    """The other setting's iterations take 200 ms, the loader's own 203 ms (the batch costs nothing): 1.015x
    faster, short of the 1.05x needed, so the loader keeps what it had and the reason says a near-tie kept it."""
    ds = _Made(8, cost=0.0)
    loader = SafeThreadDataLoader(ds, batch_size=1, prefetch=own)
    # 1.015x apart: a busy host's delays would have to add 7 ms to a median to reach MIN_GAIN's 1.05x
    engine = Engine(lambda e, b: time.sleep(0.203 if loader.prefetch is own else 0.200))
    choice = PrefetchChoice(loader, pairs=3)
    choice.attach(engine)
    engine.run(loader, max_epochs=3)
    assert choice.measured and choice.prefetch is own and loader.prefetch is own, choice.reason
    assert choice.reason.startswith("prefetch: " if own else "on demand: ")
