"""MONAI bundles made fast: run a bundle with ``FastTraining`` attached, or ship a config fragment.

* `run_bundle()` (``monai-fast bundle run BUNDLE_DIR``) runs a bundle as
  ``python -m monai.bundle run`` does, with ``FastTraining`` and a run record on its engines.
* `FRAGMENT` (``monai-fast bundle fragment``) is a config file a bundle can ship, so that
  MONAI's own runner attaches ``FastTraining``:
  ``python -m monai.bundle run --config_file "['configs/train.json','configs/fast.json']"``.
"""

from monai_fast.bundle.checks import BundleError, bundle_config_files, parse_overrides
from monai_fast.bundle.fragment import FRAGMENT, attach_fast, write_fragment
from monai_fast.bundle.run import BundleResult, run_bundle

__all__ = [
    "FRAGMENT",
    "BundleError",
    "BundleResult",
    "attach_fast",
    "bundle_config_files",
    "parse_overrides",
    "run_bundle",
    "write_fragment",
]
