import pytest
import torch
from ignite.engine import Engine
from monai.data import CacheDataset
from monai.handlers import StatsHandler
from monai.transforms import Compose, Lambdad, RandLambdad

from monai_fast.handlers import NVTXHandler
from monai_fast.handlers.profiling import nvtx_range
from monai_fast.telemetry.nvtx import PackageNvtx, RecordingNvtx


def test_exact_sequence_on_a_plain_engine():
    rec = RecordingNvtx()
    engine = Engine(lambda e, b: b)
    NVTXHandler(backend=rec).attach(engine)
    engine.run([1, 2], max_epochs=1)
    names = [(c[0], c[1]) for c in rec.calls]
    p = "rank0 train: "
    assert names == [
        ("push", p + "run"),
        ("push", p + "epoch 1"),
        ("push", p + "get batch"),
        ("pop", p + "get batch"),
        ("push", p + "iteration"),
        ("pop", p + "iteration"),
        ("push", p + "get batch"),
        ("pop", p + "get batch"),
        ("push", p + "iteration"),
        ("pop", p + "iteration"),
        ("pop", p + "epoch 1"),
        ("pop", p + "run"),
    ]
    colors = {c[1].split(": ")[1].split(" ")[0]: c[2] for c in rec.calls if c[0] == "push"}
    assert len(set(colors.values())) == len(colors)  # one colour per phase


def test_monai_trainer_phases_and_evaluator(tiny_files, tiny_config):
    from monai_fast.apps.recipes import build_recipe

    r = build_recipe("fast", *tiny_files, tiny_config, progress=False)
    rec = RecordingNvtx()
    NVTXHandler(backend=rec).attach(r.trainer)
    NVTXHandler(backend=rec).attach(r.evaluator)
    r.trainer.run()
    assert rec.open_ranges == []
    pushes = [c[1] for c in rec.calls if c[0] == "push"]
    first_iter = pushes.index("rank0 train: iteration")
    assert pushes[first_iter : first_iter + 5] == [
        "rank0 train: iteration",
        "rank0 train: forward",
        "rank0 train: loss",
        "rank0 train: backward",
        "rank0 train: optimizer step",
    ]
    assert pushes.count("rank0 train: optimizer step") == r.trainer.state.iteration
    assert "rank0 validation: run" in pushes and "rank0 validation: forward" in pushes
    assert "rank0 validation: loss" not in pushes
    # validation is nested inside the training epoch
    calls = [(c[0], c[1]) for c in rec.calls]
    assert calls.index(("push", "rank0 validation: run")) < calls.index(("pop", "rank0 train: epoch 1"))


@pytest.mark.parametrize("with_stats_handler", [False, True])
def test_open_ranges_are_popped_when_the_engine_raises(with_stats_handler):
    rec = RecordingNvtx()

    def step(engine, batch):
        if engine.state.iteration == 2:
            raise RuntimeError("boom in iteration 2")

    engine = Engine(step)
    if with_stats_handler:
        StatsHandler(name="t", iteration_log=False).attach(engine)  # re-raises first among handlers it precedes
    NVTXHandler(backend=rec).attach(engine)
    with pytest.raises(RuntimeError, match="boom in iteration 2"):
        engine.run([0, 1, 2], max_epochs=1)
    assert rec.open_ranges == []
    assert rec.calls[-1] == ("pop", "rank0 train: run")


def test_double_attach_and_bad_label():
    h = NVTXHandler(backend=RecordingNvtx())
    e = Engine(lambda e, b: b)
    h.attach(e)
    with pytest.raises(RuntimeError, match="already attached"):
        h.attach(e)
    with pytest.raises(ValueError, match="label"):
        NVTXHandler(label=" ")


def test_nvtx_range_keeps_the_cache_split():
    rec = RecordingNvtx()
    calls = {"det": 0, "rand": 0}

    def det(x):
        calls["det"] += 1
        return x + 1

    def rnd(x):
        calls["rand"] += 1
        return x * 2

    chain = Compose(
        [nvtx_range(Lambdad("a", det), "Det", rec), nvtx_range(RandLambdad("a", rnd, prob=1.0), "Rand", rec)]
    )
    ds = CacheDataset([{"a": 1}, {"a": 2}], chain, cache_rate=1.0, progress=False)
    assert calls == {"det": 2, "rand": 0}  # the wrapped random transform is not cached
    assert ds[0]["a"] == 4 and ds[1]["a"] == 6
    assert calls == {"det": 2, "rand": 2}
    assert ("push", "Det", "grey") in rec.calls and ("push", "Rand", "grey") in rec.calls
    chain.set_random_state(seed=1)  # reaches the wrapped random transform without error


def test_real_nvtx_package_runs_on_this_build():
    backend = PackageNvtx()
    engine = Engine(lambda e, b: b)
    NVTXHandler(backend=backend).attach(engine)
    engine.run([0, 1], max_epochs=2)
    assert engine.state.iteration == 4  # ranges pushed and popped through the nvtx package, no error


@pytest.mark.gpu
def test_nvtx_on_cuda_with_real_package():
    import torch

    engine = Engine(lambda e, b: torch.randn(512, 512, device="cuda").sum().item())
    NVTXHandler().attach(engine)
    engine.run(list(range(4)), max_epochs=2)
    assert engine.state.iteration == 8


def test_wrapped_transforms_stay_invertible_in_a_compose():
    import numpy as np
    from monai.transforms import Compose, Flipd, RandFlipd

    rec = RecordingNvtx()
    image = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)
    chain = Compose(
        [
            nvtx_range(Flipd("image", spatial_axis=0), backend=rec),
            nvtx_range(RandFlipd("image", prob=1.0, spatial_axis=2), backend=rec),
        ]
    )
    out = chain({"image": image.clone()})
    assert not np.array_equal(np.asarray(out["image"]), image.numpy())
    back = chain.inverse(out)
    assert np.array_equal(np.asarray(back["image"]), image.numpy()), "Compose.inverse must undo wrapped transforms"
    assert rec.open_ranges == [] and ("push", "RandFlipd inverse", rec.calls[-2][2]) in rec.calls
