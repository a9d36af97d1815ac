from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_every_code_folder_is_a_package_that_setup_finds():
    found = set(find_packages(where=str(ROOT), include=["monai_fast", "monai_fast.*"]))
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "monai_fast").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(folders - found)
    assert not missing, f"not packaged (no __init__.py?): {missing}"
