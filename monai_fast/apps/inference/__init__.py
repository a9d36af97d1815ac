"""Inference of a trained recipe network: sliding window over a data list, NIfTI predictions, fast backends.

* `save_checkpoint()` / `load_model()` / `load_checkpoint()`: a network's weights with
  the `RecipeConfig` that rebuilds it and the record of the chain it was
  validated with (`.checkpoint`, `.chain`).
* `infer()`: sliding-window inference over an MSD folder or image files through that chain,
  predictions inverted onto each input's grid and written as ``<name>_seg.nii.gz`` with its affine
  and shape (`.run`).
* `BACKENDS` (``eager``, ``autocast``, ``compile``, ``onnx``, ``tensorrt``) and
  `build_predictor()` (`.backends`); `agreement()` compares two backends' predictions.

``monai-fast infer`` is the command line; ``benchmarks/inference.py`` times every backend.

Examples:
    >>> from monai_fast.apps.inference import infer, save_checkpoint
    >>> save_checkpoint("model.pt", recipe.network, recipe.config)  # doctest: +SKIP
    >>> infer("model.pt", "Task09_Spleen", "predictions", backend="onnx").outputs[0]  # doctest: +SKIP
    PosixPath('predictions/spleen_12_seg.nii.gz')
"""

from monai_fast.apps.inference.backends import (
    BACKENDS,
    BackendUnavailable,
    Predictor,
    available,
    build_predictor,
    missing,
)
from monai_fast.apps.inference.chain import ChainError, build_chain, recipe_chain
from monai_fast.apps.inference.checkpoint import (
    CheckpointError,
    InferenceError,
    LoadedModel,
    load_checkpoint,
    load_model,
    read_recipe_config,
    save_checkpoint,
)
from monai_fast.apps.inference.compare import agreement
from monai_fast.apps.inference.run import SPLITS, InferenceResult, data_list, infer

__all__ = [
    "BACKENDS",
    "SPLITS",
    "BackendUnavailable",
    "ChainError",
    "CheckpointError",
    "InferenceError",
    "InferenceResult",
    "LoadedModel",
    "Predictor",
    "agreement",
    "available",
    "build_chain",
    "build_predictor",
    "data_list",
    "infer",
    "load_checkpoint",
    "load_model",
    "missing",
    "read_recipe_config",
    "recipe_chain",
    "save_checkpoint",
]
