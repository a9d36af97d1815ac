"""CompileChoice on a real MONAI trainer: torch.compile where a copy measured faster in rounds, never from one
timing, never for a run too short to repay it; MetaTensor inputs reach the compiled graph as plain tensors."""

from __future__ import annotations

import time

import pytest
import torch
from ignite.engine import Events

from monai_fast.handlers.compile import CompileChoice

#: the input types the compiled forwards were called with (kept outside the graph: a list the graph
#: read would be guarded on, and recompiled for at every call)
_COMPILED_SAW: list[type] = []


@torch.compiler.disable
def _pause(seconds: float) -> None:
    time.sleep(seconds)


@torch.compiler.disable
def _compiled_pause(seconds: float, x: torch.Tensor) -> None:
    _COMPILED_SAW.append(type(x))
    time.sleep(seconds)


class _Known(torch.nn.Module):
    """A real 3-D convolution whose eager step sleeps ``eager_s`` and whose compiled step sleeps ``compiled_s``.

    ``torch.compiler.is_compiling()`` is a constant while the graph is traced, so each branch belongs to
    one variant; the pause is a function the compiler leaves out (a graph break, as a user's code may have).
    """

    def __init__(self, eager_s: float, compiled_s: float):
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 2, 3, padding=1)
        self.eager_s, self.compiled_s = eager_s, compiled_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            _compiled_pause(self.compiled_s, x)
        else:
            _pause(self.eager_s)
        return self.conv(x)


