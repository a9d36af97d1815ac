"""A failing item in the background cache fill stops training, named, with no thread left and no hang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from background_parts import Held, planned, trainer, write_cases

from monai_fast.data.background import fill_order_options
from monai_fast.data.items import DataItemError
from monai_fast.data.loaders import SafeThreadDataLoader


def test_failing_fill_item_stops_training_naming_its_file_and_leaves_no_thread(tmp_path):
    files = write_cases(tmp_path)
    before = set(threading.enumerate())
    ds = planned(files, Held(fail="case_5", sleep_s=0.05), background=True, workers=2)
    t, _, _ = trainer(SafeThreadDataLoader(ds, batch_size=2, **fill_order_options(ds, shuffle=True)), epochs=2)
    with pytest.raises(DataItemError, match="case_5.nii.gz") as caught:
        t.run()
    assert "broken on purpose: case_5" in str(caught.value)
    assert [x.name for x in set(threading.enumerate()) - before if x.is_alive()] == []


def test_failing_fill_item_ends_the_process_with_the_error(tmp_path):
    files = write_cases(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        from background_parts import Held, planned, trainer
        from monai_fast.data.background import fill_order_options
        from monai_fast.data.loaders import SafeThreadDataLoader
        files = {files!r}
        ds = planned(files, Held(fail="case_3", sleep_s=0.05), background=True, workers=2)
        t, _, _ = trainer(SafeThreadDataLoader(ds, batch_size=2, **fill_order_options(ds, shuffle=True)), epochs=2)
        t.run()
    """)
    )
    tests = str(Path(__file__).parents[1])  # background_parts
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr[-2000:]  # a Python error, not an abort (134) or a hang
    assert "DataItemError" in done.stderr and "case_3.nii.gz" in done.stderr
