"""MONAI's NIfTI writer, writing whole files only (through `monai_fast.files.atomic_write()`).

``SaveImage``'s writer saves in place, so a killed run would leave half a prediction under its final
name; here a full file system is one `NoSpaceError` naming the file before a byte is written.
"""

from __future__ import annotations

import gzip
import os
from typing import Any

import numpy as np
from monai.data import NibabelWriter
from monai.data.utils import to_affine_nd
from monai.utils import convert_data_type

from monai_fast.files import ensure_free_space, write_bytes

__all__ = ["AtomicNiftiWriter"]


class AtomicNiftiWriter(NibabelWriter):
    """``NibabelWriter`` whose `write()` goes through `atomic_write()`."""

    def write(self, filename: str | os.PathLike, verbose: bool = False, **obj_kwargs: Any) -> None:
        """Write the data set by ``set_data_array``/``set_metadata`` to ``filename`` whole or not at all.

        With no room for it, `NoSpaceError` names it (bytes needed and free) and ``filename`` is left as it was.
        """
        affine = np.eye(4) if self.affine is None else convert_data_type(self.affine, np.ndarray)[0]
        image = self.create_backend_obj(self.data_obj, affine=affine, dtype=self.output_dtype, **obj_kwargs)
        affine = to_affine_nd(r=3, affine=affine)
        image.set_sform(affine, code=1)
        image.set_qform(affine, code=1)
        data = image.to_bytes()
        if str(filename).endswith(".gz"):
            data = gzip.compress(data, compresslevel=1)
        ensure_free_space(filename, len(data), what="prediction")
        write_bytes(data, filename)
