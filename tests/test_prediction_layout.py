"""The evaluator's predictions with the classes innermost: the same post-processed results, a restored inferer."""

import math

import pytest
import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor
from monai.inferers import SimpleInferer
from monai.transforms import AsDiscrete

from monai_fast.handlers import AMPToggle, ClassesInnermost, FastTraining
from monai_fast.handlers.prediction_layout import argmax_gain


def _evaluator(tiny_files):
    from test_fast_training import _user_trainer

    _, evaluator = _user_trainer(tiny_files)
    return evaluator


def _validate(evaluator):
    """Post-processed predictions, labels and the metric of one validation run."""
    seen = []
    handle = evaluator.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.append([(o["pred"].clone(), o["label"].clone()) for o in e.state.output]))
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
    evaluator = _evaluator(tiny_files)
    inferer = evaluator.inferer
    before, dice_before = _validate(evaluator)
    layout = ClassesInnermost(True)
    layout.attach(evaluator)
    assert layout.active and layout.reason == "requested" and evaluator.inferer is not inferer
    image = next(iter(evaluator.data_loader))["image"]
    out = evaluator.inferer(image, evaluator.network)
    assert out.dim() == 5 and out.stride(1) == 1  # the classes innermost
    after, dice_after = _validate(evaluator)
    assert len(before) == len(after) > 0
    for b, a in zip(before, after):
        assert all(torch.equal(pb, pa) and torch.equal(lb, la) for (pb, lb), (pa, la) in zip(b, a))
    assert dice_after == dice_before and math.isfinite(dice_after)
    layout.detach(evaluator)
    assert evaluator.inferer is inferer and not layout.active


def test_auto_measures_the_argmax_and_stays_off_where_it_does_not_pay(tiny_files):
    plain_s, inner_s = argmax_gain(size=24, rounds=2)
    assert plain_s > 0 and inner_s > 0
    evaluator = _evaluator(tiny_files)
    inferer = evaluator.inferer
    layout = ClassesInnermost(min_gain=1e9)  # no layout is a billion times faster
    layout.attach(evaluator)
    assert not layout.active and evaluator.inferer is inferer
    assert layout.reason.startswith("argmax over classes measured ") and "with the classes innermost" in layout.reason


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
    with pytest.raises(TypeError, match="needs a MONAI SupervisedEvaluator"):
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
    assert fast.applied["prediction layout"] == {"applied": True, "setting": "classes innermost", "reason": "requested"}
    wrapper = evaluator.inferer
    assert isinstance(wrapper.inner.toggle, AMPToggle)  # ours around AMPToggle's: nested wrappers
    fast.detach(trainer)
    assert (trainer.inferer, evaluator.inferer) == inferers  # both wrappers undone, in the right order

    trainer, evaluator = _user_trainer(tiny_files)
    fast = FastTraining(precision="fp32", prediction_layout=False)
    fast.attach(trainer, evaluator)
    assert fast.applied["prediction layout"] == {"applied": False, "setting": None,
                                                 "reason": "switched off (prediction_layout=False)"}
    with pytest.raises(ValueError, match="prediction_layout must be 'auto', True or False"):
        FastTraining(prediction_layout="fast")
