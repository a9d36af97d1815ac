"""MONAI's NIfTI writer, writing whole files only (through `monai_fast.files.atomic_write()`).

``SaveImage`` hands the prediction to its writer, whose ``nib.save`` writes in place: a killed
run would leave half a prediction under its final name. `AtomicNiftiWriter` builds the
same ``Nifti1Image`` (MONAI's ``create_backend_obj``, the affine as sform and qform, as MONAI's
``NibabelWriter`` does) and writes its bytes atomically, gzipped for ``.nii.gz``. The bytes are
complete in memory before anything is written, so a file system without room for them is one
`NoSpaceError` naming the file, the bytes it needs and the bytes free,
raised before a byte is written.

Examples:
    >>> import numpy as np
    >>> from monai.transforms import SaveImage
    >>> saver = SaveImage(writer=AtomicNiftiWriter, output_ext=".nii.gz", resample=False)  # doctest: +SKIP
    >>> saver(prediction, filename="out/case_1_seg")  # doctest: +SKIP
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

        Raises:
            NoSpaceError: the file system holding ``filename`` has no room for it (named, with the
                bytes needed and free); ``filename`` is left as it was.
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
