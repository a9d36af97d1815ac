"""Build Horovod 0.28.1 (its last release) for the installed torch >= 2.1, with gloo, from the PyPI sdist.

Horovod 0.28.1's two CMakeLists force C++14 (``set(CMAKE_CXX_STANDARD 14)`` in ``CMakeLists.txt``
and ``horovod/torch/CMakeLists.txt``), but torch >= 2.1's headers need C++17; the fix is upstream
but was never released, and ``CXXFLAGS`` does not help because Horovod's CMake resets the standard.
This module downloads the sdist, sets the standard to 17 in both files, and builds it with
``HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1`` (MPI when ``--with-mpi``; needs Debian's
``openmpi-bin libopenmpi-dev``) into the current Python environment. It needs ``cmake`` and a C++
compiler, and takes about 4 minutes on 2 cores.

    python scripts/build_horovod.py            # gloo only
    python scripts/build_horovod.py --with-mpi
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["HOROVOD_VERSION", "build", "patch_cxx_standard"]

logger = logging.getLogger("build_horovod")

HOROVOD_VERSION = "0.28.1"
_CMAKE_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
_STD14 = re.compile(r"set\(CMAKE_CXX_STANDARD 14\)")


def patch_cxx_standard(src: str | os.PathLike) -> list[str]:
    """Replace ``set(CMAKE_CXX_STANDARD 14)`` with 17 in Horovod's two CMakeLists; return the files changed.

    Raises:
        FileNotFoundError: a CMakeLists.txt is missing (not a Horovod source tree).
        ValueError: a file has no C++14 line to patch (another Horovod version: check by hand).
    """
    changed = []
    for rel in _CMAKE_FILES:
        path = Path(src) / rel
        text = path.read_text()
        new, n = _STD14.subn("set(CMAKE_CXX_STANDARD 17)", text)
        if n == 0:
            if "set(CMAKE_CXX_STANDARD 17)" in text:
                continue  # already patched
            raise ValueError(f"{path}: no 'set(CMAKE_CXX_STANDARD 14)' to patch; is this Horovod {HOROVOD_VERSION}?")
        path.write_text(new)
        changed.append(rel)
    return changed


def build(with_mpi: bool = False, workdir: str | os.PathLike | None = None, python: str = sys.executable) -> None:
    """Download, patch and ``pip install`` Horovod into ``python``'s environment."""
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            raise RuntimeError(
                f"building Horovod needs {tool}: apt-get install cmake g++ (Debian) or your system's equivalent"
            )
    import torch  # noqa: F401 - Horovod's build links against the installed torch: fail early without it

    work = Path(workdir or tempfile.mkdtemp(prefix="horovod-build-"))
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "download",
            f"horovod=={HOROVOD_VERSION}",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(work),
            "-q",
        ],
        check=True,
    )
    sdist = work / f"horovod-{HOROVOD_VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    src = work / f"horovod-{HOROVOD_VERSION}"
    logger.info("patched C++ standard to 17 in %s", ", ".join(patch_cxx_standard(src)) or "nothing (already patched)")
    env = {
        **os.environ,
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_CPU_OPERATIONS": "GLOO",
        "MAKEFLAGS": f"-j{os.cpu_count() or 1}",
    }
    env["HOROVOD_WITH_MPI" if with_mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    subprocess.run(
        [python, "-m", "pip", "install", "--no-build-isolation", "--no-cache-dir", str(src)], check=True, env=env
    )
    subprocess.run(
        [
            python,
            "-c",
            "import horovod, horovod.torch as hvd; assert hvd.gloo_built(); "
            "print('horovod', horovod.__version__, 'gloo ok')",
        ],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python scripts/build_horovod.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--with-mpi", action="store_true", help="also build the MPI controller (needs libopenmpi-dev)")
    p.add_argument("--workdir", help="where to download and build (default: a new temporary folder)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build(with_mpi=args.with_mpi, workdir=args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