@pytest.fixture(autouse=True)
def _warm_compiler_cache(tmp_path_factory, monkeypatch):
    """One inductor cache for this module's compiles (the first is cold, the rest reuse it)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))


def _trainer(tiny_files, net, max_epochs):
    from test_fast_training import _user_trainer

    trainer, _ = _user_trainer(tiny_files, network=net, max_epochs=max_epochs)
    return trainer


def _run_steps(trainer, steps: int) -> None:
    from ignite.engine import Events

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=steps), lambda e: e.terminate())
    trainer.run()


def test_a_compile_that_measures_faster_is_kept_and_the_weights_keys_do_not_change(tiny_files):
    # a 0.25 s gap in every round: a stall of the compiled step on a busy host (half a core each for two
    # pytest workers) stays well inside it, and a decision that was not made from the rounds still fails
    net = _Known(eager_s=0.25, compiled_s=0.0)
    keys = list(net.state_dict())
    _COMPILED_SAW.clear()
    trainer = _trainer(tiny_files, net, max_epochs=10_000)  # a long planned run: the compile pays back
    seen = []
    choice = CompileChoice("auto", on_choice=lambda *a: seen.append(a))
    choice.attach(trainer)
    _run_steps(trainer, 3)
    assert choice.compiled and "compiled faster" in choice.reason, choice.reason
    rounds = choice.evidence["rounds"]["rounds_s"]
    assert len(rounds) >= 3 and all(e > c for e, c in rounds)  # every round, not one timing
    assert not choice.evidence["fullgraph"] and "graph breaks" in choice.reason  # the pause breaks the graph
    assert list(net.state_dict()) == keys
    # the trainer's real batches are MetaTensors; the compiled forward saw plain tensors (no eager call recorded)
    from monai.data import MetaTensor

    assert isinstance(trainer.state.batch[0]["image"], MetaTensor)  # decollated by MONAI after the step
    assert _COMPILED_SAW and set(_COMPILED_SAW) == {torch.Tensor}  # the compiled forwards saw plain tensors
    assert len(seen) == 1 and seen[0][0] is True


def test_a_compile_that_measures_slower_leaves_the_network_eager(tiny_files):
    net = _Known(eager_s=0.02, compiled_s=0.1)
    trainer = _trainer(tiny_files, net, max_epochs=100_000)  # long enough to be worth measuring
    choice = CompileChoice("auto")
    choice.attach(trainer)
    _run_steps(trainer, 2)
    assert not choice.compiled and "eager kept" in choice.reason, choice.reason
    assert len(choice.evidence["rounds"]["rounds_s"]) >= 3 and "forward" not in net.__dict__


def test_a_short_run_is_not_compiled_at_all(tiny_files, monkeypatch):
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    net = _Known(eager_s=0.05, compiled_s=0.0)
    trainer = _trainer(tiny_files, net, max_epochs=2)
    choice = CompileChoice("auto")
    choice.attach(trainer)
    _run_steps(trainer, 1)
    assert not choice.compiled and "steps left" in choice.reason and compiles == [], choice.reason
    n = trainer.state.batch[0]["image"].shape[0] * len(trainer.state.batch)  # a short plan measures at most 2 items
    assert f"(measured on 2 of the batch's {n} items)" in choice.reason, choice.reason
    from ignite.engine import Events

    from monai_fast.handlers.lifecycle import callbacks_on

    on_every = callbacks_on(trainer, Events.ITERATION_STARTED) + callbacks_on(trainer, Events.ITERATION_COMPLETED)
    assert choice._compiled_forward not in on_every and choice._eager_forward not in on_every  # eager costs nothing


def test_a_run_whose_time_limit_cannot_repay_the_compile_is_not_compiled(tiny_files, monkeypatch):
    # a long planned run (the eager steps would repay a cold compile many times) under a 30 s time limit: only
    # the steps that fit in it count, and they cannot repay it
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    net = _Known(eager_s=0.05, compiled_s=0.0)
    trainer = _trainer(tiny_files, net, max_epochs=1_000_000)
    choice = CompileChoice("auto", seconds_left=lambda: 30.0)
    choice.attach(trainer)
    _run_steps(trainer, 1)
    assert not choice.compiled and compiles == [], choice.reason
    assert "fit in the 30 s left of the run's time limit" in choice.reason, choice.reason
    assert "(measured on 2 of the batch's" in choice.reason  # a limit, not the plan, bounds the run: 2 items
    assert choice.evidence["planned_steps"] <= 30 / 0.05
    # the same run without a limit would measure a compile: the limit, not the plan, kept it eager
    unlimited = CompileChoice("auto", seconds_left=lambda: None)
    trainer = _trainer(tiny_files, _Known(eager_s=0.05, compiled_s=0.0), max_epochs=1_000_000)
    unlimited.attach(trainer)
    _run_steps(trainer, 1)
    assert compiles and "time limit" not in unlimited.reason, unlimited.reason


def test_fast_training_counts_its_time_limit_from_the_trainers_start(tiny_files, monkeypatch):
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining

    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    trainer, _ = _user_trainer(tiny_files, network=_Known(eager_s=0.05, compiled_s=0.0), max_epochs=1_000_000)
    fast = FastTraining(
        cache=False,
        loader=False,
        precision=False,
        memory_format=False,
        tune_store=None,
        prefetch=False,
        time_limit_s=20.0,
    )
    fast.attach(trainer)
    _run_steps(trainer, 1)
    reason = fast.applied["compile"]["reason"]
    assert compiles == [] and "left of the run's time limit" in reason, reason
    with pytest.raises(ValueError, match="time_limit_s"):
        FastTraining(time_limit_s=0)


def test_mode_is_checked():
    with pytest.raises(ValueError, match="mode"):
        CompileChoice("yes")


def test_a_compile_time_measured_before_gates_the_next_run(tiny_files, tmp_path):
    """The first compile's seconds are kept in the tuning store; a fresh process reads them for its pay-back gate,
    a run without them assumes 120 s, and a run long enough to repay the one measured compiles."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from monai_fast.tune import TuneStore

    store = tmp_path / "tuning.json"
    net = _Known(eager_s=0.05, compiled_s=0.0)
    trainer = _trainer(tiny_files, net, max_epochs=10_000)
    first = CompileChoice("auto", store=store)
    first.attach(trainer)
    _run_steps(trainer, 2)
    kept = json.loads(store.read_text())
    assert first.compiled and list(kept.values()) == [pytest.approx(first.evidence["compile_s"], abs=1e-3)]
    (key,) = kept  # the network, shape, precision, device and torch: its key
    assert key.startswith("compile|_Known-"), key

    # a fresh process expects the compile time measured above (an empty store: 120 s assumed)
    script = (
        "import json, sys;"
        "from test_compile_choice import _Known, _trainer, _run_steps;"
        "from monai_fast.handlers.compile import CompileChoice;"
        "files = json.loads(sys.argv[1]); trainer = _trainer(files, _Known(0.0, 0.0), max_epochs=1);"
        "choice = CompileChoice('auto', store=sys.argv[2]); choice.attach(trainer); _run_steps(trainer, 1);"
        "print(json.dumps(choice.evidence))"
    )
    tests = str(Path(__file__).parent)  # the fresh process imports this module's network
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(tiny_files), str(store)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
    expected = json.loads(out.stdout.splitlines()[-1])["expected_compile_s"]
    assert expected == pytest.approx(first.evidence["compile_s"], abs=1e-3), out.stdout

    short = 200  # epochs of 2 steps: 400 x 0.05 s x (1 - 1/1.3) = about 5 s saved, far below 120 s
    net2 = _Known(eager_s=0.05, compiled_s=0.0)
    trainer2 = _trainer(tiny_files, net2, max_epochs=short)
    assumed = CompileChoice("auto", store=None)
    assumed.attach(trainer2)
    _run_steps(trainer2, 1)
    assert not assumed.compiled and "assumed for a first compile" in assumed.reason, assumed.reason

    TuneStore(store).put_seconds(key, 1.0)  # a warm compiler cache: one second
    net3 = _Known(eager_s=0.05, compiled_s=0.0)
    trainer3 = _trainer(tiny_files, net3, max_epochs=short)
    measured = CompileChoice("auto", store=store)
    measured.attach(trainer3)
    _run_steps(trainer3, 2)
    assert measured.compiled, measured.reason


