"""MainThreadCore: the main thread on one core during each iteration only, its whole mask back after (real engines)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

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


def _pinned(script: str, *args: str, tmp_path) -> dict:
    """Run ``script`` in a fresh process that pins OpenMP's workers first; the JSON of its last line."""
    import json
    import subprocess
    import sys

    import torch

    from monai_fast.openmp import libgomp_mapped, physical_cores

    if torch.get_num_threads() != len(physical_cores()) or not libgomp_mapped():
        pytest.skip("torch's threads do not cover this host's cores: nothing is pinned")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES", "MONAI_FAST_PIN_OPENMP")}
    env["MONAI_FAST_CACHE"] = str(tmp_path / "cache")
    # the scripts import helpers from this folder (inference_parts, test_fast_training)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_RACE_ENGINES = """
import json, os, sys
import torch
from ignite.engine import Events
from monai_fast.openmp import free_core, pin_openmp_workers
assert pin_openmp_workers() is not None
from monai_fast.handlers import MainThreadCore
from monai_fast.handlers.lifecycle import handlers_on
from monai_fast.apps.demo import RaceSpec, SyntheticData
from monai_fast.apps.demo.core import load_data
from monai_fast.apps.training.options import recipe_config
from monai_fast.apps.training.run import TargetRun
_, train, val = load_data(RaceSpec(synthetic=SyntheticData(cases=4, shape=(32, 32, 32)), progress=False))
config = recipe_config({"max_epochs": 1, "patch_size": (32, 32, 32), "channels": (4, 8), "strides": (2,),
                        "precision": "fp32", "val_interval": 1}, seed=0)
run = TargetRun(sys.argv[1], train, val, config, "cpu", 0.99, 300, None, False)
engines = {"trainer": run.built.trainer, "evaluator": run.built.evaluator}
seen = {name: [] for name in engines}
for name, engine in engines.items():
    engine.add_event_handler(
        Events.ITERATION_STARTED(once=1), lambda e, n=name: seen[n].append(sorted(os.sched_getaffinity(0)))
    )
run.segment(epochs=1)
cores = {name: sorted(handlers_on(e)[MainThreadCore].core or []) for name, e in engines.items()}
from monai_fast.handlers import ValidationSchedule
schedule = handlers_on(run.built.trainer).get(ValidationSchedule)
if schedule is not None:  # the schedule's cheap estimate runs on its own engine
    cores["estimator"] = sorted(handlers_on(schedule.estimator)[MainThreadCore].core or [])
print(json.dumps({"core": sorted(free_core()), "cores": cores, "seen": seen, "after": sorted(os.sched_getaffinity(0))}))
"""


@pytest.mark.skipif(len(ALL) < 2, reason="pinning needs 2 or more cores")
@pytest.mark.parametrize("recipe", ["fast", "baseline"])
def test_the_race_runs_each_iteration_on_the_free_core_when_the_workers_are_pinned(recipe, tmp_path):
    doc = _pinned(_RACE_ENGINES, recipe, tmp_path=tmp_path)
    engines = {"trainer", "evaluator"} | ({"estimator"} if recipe == "fast" else set())  # fast validates on a schedule
    assert doc["cores"] == {name: doc["core"] for name in engines}  # every engine carries the free core
    assert doc["seen"]["trainer"] == [doc["core"]] and doc["seen"]["evaluator"] == [doc["core"]]  # and compute on it
    assert doc["after"] == sorted(ALL)  # and the main thread has every CPU back after the run


_INFER_AND_TUNE = """
import json, os, sys
import torch
from monai_fast.openmp import free_core, pin_openmp_workers
assert pin_openmp_workers() is not None
from inference_parts import CONFIG, write_model
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.apps.inference import infer
from monai_fast.apps.inference.checkpoint import load_checkpoint
from monai_fast.tune import SearchSpace, Tuner
seen = {"infer": [], "tune": [], "tune_main": []}
def hook(name):
    return lambda module, args: seen[name].append(sorted(os.sched_getaffinity(0)))
