"""MONAI bundles made fast: run a bundle with ``FastTraining`` attached (`run_bundle()`), or ship a config
fragment (`FRAGMENT`) so that MONAI's own runner attaches it."""

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