def test_the_training_forward_runs_compiled_and_the_evaluation_forward_eager(tiny_files):
    """Compiled from each training iteration's start to its end: the evaluator's windows (run from the trainer's
    handlers) and a forward outside the run are eager; a detached choice leaves the network as it was."""
    from test_fast_training import _user_trainer

    net = _Known(eager_s=0.0, compiled_s=0.0)
    trainer, evaluator = _user_trainer(tiny_files, network=net, max_epochs=1)
    choice = CompileChoice(True)
    choice.attach(trainer)
    _COMPILED_SAW.clear()
    trainer.run()
    assert choice.compiled and evaluator.state.iteration > 0
    assert len(_COMPILED_SAW) == trainer.state.iteration  # each training forward compiled, no evaluation one
    net.train()(torch.zeros(1, 1, 8, 8, 8))  # a training-mode forward outside the run: eager
    assert len(_COMPILED_SAW) == trainer.state.iteration and "forward" not in net.__dict__
    choice.detach(trainer)
    assert not net._forward_pre_hooks and not choice.compiled


def test_fast_training_keeps_the_compile_time_in_its_own_tune_store(tiny_files, tmp_path):
    import json

    from monai_fast.handlers import FastTraining

    store = tmp_path / "mine.json"
    trainer = _trainer(tiny_files, _Known(eager_s=0.05, compiled_s=0.0), max_epochs=10_000)
    fast = FastTraining(cache=False, precision=False, memory_format=False, prefetch=False, tune_store=store)
    fast.attach(trainer)
    _run_steps(trainer, 2)
    assert fast.applied["compile"]["setting"] == "compiled", fast.applied["compile"]
    assert any(key.startswith("compile|") for key in json.loads(store.read_text()))


def _evaluator(tiny_files, net):
    from test_fast_training import _user_trainer

    _, evaluator = _user_trainer(tiny_files, network=net)
    return evaluator


