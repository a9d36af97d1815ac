"""The evaluator's predictions with the classes innermost: the same post-processed results, a restored inferer."""

import math

import pytest
import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor
from monai.inferers import SimpleInferer
from monai.transforms import AsDiscrete

from monai_fast.handlers import AMPToggle, ClassesInnermost, FastTraining
from monai_fast.handlers.lifecycle import postprocessing_of
from monai_fast.handlers.prediction_layout import argmax_gain


def _evaluator(tiny_files, argmax: bool = True):
    """The test evaluator; with ``argmax=False`` its post-processing takes no argmax (an argmax of the user's own,
    or none: the predictions themselves get the classes innermost)."""
    from test_fast_training import _user_trainer

    _, evaluator = _user_trainer(tiny_files)
    if argmax:
        return evaluator
    from monai.engines import SupervisedEvaluator

    return SupervisedEvaluator(
        device="cpu",
        val_data_loader=evaluator.data_loader,
        network=evaluator.network,
        inferer=evaluator.inferer,
        postprocessing=None,
    )


def _validate(evaluator):
    """Post-processed predictions, labels and the metric of one validation run."""
    seen = []
    handle = evaluator.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: seen.append([(o["pred"].clone(), o["label"].clone()) for o in e.state.output]),
    )
    evaluator.run()
    handle.remove()
    return seen, evaluator.state.metrics["val_mean_dice"]


def test_argmax_of_a_prediction_with_the_classes_innermost_is_the_same_with_ties_and_nan():
    x = torch.randn(3, 9, 10, 11)
    x[1, 0], x[2, 0] = x[0, 0], x[0, 0]  # three-way ties: the first class wins
    x[:, 1, 0, 0] = float("nan")
    x[2, 2, 0, 0] = float("nan")
    pred = MetaTensor(x[None], meta={"filename_or_obj": "case_1.nii.gz"})
    inner = pred.contiguous(memory_format=torch.channels_last_3d)
    assert inner.stride(1) == 1 and isinstance(inner, MetaTensor) and inner.meta["filename_or_obj"] == "case_1.nii.gz"
    post = AsDiscrete(argmax=True, to_onehot=3)
    a, b = post(pred[0]), post(inner[0])
    assert torch.equal(a, b) and a.dtype == b.dtype and b.meta["filename_or_obj"] == "case_1.nii.gz"
    assert torch.equal(torch.argmax(x, 0), torch.argmax(inner[0], 0))


def test_classes_innermost_gives_the_evaluator_the_same_results_and_detaching_restores_its_inferer(tiny_files):
    # the evaluator's post-processing takes an argmax: its input is reordered there, the inferer is left alone
    evaluator = _evaluator(tiny_files)
    inferer = evaluator.inferer
    before, dice_before = _validate(evaluator)
    layout = ClassesInnermost(True)
    layout.attach(evaluator)
    assert layout.active and evaluator.inferer is inferer
    assert layout.reason == "requested; evaluator: the argmax of 1 post-processing AsDiscreted"
    after, dice_after = _validate(evaluator)
    assert len(before) == len(after) > 0
    for b, a in zip(before, after):
        assert all(torch.equal(pb, pa) and torch.equal(lb, la) for (pb, lb), (pa, la) in zip(b, a))
    assert dice_after == dice_before and math.isfinite(dice_after)
    layout.detach(evaluator)
    assert evaluator.inferer is inferer and not layout.active
    # no argmax in its post-processing: the predictions themselves come with the classes innermost
    evaluator = _evaluator(tiny_files, argmax=False)
    inferer = evaluator.inferer
    layout = ClassesInnermost(True)
    layout.attach(evaluator)
    assert layout.active and evaluator.inferer is not inferer
    assert layout.reason == "requested; evaluator: its predictions"
    assert evaluator.inferer.sw_batch_size == inferer.sw_batch_size  # the sliding window's, read through
    evaluator.inferer.sw_batch_size = 3  # and set through
    assert inferer.sw_batch_size == 3
    image = next(iter(evaluator.data_loader))["image"]
    plain = inferer(image, evaluator.network)
    out = evaluator.inferer(image, evaluator.network)
    assert out.dim() == 5 and out.stride(1) == 1 and torch.equal(out, plain)  # the classes innermost, same values
    layout.detach(evaluator)
    assert evaluator.inferer is inferer and not layout.active


