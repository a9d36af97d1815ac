"""The package's face: the plugin's names import from ``monai_fast`` and load lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest

import monai_fast


def test_every_public_name_resolves_to_its_home():
    import monai_fast.handlers as handlers

    for name in monai_fast.__all__:
        value = getattr(monai_fast, name)
        assert value is not None
        if name in handlers.__all__:
            assert value is getattr(handlers, name), name
    assert "FastTraining" in dir(monai_fast)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchHandler"):
        monai_fast.NoSuchHandler  # noqa: B018


def test_importing_the_package_loads_no_torch():
    code = "import sys, monai_fast; print('torch' in sys.modules, monai_fast.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False" and out[1] == monai_fast.__version__
    code = "from monai_fast import FastTraining; print(FastTraining.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "monai_fast.handlers.fast_training"


def test_the_handlers_namespace_holds_handlers_and_their_results_and_errors():
    import monai_fast.handlers as handlers

    assert all(name[0].isupper() for name in handlers.__all__), handlers.__all__  # classes: handlers, results, errors