def test_an_evaluators_windows_are_compiled_after_its_first_iteration_where_it_measures_faster(tiny_files, tmp_path):
    """The first iteration runs eager and counts the windows; measured faster in every round and with many
    validations planned, the later iterations' window batches run compiled, as plain tensors, without gradients."""
    net = _Known(eager_s=0.25, compiled_s=0.0)
    evaluator = _evaluator(tiny_files, net)
    choice = CompileChoice(  # the measurement's own compiled calls are not the evaluator's
        "auto",
        evaluation=True,
        runs_left=lambda: 10_000,
        store=tmp_path / "t.json",
        on_choice=lambda *a: _COMPILED_SAW.clear(),
    )
    choice.attach(evaluator)
    calls: list[bool] = []
    net.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    evaluator.run()
    assert choice.compiled and "compiled faster" in choice.reason, choice.reason
    rounds = choice.evidence["rounds"]["rounds_s"]
    assert len(rounds) >= 3 and all(e > c for e, c in rounds)
    per_volume = len(calls) // evaluator.state.epoch_length
    assert per_volume >= 1 and len(_COMPILED_SAW) == len(calls) - per_volume  # all but the first volume's
    assert set(_COMPILED_SAW) == {torch.Tensor} and not any(calls)  # plain tensors, no gradients
    assert "forward" not in net.__dict__  # eager again between iterations
    assert any(k.startswith("compile-eval|") for k in __import__("json").loads((tmp_path / "t.json").read_text()))


def test_an_evaluator_with_few_windows_left_stays_eager_and_is_never_compiled(tiny_files, monkeypatch):
    import monai_fast.handlers.compile as compile_module

    compiles, copies = [], []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    real_copy = compile_module.network_copy
    monkeypatch.setattr(compile_module, "network_copy", lambda net: copies.append(net) or real_copy(net))
    net = _Known(eager_s=0.01, compiled_s=0.0)
    evaluator = _evaluator(tiny_files, net)
    choice = CompileChoice("auto", evaluation=True, runs_left=lambda: 3, store=None)
    choice.attach(evaluator)
    evaluator.run()
    evaluator.run()  # a later validation: decided once
    assert not choice.compiled and "network calls left" in choice.reason and compiles == [], choice.reason
    assert copies == [] and choice.evidence["eager_step_s"] >= 0.01  # weighed on the run's own eager calls


def test_fast_training_compiles_the_trainer_and_the_evaluator_as_two_levers(tiny_files):
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining
    from monai_fast.telemetry.record import Lever

    trainer, evaluator = _user_trainer(tiny_files, network=_Known(0.0, 0.0), max_epochs=2)
    fast = FastTraining(cache=False, precision=False, memory_format=False, prefetch=False, compile=False)
    fast.attach(trainer, evaluator)
    assert fast.applied[Lever.VALIDATION_COMPILE] == {
        "applied": False,
        "setting": None,
        "reason": "switched off (compile=False)",
    }
    trainer, evaluator = _user_trainer(tiny_files, network=_Known(0.0, 0.0), max_epochs=2)
    fast = FastTraining(cache=False, precision=False, memory_format=False, prefetch=False, tune_store=None)
    fast.attach(trainer, evaluator)
    trainer.run()  # two epochs, two validations: far too short to repay a compile of either
    for lever in (Lever.COMPILE, Lever.VALIDATION_COMPILE):
        assert fast.applied[lever]["setting"] == "eager" and "left of" in fast.applied[lever]["reason"], fast.applied


def _failing_compile(*args, **kwargs):
    """``torch.compile`` where the compiler is missing: the compiled function raises at its first call."""

    def compiled(*a, **k):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx")

    return compiled


def test_a_compiler_that_fails_at_the_first_call_leaves_the_run_eager_with_one_warning(tiny_files, monkeypatch, caplog):
    """``compile=True`` measures nothing first: the first compiled call fails, that same call runs eager, and the run
    goes on eager with one warning (a CPU without a C++ compiler)."""
    import logging

    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining

    monkeypatch.setattr(torch, "compile", _failing_compile)
    net = _Known(0.0, 0.0)
    trainer, evaluator = _user_trainer(tiny_files, network=net, max_epochs=2)
    fast = FastTraining(cache=False, precision=False, memory_format=False, prefetch=False, compile=True)
    fast.attach(trainer, evaluator)
    with caplog.at_level(logging.WARNING, logger="monai_fast"):
        trainer.run()
    assert trainer.state.epoch == 2 and "forward" not in net.__dict__ and not net._forward_pre_hooks
    for lever in ("compile", "validation compile"):
        assert fast.applied[lever]["setting"] == "eager" and "torch.compile failed" in fast.applied[lever]["reason"]
    warned = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warned) == 1 and "InvalidCxxCompiler" in warned[0], warned  # one, though both engines fell back