def test_a_softmax_before_the_evaluators_argmax_runs_on_the_layout_it_is_fast_in(tiny_files):
    # MONAI's softmax over the classes is several times slower on classes-innermost input: an evaluator whose chain
    # has an argmax keeps its predictions as the network gives them, and the argmax alone gets the classes innermost
    from monai.engines import SupervisedEvaluator
    from monai.transforms import Activationsd, AsDiscreted, Compose

    from monai_fast.handlers.prediction_layout import _InnermostArgmax

    seen = []

    def softmax(item: dict) -> dict:  # MONAI's softmax, noting the layout of the prediction it is given
        seen.append(item["pred"].stride())
        return Activationsd(keys="pred", softmax=True)(item)

    argmax = AsDiscreted(keys=["pred", "label"], argmax=[True, False], to_onehot=2)
    base = _evaluator(tiny_files)
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=base.data_loader,
        network=base.network,
        inferer=base.inferer,
        postprocessing=Compose([softmax, argmax]),
    )
    layout = ClassesInnermost(True)
    layout.attach(evaluator)
    assert isinstance(argmax.converter, _InnermostArgmax) and evaluator.inferer is base.inferer
    evaluator.run()
    assert seen and all(stride[0] != 1 for stride in seen), seen  # the classes outermost, as the network gave them


def test_auto_measures_the_argmax_and_stays_off_where_it_does_not_pay(tiny_files):
    state = torch.get_rng_state()
    plain_s, inner_s = argmax_gain(size=24, rounds=2)
    assert plain_s > 0 and inner_s > 0
    assert torch.equal(torch.get_rng_state(), state)  # the measurement does not move the run's random stream
    evaluator = _evaluator(tiny_files)
    inferer = evaluator.inferer
    layout = ClassesInnermost(min_gain=1e9)  # no layout is a billion times faster
    layout.attach(evaluator)
    assert not layout.active and evaluator.inferer is inferer
    assert (
        layout.reason.startswith("argmax over classes measured ")
        and "with the classes put innermost first" in layout.reason
    )


def test_only_cpu_predictions_are_converted_and_engines_without_an_inferer_are_refused():
    engine = Engine(lambda e, b: None)
    engine.inferer = SimpleInferer()
    engine.state.device = torch.device("cuda")  # a GPU evaluator may still stitch on the CPU
    layout = ClassesInnermost(True)
    layout.attach(engine)
    assert layout.active and "stitched on cuda pass unchanged" in layout.reason
    out = engine.inferer(torch.randn(1, 1, 4, 5, 6), lambda x: torch.cat([x, -x], 1))
    assert out.stride(1) == 1 and torch.equal(out, torch.cat([out[:, :1], -out[:, :1]], 1))
    flat = engine.inferer(torch.randn(1, 1, 4, 5), lambda x: torch.cat([x, -x], 1))  # 2-D images: not 5-D, unchanged
    assert flat.is_contiguous()
    off_cpu = engine.inferer(torch.empty(1, 1, 4, 5, 6, device="meta"), lambda x: torch.cat([x, -x], 1))
    assert off_cpu.device.type == "meta" and off_cpu.is_contiguous()  # not on the CPU: passed unchanged
    assert engine.inferer.inner.__class__ is SimpleInferer  # other attributes are the inner inferer's
    with pytest.raises(TypeError, match="needs a MONAI trainer, or an evaluator"):
        ClassesInnermost().attach(Engine(lambda e, b: None))
    with pytest.raises(ValueError, match="mode must be 'auto' or True"):
        ClassesInnermost("yes")
    with pytest.raises(ValueError, match="min_gain must be > 1"):
        ClassesInnermost(min_gain=1.0)


def test_fast_training_applies_it_on_the_evaluator_and_unwraps_every_inferer_on_detach(tiny_files):
    from test_fast_training import _user_trainer

    trainer, evaluator = _user_trainer(tiny_files)
    inferers = trainer.inferer, evaluator.inferer
    fast = FastTraining(precision="bf16", memory_format=False, prediction_layout=True)
    fast.attach(trainer, evaluator)
    layout = fast.applied["prediction_layout"]
    assert layout["applied"] and layout["setting"] == "classes innermost"
    # the test trainer's post-processing has no argmax; its evaluator's has one
    assert layout["reason"] == (
        "requested; trainer: nothing to reorder; evaluator: the argmax of 1 post-processing AsDiscreted"
    )
    assert isinstance(evaluator.inferer.toggle, AMPToggle)  # AMPToggle's wrapper alone: ours is not needed
    fast.detach(trainer)
    assert (trainer.inferer, evaluator.inferer) == inferers  # both wrappers undone, in the right order

    trainer, evaluator = _user_trainer(tiny_files)
    fast = FastTraining(precision="fp32", prediction_layout=False)
    fast.attach(trainer, evaluator)
    assert fast.applied["prediction_layout"] == {
        "applied": False,
        "setting": None,
        "reason": "switched off (prediction_layout=False)",
    }
    with pytest.raises(ValueError, match="prediction_layout must be 'auto', True or False"):
        FastTraining(prediction_layout="fast")


