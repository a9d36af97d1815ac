"""The code stays as ruff checks and formats it (pyproject.toml's settings), and nothing edits ``sys.path`` to
import: the package is installed, benchmarks and tutorials run as scripts, and the tests' helpers come from
pytest's ``pythonpath`` (setup.cfg)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("monai_fast", "tests", "benchmarks", "tutorials", "scripts")
#: an insert into or append to the import path (spelled so that this file does not match itself)
PATH_EDIT = re.compile(rb"sys\.path\.(?:insert|append)\b")

needs_ruff = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff is part of the dev extra: pip install -e '.[dev]'"
)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *FOLDERS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@needs_ruff
def test_ruff_check_is_clean():
    r = _ruff("check", "--no-cache", "--output-format", "concise")
    assert r.returncode == 0, f"ruff check found problems:\n{r.stdout}{r.stderr}"


@needs_ruff
def test_ruff_format_leaves_every_file_as_it_is():
    r = _ruff("format", "--no-cache", "--check")
    assert r.returncode == 0, f"ruff format would change files (run ruff format):\n{r.stdout}{r.stderr}"


def test_no_file_edits_the_import_path():
    offenders = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            for n, line in enumerate(path.read_bytes().splitlines(), 1):
                if PATH_EDIT.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip().decode(errors='replace')[:120]}")
    assert not offenders, "sys.path edited (install the package, or use pytest's pythonpath):\n" + "\n".join(offenders)


def test_the_path_check_catches_what_it_should():
    edit = b"sys.path."  # joined below, so that this file does not hold the words it looks for
    assert PATH_EDIT.search(edit + b"insert(0, str(ROOT))")
    assert PATH_EDIT.search(b"    " + edit + b"append(folder)")
    assert not PATH_EDIT.search(b"sys.path[0] = os.getcwd()")
    assert not PATH_EDIT.search(edit + b"inserted")