def test_an_error_of_the_users_network_is_raised_as_it_is_not_taken_for_a_compiler_failure(monkeypatch):
    from ignite.engine import Engine

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise ValueError("the user's own bug")

    monkeypatch.setattr(torch, "compile", _failing_compile)
    engine = Engine(lambda e, b: e.network(b))
    engine.network = Broken()
    choice = CompileChoice(True, store=None)
    choice.attach(engine)
    with pytest.raises(ValueError, match="the user's own bug"):
        engine.run([torch.zeros(1, 1, 4, 4, 4)], max_epochs=1)
    assert "failed" not in choice.reason


class _KnownLayouts(torch.nn.Module):
    """Two real 3-D convolutions: the eager step sleeps ``eager_s`` in either layout, the compiled one ``plain_s``
    with contiguous weights and ``last_s`` with channels_last_3d weights (a layout that ties eager, pays compiled)."""

    def __init__(self, eager_s: float, plain_s: float, last_s: float, eager_last_s: float | None = None):
        super().__init__()
        self.first, self.second = torch.nn.Conv3d(1, 2, 3, padding=1), torch.nn.Conv3d(2, 2, 3, padding=1)
        self.eager_s, self.plain_s, self.last_s = eager_s, plain_s, last_s
        self.eager_last_s = eager_s if eager_last_s is None else eager_last_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.second.weight  # its strides are constants of the traced graph
        last = w.is_contiguous(memory_format=torch.channels_last_3d) and not w.is_contiguous()
        if torch.compiler.is_compiling():
            _compiled_pause(self.last_s if last else self.plain_s, x)
        else:
            _pause(self.eager_last_s if last else self.eager_s)
        return self.second(self.first(x))


@pytest.mark.parametrize("last_s, layout", [(0.0, "channels_last_3d"), (0.25, "contiguous")])
def test_the_compiled_step_is_measured_in_both_layouts_and_the_faster_one_is_kept(tiny_files, last_s, layout):
    from monai_fast.handlers.memory_format import in_channels_last_3d

    net = _KnownLayouts(eager_s=0.3, plain_s=0.12, last_s=last_s)
    keys = list(net.state_dict())
    trainer = _trainer(tiny_files, net, max_epochs=100_000)  # repays a second compile, however slow the first
    choice = CompileChoice("auto", memory_formats=True)
    choice.attach(trainer)
    _run_steps(trainer, 2)
    assert choice.compiled, choice.reason
    rounds = choice.evidence["memory_format"]
    assert (rounds["baseline"], rounds["choice"]) == ("contiguous", layout), choice.reason
    assert len(rounds["rounds_s"]) >= 3 and "compiled in both layouts" in choice.reason
    assert in_channels_last_3d(net) == (layout == "channels_last_3d") and list(net.state_dict()) == keys
    choice.detach(trainer)
    assert not in_channels_last_3d(net) and "forward" not in net.__dict__  # detached: its own layout, eager
    # without the option, the compile leaves the layout as it found it
    net = _KnownLayouts(eager_s=0.3, plain_s=0.12, last_s=0.0)
    trainer = _trainer(tiny_files, net, max_epochs=100_000)
    choice = CompileChoice("auto")
    choice.attach(trainer)
    _run_steps(trainer, 2)
    assert choice.compiled and "memory_format" not in choice.evidence and not in_channels_last_3d(net)