root = synthetic_dataset("spleen-like", 2, (32, 32, 24), 0, progress=False)
image = sorted(str(p) for p in (root / "imagesTr").glob("*.nii.gz"))[0]
net, config = load_checkpoint(write_model(__import__("pathlib").Path(sys.argv[1]) / "model.pt"))
net.register_forward_pre_hook(hook("infer"))
infer(net, [image], sys.argv[1], config=CONFIG, progress=False, preflight=False)
tnet = UNet(3, 1, 2, channels=(4, 8), strides=(2,))
tnet.register_forward_pre_hook(hook("tune"))
tune = lambda: Tuner(tnet, DiceCELoss(to_onehot_y=True, softmax=True), lambda p: torch.optim.SGD(p, lr=0.01),
                     patch_size=(16, 16, 16), val_shape=(24, 24, 24), device="cpu", num_samples=1, min_time_s=0.0,
                     min_iters=1, space=SearchSpace(batch_range=(1, 2), sw_batch_range=(1, 2), max_trials=2,
                                                    precisions=("fp32",))).run()
tune()
import threading
seen["tune_main"], seen["tune"] = seen["tune"], []
thread = threading.Thread(target=tune)  # as from a background validation: that thread keeps its mask
thread.start(); thread.join()
print(json.dumps({"core": sorted(free_core()), "seen": seen, "after": sorted(os.sched_getaffinity(0))}))
"""


@pytest.mark.skipif(len(ALL) < 2, reason="pinning needs 2 or more cores")
def test_infer_and_the_tuners_trials_compute_on_the_free_core_when_the_workers_are_pinned(tmp_path):
    doc = _pinned(_INFER_AND_TUNE, str(tmp_path), tmp_path=tmp_path)
    warm_up, *windows = doc["seen"]["infer"]
    assert warm_up == sorted(ALL)  # the backend's warm-up, before the loop: it may start a compiler's workers
    assert windows and set(map(tuple, windows)) == {tuple(doc["core"])}  # every window batch of the loop
    tune_calls = {tuple(c) for c in doc["seen"]["tune_main"]}
    assert doc["seen"]["tune_main"] and tune_calls == {tuple(doc["core"])}  # every trial's steps and windows (its copy)
    assert doc["seen"]["tune"] and {tuple(c) for c in doc["seen"]["tune"]} == {
        tuple(sorted(ALL))
    }  # another thread: left alone
    assert doc["after"] == sorted(ALL)


_USER_TRAINER = """
import json, os
import torch
from ignite.engine import Events
from monai_fast.openmp import free_core, pin_openmp_workers
assert pin_openmp_workers() is not None
from test_fast_training import _user_trainer
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.handlers import FastTraining, MainThreadCore
from monai_fast.handlers.lifecycle import handlers_on
root = synthetic_dataset("spleen-like", 4, (48, 48, 32), 0, progress=False)
trainer, evaluator = _user_trainer(load_msd_datalist(root, val_fraction=0.34, seed=0), max_epochs=2)
seen = {"trainer": [], "evaluator": [], "between": [], "completed": []}
# the user's own handler, registered before FastTraining (as train_handlers are): it runs between iterations
trainer.add_event_handler(
    Events.ITERATION_COMPLETED, lambda e: seen["completed"].append(sorted(os.sched_getaffinity(0)))
)
FastTraining(precision="fp32", memory_format=False).attach(trainer, evaluator)
trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: seen["trainer"].append(sorted(os.sched_getaffinity(0))))
evaluator.add_event_handler(
    Events.ITERATION_STARTED, lambda e: seen["evaluator"].append(sorted(os.sched_getaffinity(0)))
)
trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: seen["between"].append(sorted(os.sched_getaffinity(0))))
trainer.run()
print(json.dumps({"core": sorted(free_core()), "seen": seen, "after": sorted(os.sched_getaffinity(0)),
                  "cores": [sorted(handlers_on(e)[MainThreadCore].core) for e in (trainer, evaluator)]}))
"""


@pytest.mark.skipif(len(ALL) < 2, reason="pinning needs 2 or more cores")
def test_fast_training_puts_the_users_iterations_on_the_free_core_when_the_script_pinned_the_workers(tmp_path):
    doc = _pinned(_USER_TRAINER, tmp_path=tmp_path)
    assert doc["cores"] == [doc["core"], doc["core"]]
    # ITERATION_STARTED handlers added after FastTraining run once its MainThreadCore took the core
    assert doc["seen"]["trainer"] and {tuple(c) for c in doc["seen"]["trainer"]} == {tuple(doc["core"])}
    assert doc["seen"]["evaluator"] and {tuple(c) for c in doc["seen"]["evaluator"]} == {tuple(doc["core"])}
    assert doc["seen"]["between"] == [sorted(ALL)] * 2 and doc["after"] == sorted(ALL)  # every CPU between iterations
    assert doc["seen"]["completed"] and doc["seen"]["completed"] == [sorted(ALL)] * len(doc["seen"]["completed"])
