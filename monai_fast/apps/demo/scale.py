"""The demo's size on a device (`monai_fast.apps.training.scale`) and the line the demo prints on it."""

from __future__ import annotations

from monai_fast.apps.demo.options import RaceSpec
from monai_fast.apps.training.options import recipe_config
from monai_fast.apps.training.scale import DemoScale, demo_scale

__all__ = ["DemoScale", "demo_scale", "size_line"]


def size_line(spec: RaceSpec, scale: DemoScale) -> str:
    """The one line the demo prints on its size: the data, patch and network it will train, and ``scale``'s default."""
    config = recipe_config(spec.overrides, spec.seed)
    if spec.data_dir is not None or spec.train_files is not None:
        data = f"data from {spec.data_dir or 'the given file lists'}"
    else:
        data = f"{spec.synthetic.cases} synthetic volumes of {'x'.join(map(str, spec.synthetic.shape))} voxels"
    return (
        f"sized for {scale.device} (default: {scale.name}): {data}, {'x'.join(map(str, config.patch_size))} patches, "
        f"UNet {'-'.join(map(str, config.channels))} with {config.num_res_units} residual unit(s); "
        "--cases, --shape, --patch-size, --channels change it"
    )