def test_fast_training_says_the_layout_the_compiled_step_chose(tiny_files):
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining
    from monai_fast.telemetry.record import Lever

    # channels_last_3d clearly slower eager (the layout lever keeps contiguous), clearly faster compiled
    net = _KnownLayouts(eager_s=0.3, plain_s=0.12, last_s=0.0, eager_last_s=0.5)
    trainer, evaluator = _user_trainer(tiny_files, network=net, max_epochs=100_000)
    fast = FastTraining(cache=False, precision=False, prefetch=False, evaluator=False, tune_store=None)
    fast.attach(trainer)
    _run_steps(trainer, 9)  # the layout's warm-ups and three rounds on the run's own steps, then the compile
    said = fast.applied[Lever.MEMORY_FORMAT]
    assert said["setting"] == "channels_last_3d" and said["reason"].endswith("(compiled)"), fast.applied
    # the optimizer's state (made in the layout rounds' steps) moved with the weights: a fused optimizer needs it
    for p in net.parameters():
        assert all(v.stride() == p.stride() for v in trainer.optimizer.state[p].values() if v.shape == p.shape)
    assert said["evidence"]["baseline"] == "contiguous" and fast.applied[Lever.COMPILE]["setting"] == "compiled"


def test_a_short_run_weighs_the_compile_on_the_step_the_layout_lever_measured_without_measuring_again(
    tiny_files, monkeypatch
):
    import statistics

    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining
    from monai_fast.telemetry.record import Lever

    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    net = _KnownLayouts(eager_s=0.05, plain_s=0.0, last_s=0.0)  # the layouts tie eager
    trainer, _ = _user_trainer(tiny_files, network=net, max_epochs=8)  # 16 steps: up to 5 layout rounds fit
    fast = FastTraining(cache=False, precision=False, prefetch=False, evaluator=False, tune_store=None)
    fast.attach(trainer)
    seen = []  # the compile gate decides once the layout is chosen, at the step after its rounds
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(Lever.COMPILE in fast.applied))
    _run_steps(trainer, 16)
    layout, gate = fast.applied[Lever.MEMORY_FORMAT], fast.applied[Lever.COMPILE]
    assert seen.index(True) == 2 + 2 * len(layout["evidence"]["rounds_s"]), seen
    rounds = layout["evidence"]
    assert len(rounds["rounds_s"]) >= 3, layout
    kept = statistics.median(r[0 if rounds["choice"] == rounds["baseline"] else 1] for r in rounds["rounds_s"])
    assert rounds["step_s"] == pytest.approx(kept, abs=1e-6)
    assert gate["setting"] == "eager" and "steps left" in gate["reason"] and compiles == [], gate
    # the layout lever's rounds on the run's batch, per item for the 2 items a short run weighs: no timing of its own
    assert rounds["batch"][0] > 2 and "(measured on 2 of the batch's" in gate["reason"], gate
    assert gate["evidence"]["eager_step_s"] == pytest.approx(rounds["step_s"] * 2 / rounds["batch"][0])


def test_a_run_that_ends_before_the_layout_is_chosen_says_the_compile_was_never_measured(tiny_files, monkeypatch):
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining
    from monai_fast.telemetry.record import Lever

    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    net = _KnownLayouts(eager_s=0.02, plain_s=0.0, last_s=0.0)
    trainer, _ = _user_trainer(tiny_files, network=net, max_epochs=100_000)  # a plan that would repay a compile
    fast = FastTraining(cache=False, precision=False, prefetch=False, evaluator=False, tune_store=None)
    fast.attach(trainer)
    _run_steps(trainer, 3)  # stopped inside the layout's rounds
    layout, gate = fast.applied[Lever.MEMORY_FORMAT], fast.applied[Lever.COMPILE]
    assert "the run ended after 0 of the 3 rounds" in layout["reason"], layout
    assert gate["setting"] == "eager" and "the run ended before the choice was ready" in gate["reason"], gate
    assert compiles == []


def test_a_known_step_of_another_batch_size_is_weighed_per_item(tiny_files, monkeypatch):
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or a[0])
    trainer = _trainer(tiny_files, _Known(eager_s=0.05, compiled_s=0.0), max_epochs=2)  # batches of 2 items
    choice = CompileChoice("auto", eager_step=lambda: (8, 0.4), compile_seconds=100.0)
    choice.attach(trainer)
    _run_steps(trainer, 1)
    assert not choice.compiled and compiles == [] and choice.evidence["eager_step_s"] == pytest.approx(0.1)


