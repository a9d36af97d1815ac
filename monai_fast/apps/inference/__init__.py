"""Inference of a trained recipe network: sliding window over a data list, NIfTI predictions, fast backends.

``monai-fast infer`` is the command line (docs/inference.md).
"""

from monai_fast.apps.inference.backends import (
    BACKENDS,
    BackendUnavailable,
    Predictor,
    agreement,
    available,
    build_predictor,
    missing,
)
from monai_fast.apps.inference.checkpoint import (
    ChainError,
    CheckpointError,
    InferenceError,
    LoadedModel,
    build_chain,
    load_checkpoint,
    load_model,
    read_recipe_config,
    recipe_chain,
    save_checkpoint,
)
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