def test_monai_fast_infer_post_processing_gives_the_same_label_map_with_the_classes_innermost():
    from monai.transforms import AsDiscreted

    from monai_fast.apps.inference.run import _pred_classes_innermost

    affine = torch.diag(torch.tensor([0.8, 0.8, 2.5, 1.0]))
    pred = MetaTensor(torch.randn(3, 20, 18, 7), affine=affine, meta={"filename_or_obj": "ct_7.nii.gz"})
    pred[:, 0, 0, 0] = 1.0  # a tie
    post = AsDiscreted(keys="pred", argmax=True)
    item = {"pred": pred, "image": "unchanged"}
    inner = _pred_classes_innermost(item)["pred"]
    assert inner.stride(0) == 1 and torch.equal(inner, pred) and item["pred"] is pred  # a new item, the old one kept
    assert inner.applied_operations == pred.applied_operations  # nothing traced
    a, b = post({"pred": pred})["pred"], post({"pred": inner})["pred"]
    assert torch.equal(a, b) and a.dtype == b.dtype and torch.equal(b.affine, affine)
    assert b.meta["filename_or_obj"] == "ct_7.nii.gz" and int(b[0, 0, 0, 0]) == 0  # the first of the tied classes


def test_either_wrapper_can_be_detached_first_whatever_sits_on_top(tiny_files):
    evaluator = _evaluator(tiny_files, argmax=False)  # ClassesInnermost wraps the inferer
    inferer = evaluator.inferer
    amp, layout = AMPToggle("bf16"), ClassesInnermost(True)
    amp.attach(evaluator)
    layout.attach(evaluator)  # ours on top of AMPToggle's
    amp.detach(evaluator)  # the inner one first: it unlinks itself from under ours
    assert evaluator.inferer.inner is inferer
    layout.detach(evaluator)
    assert evaluator.inferer is inferer

    layout, amp = ClassesInnermost(True), AMPToggle("bf16")
    layout.attach(evaluator)
    amp.attach(evaluator)  # AMPToggle's on top of ours
    layout.detach(evaluator)
    assert evaluator.inferer.inner is inferer
    amp.detach(evaluator)
    assert evaluator.inferer is inferer