class _FlatWeight(_KnownLayouts):
    """A 4-D weight beside the 3-D convolutions: ``channels_last_3d`` cannot be applied to the whole network."""

    def __init__(self, *times: float):
        super().__init__(*times)
        self.flat = torch.nn.Conv2d(2, 2, 1)  # never called: its 4-D weight is what matters


def test_a_network_that_refuses_the_other_layout_is_compiled_in_its_own(tiny_files):
    net = _FlatWeight(0.3, 0.12, 0.0)
    trainer = _trainer(tiny_files, net, max_epochs=100_000)
    choice = CompileChoice("auto", memory_formats=True)
    choice.attach(trainer)
    _run_steps(trainer, 2)
    assert choice.compiled and "memory_format" not in choice.evidence, choice.reason


class _Oversized(_Known):
    """A step on more than 2 items runs out of accelerator memory (a fake at the hardware edge)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _refuse_many(x)
        return super().forward(x)


@torch.compiler.disable
def _refuse_many(x: torch.Tensor) -> None:
    if x.shape[0] > 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_whole_batch_that_runs_out_of_memory_is_measured_on_two_items(tiny_files):
    net = _Oversized(eager_s=0.25, compiled_s=0.0)
    trainer = _trainer(tiny_files, net, max_epochs=100_000)  # long enough to measure on the whole batch
    choice = CompileChoice("auto", compile_seconds=1.0)
    choice.attach(trainer)
    # the real batch of more than 2 items is refused too: the run itself fails, after the choice was made
    with pytest.raises(torch.OutOfMemoryError):
        _run_steps(trainer, 1)
    assert choice.evidence["batch"][0] == 2 and "compiled faster" in choice.reason, choice.evidence


def _pinned_rank(local_rank: int, files, out) -> None:
    """One rank of a DDP trainer built with ``find_unused_parameters=True`` around a network whose step is faster in
    ``channels_last_3d``, eager and compiled; FastTraining's levers as they would act on it, written to ``out``."""
    import json
    import warnings

    import ignite.distributed as idist
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining
    from monai_fast.handlers.memory_format import in_channels_last_3d
    from monai_fast.telemetry.record import Lever

    net = _KnownLayouts(eager_s=0.3, plain_s=0.12, last_s=0.0, eager_last_s=0.1)
    ddp = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    trainer, _ = _user_trainer(files, network=ddp, max_epochs=100_000)  # repays any compile
    fast = FastTraining(cache=False, loader=False, precision=False, prefetch=False, evaluator=False, tune_store=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast.attach(trainer)
        _run_steps(trainer, 2)
    said = {lever: fast.applied[lever] for lever in (Lever.MEMORY_FORMAT, Lever.COMPILE)}
    doc = {
        "layout": said[Lever.MEMORY_FORMAT]["setting"],
        "layout_reason": said[Lever.MEMORY_FORMAT]["reason"],
        "compiled": said[Lever.COMPILE]["setting"],
        "compile_measured_layouts": "memory_format" in (said[Lever.COMPILE].get("evidence") or {}),
        "weights_last": in_channels_last_3d(net),
        "stride_warnings": [str(w.message)[:80] for w in caught if "strides do not match" in str(w.message)],
    }
    (out / f"rank{idist.get_rank()}.json").write_text(json.dumps(doc))


def test_a_ddp_network_that_never_rebuilds_its_buckets_keeps_its_layout(tiny_files, tmp_path):
    # DDP with find_unused_parameters=True builds its gradient buckets once, in the weights' layout at wrapping:
    # weights moved afterwards would have each gradient copied across layouts every step, so neither the layout
    # lever nor the compiled step's layout choice moves them (real 2-process gloo DDP, real compiles)
    import json

    import ignite.distributed as idist

    from monai_fast.apps.launch import free_port

    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=free_port()) as parallel:
        parallel.run(_pinned_rank, tiny_files, tmp_path)
    for rank in range(2):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert doc["layout"] == "contiguous" and "find_unused_parameters=True" in doc["layout_reason"], doc
        assert doc["compiled"] == "compiled" and not doc["compile_measured_layouts"], doc
        assert not doc["weights_last"] and not doc["stride_warnings"], doc


def test_an_evaluator_that_is_not_ready_decides_at_the_first_run_that_begins_ready(tiny_files, monkeypatch):
    """While the trainer's layout is being measured the evaluator's choice waits: nothing is copied or counted in
    that run, and the first run that begins ready counts its calls and decides."""
    import monai_fast.handlers.compile as compile_module

    copies, ready = [], [False]
    monkeypatch.setattr(torch, "compile", lambda *a, **k: a[0])
    real_copy = compile_module.network_copy
    monkeypatch.setattr(compile_module, "network_copy", lambda net: copies.append(net) or real_copy(net))
    net = _Known(eager_s=0.01, compiled_s=0.0)
    evaluator = _evaluator(tiny_files, net)
    choice = CompileChoice("auto", evaluation=True, runs_left=lambda: 3, store=None, ready=lambda: ready[0])
    choice.attach(evaluator)
    evaluator.run()
    assert choice.reason == "not decided yet" and copies == [] and choice._counter == []
    evaluator.run()  # still not ready
    ready[0] = True
    evaluator.run()
    assert not choice.compiled and "network calls left" in choice.reason, choice.reason
    assert choice.evidence["eager_step_s"] >= 0.01 and choice._counter == []


def test_fast_training_decides_the_evaluators_compile_only_once_the_trainers_layout_is_chosen(tiny_files, monkeypatch):
    """Validations that run while the trainer's layout is measured (2-iteration epochs, rounds over 8 or more
    iterations) leave the evaluator's compile undecided; the first one after the choice decides it; a run that
    ends before any validation could decide says so."""
    from ignite.engine import Events
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining
    from monai_fast.telemetry.record import Lever

    monkeypatch.setattr(torch, "compile", lambda *a, **k: a[0])
    net = _KnownLayouts(eager_s=0.02, plain_s=0.0, last_s=0.0)
    trainer, evaluator = _user_trainer(tiny_files, network=net, max_epochs=20)
    fast = FastTraining(cache=False, precision=False, prefetch=False, prediction_layout=False, tune_store=None)
    fast.attach(trainer, evaluator)
    seen = []  # at each validation's end: (the layout chosen, the evaluator's compile decided)
    evaluator.add_event_handler(
        Events.COMPLETED, lambda e: seen.append((fast._layout.chosen, Lever.VALIDATION_COMPILE in fast.applied))
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen and seen[-1][1] and e.terminate())
    trainer.run()
    assert seen[0] == (False, False) and seen[-1] == (True, True), seen
    assert [decided for _, decided in seen].count(True) == 1  # decided at the first validation after the choice
    assert seen[-2][1] is False and "the run ended" not in fast.applied[Lever.VALIDATION_COMPILE]["reason"]

    trainer, evaluator = _user_trainer(tiny_files, network=_KnownLayouts(0.02, 0.0, 0.0), max_epochs=20)
    fast = FastTraining(cache=False, precision=False, prefetch=False, prediction_layout=False, tune_store=None)
    fast.attach(trainer, evaluator)
    _run_steps(trainer, 3)  # one validation, inside the layout's rounds
    said = fast.applied[Lever.VALIDATION_COMPILE]
    assert said["setting"] == "eager" and "every validation so far began before the choice was ready" in said["reason"]
    # a run that ends before any validation has nothing to say of it: a later run's validation decides
    trainer, evaluator = _user_trainer(tiny_files, network=_KnownLayouts(0.02, 0.0, 0.0), max_epochs=20)
    fast = FastTraining(cache=False, precision=False, prefetch=False, prediction_layout=False, tune_store=None)
    fast.attach(trainer, evaluator)
    _run_steps(trainer, 1)
    assert Lever.VALIDATION_COMPILE not in fast.applied