def test_the_argmax_benchmark_runs_at_toy_size_and_checks_the_labels(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "argmax_layout.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--shapes", "2x8x9x10", "3x4x5x6", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (written,) = tmp_path.glob("argmax_layout_*.json")
    rows = json.loads(written.read_text())["rows"]
    assert [r["shape"] for r in rows] == [[2, 8, 9, 10], [3, 4, 5, 6]] and all(r["same_labels"] for r in rows)
    assert all(r["ms"]["argmax"] / r["ms"]["innermost + argmax"] == pytest.approx(r["speedup_innermost"]) for r in rows)
    bad = subprocess.run([sys.executable, str(script), "--shapes", "2x8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "CxDxHxW" in bad.stderr


class _SeenStrides(AsDiscrete):
    """An ``AsDiscrete`` that notes the strides of what it is given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def __call__(self, img, *args, **kwargs):
        self.seen.append(img.stride())
        return super().__call__(img, *args, **kwargs)


def test_a_post_processing_argmax_after_softmax_gets_the_classes_innermost_and_the_same_result():
    from monai.transforms import Activationsd, AsDiscreted

    from monai_fast.handlers.prediction_layout import _InnermostArgmax

    x = torch.randn(2, 9, 10, 11)
    x[1, 0] = x[0, 0]  # ties: the first class wins either way
    item = {"pred": MetaTensor(x.movedim(0, -1).contiguous().movedim(-1, 0)), "label": torch.ones(1, 9, 10, 11)}
    soft = Activationsd(keys="pred", softmax=True)(dict(item))
    assert soft["pred"].is_contiguous() and soft["pred"].stride(0) != 1  # softmax loses the input's layout
    plain = AsDiscreted(keys=["pred", "label"], argmax=[True, False], to_onehot=2)
    ours = AsDiscreted(keys=["pred", "label"], argmax=[True, False], to_onehot=2)
    spy = ours.converter = _SeenStrides()
    ours.converter = _InnermostArgmax(spy)
    a, b = plain(dict(soft)), ours(dict(soft))
    assert (
        torch.equal(a["pred"], b["pred"]) and torch.equal(a["label"], b["label"]) and a["pred"].dtype == b["pred"].dtype
    )
    assert spy.seen[0][0] == 1  # the argmax's input: classes innermost
    assert spy.seen[1] == item["label"].stride()  # no argmax for the label: passed as it is
    assert ours.converter.argmax is False  # other attributes are the inner AsDiscrete's
    assert b["pred"].meta == a["pred"].meta and torch.equal(b["pred"].affine, a["pred"].affine)


def test_the_argmax_dimension_asdiscrete_is_given_is_the_one_put_innermost():
    from monai_fast.handlers.prediction_layout import _InnermostArgmax

    batch = torch.randn(3, 4, 5, 6, 7)  # a batch of predictions, the classes in dimension 1
    spy = _SeenStrides(argmax=True, dim=1)
    out = _InnermostArgmax(spy)(batch)
    assert spy.seen[0][1] == 1  # dimension 1 innermost, not the batch's
    assert torch.equal(out, AsDiscrete(argmax=True, dim=1)(batch))


def test_reattached_after_a_detach_it_decides_again_and_wraps_again(tiny_files):
    trainer, discrete, _ = _trainer_with_post(tiny_files)
    converter = discrete.converter
    layout = ClassesInnermost(True)
    for _ in range(2):
        layout.attach(trainer)
        assert layout.active and discrete.converter.inner is converter
        assert layout.reason == "requested; trainer: the argmax of 1 post-processing AsDiscreted"
        layout.detach(trainer)
        assert not layout.active and layout.reason == "" and discrete.converter is converter


def test_an_evaluator_that_never_calls_its_inferer_is_said_unused_whatever_the_trainers_chain(tiny_files):
    trainer, _, _ = _trainer_with_post(tiny_files)
    evaluator = Engine(lambda e, b: None)  # a step function of its own, no post-processing
    evaluator.inferer = SimpleInferer()
    layout = ClassesInnermost(True)
    layout.attach(trainer)
    layout.attach(evaluator)
    evaluator.run([0], max_epochs=1)
    assert layout.unused is not None and "does not call its inferer" in layout.unused


def _trainer_with_post(tiny_files):
    """The test trainer, with the spleen bundle's training post-processing (softmax, then argmax)."""
    from monai.engines import SupervisedTrainer
    from monai.transforms import Activationsd, AsDiscreted, Compose
    from test_fast_training import _user_trainer

    trainer, _ = _user_trainer(tiny_files)
    post = Compose(
        [
            Activationsd(keys="pred", softmax=True),
            AsDiscreted(keys=["pred", "label"], argmax=[True, False], to_onehot=2),
        ]
    )
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=trainer.data_loader,
        network=trainer.network,
        optimizer=trainer.optimizer,
        loss_function=trainer.loss_function,
        postprocessing=post,
    )
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append([o["pred"] for o in e.state.output]))
    return trainer, post.transforms[1], seen


def test_a_trainers_post_processing_argmax_gets_the_classes_innermost_with_the_same_results(tiny_files):
    from monai_fast.handlers.prediction_layout import _InnermostArgmax

    plain, _, before = _trainer_with_post(tiny_files)
    plain.run()
    trainer, discrete, after = _trainer_with_post(tiny_files)
    converter, inferer = discrete.converter, trainer.inferer
    layout = ClassesInnermost(True)
    layout.attach(trainer)
    assert isinstance(discrete.converter, _InnermostArgmax) and trainer.inferer is inferer  # the loss's input as it was
    assert layout.argmax_transforms[id(trainer)] == ["AsDiscreted"]
    assert layout.reason == "requested; trainer: the argmax of 1 post-processing AsDiscreted"
    trainer.run()
    assert len(before) == len(after) > 0
    for b, a in zip(before, after):
        assert all(torch.equal(pb, pa) for pb, pa in zip(b, a))
    layout.detach(trainer)
    assert discrete.converter is converter and not layout.active


def test_fast_training_reorders_a_trainers_post_processing_argmax_without_an_evaluator(tiny_files):
    trainer, discrete, _ = _trainer_with_post(tiny_files)
    fast = FastTraining(
        cache=False, loader=False, prefetch=False, precision=False, memory_format=False, prediction_layout=True
    )
    fast.attach(trainer)
    layout = fast.applied["prediction_layout"]
    assert layout["setting"] == "classes innermost", layout
    assert layout["reason"].endswith("; trainer: the argmax of 1 post-processing AsDiscreted"), layout
    fast.detach(trainer)
    assert type(discrete.converter) is AsDiscrete


def test_a_post_processing_chain_both_engines_share_is_wrapped_once_and_restored(tiny_files):
    from monai.engines import SupervisedEvaluator
    from monai.inferers import SimpleInferer

    trainer, discrete, _ = _trainer_with_post(tiny_files)
    post = postprocessing_of(trainer)
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=trainer.data_loader,
        network=trainer.network,
        inferer=SimpleInferer(),
        postprocessing=post,
    )
    converter = discrete.converter
    layout = ClassesInnermost(True)
    layout.attach(trainer)
    layout.attach(evaluator)
    assert discrete.converter.inner is converter  # wrapped once
    layout.detach(trainer)
    assert discrete.converter.inner is converter  # the evaluator still runs the chain: still wrapped
    layout.detach(evaluator)
    assert discrete.converter is converter
