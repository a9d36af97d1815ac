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


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks left out)."""
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / "monai_fast" / folder).rglob("*.py") if "__pycache__" not in p.parts)


#: the tuner's recipe binding; the rest of ``tune/`` is the tuner core, which handlers may use
TUNE_RECIPE_BOUND = ("monai_fast.tune.recipe",)
ABOVE_HANDLERS = (
    "monai_fast.report",
    "monai_fast.recipes",
    "monai_fast.race",
    "monai_fast.cli",
    "monai_fast.bundle",
    "monai_fast.inference",
    *TUNE_RECIPE_BOUND,
)

#: the layers, lowest first (docs/design.md): a module imports its own layer and those below, never one above
LAYERS = [
    ("ground floor", ("monai_fast.files", "monai_fast.extras", "monai_fast.progress", "monai_fast.openmp")),
    ("telemetry", ("monai_fast.telemetry",)),
    ("data, distributed", ("monai_fast.data", "monai_fast.distributed")),
    ("tuner core", ("monai_fast.tune",)),
    ("handlers", ("monai_fast.handlers",)),
    ("recipes", ("monai_fast.recipes", *TUNE_RECIPE_BOUND)),
    ("report", ("monai_fast.report",)),
    ("inference, bundles", ("monai_fast.inference", "monai_fast.bundle")),
    ("races", ("monai_fast.race",)),
    ("command line", ("monai_fast.cli", "monai_fast.__main__")),
]


def _layer(module: str) -> int | None:
    """The layer of ``module``: the longest matching prefix wins (``tune.recipe`` is a recipe)."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    bad = []
    for path in _modules(""):
        me = _module_name(path)
        mine = _layer(me)
        if mine is None:
            continue
        for name in _imports(path):
            theirs = _layer(name) if name.startswith("monai_fast.") else None
            if theirs is not None and theirs > mine:
                bad.append(f"{me} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]})")
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_the_layer_check_sees_an_upward_import():
    assert _layer("monai_fast.data.adopt") < _layer("monai_fast.handlers.prefetch")
    assert _layer("monai_fast.tune.recipe") > _layer("monai_fast.handlers") > _layer("monai_fast.tune.search")
    assert _layer("monai_fast.cli.train") == len(LAYERS) - 1 and _layer("numpy") is None


def test_handlers_import_nothing_above_them():
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(ABOVE_HANDLERS))
        for p in _modules("handlers")
    }
    assert not {k: v for k, v in bad.items() if v}, f"handlers/ imports an upper layer: {bad}"


def test_the_tuner_core_imports_nothing_above_handlers():
    above = (*ABOVE_HANDLERS, "monai_fast.handlers")
    core = [p for p in _modules("tune") if p.stem != "recipe"]
    bad = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(above)) for p in core}
    assert not {k: v for k, v in bad.items() if v}, f"the tuner core imports an upper layer: {bad}"


def test_importing_the_tuner_does_not_import_the_recipes():
    import subprocess
    import sys

    code = "import sys, monai_fast.tune; print('monai_fast.recipes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_ground_floor_imports_nothing_of_ours():
    for module in ("files.py", "openmp.py", "extras.py"):
        assert not [n for n in _imports(ROOT / "monai_fast" / module) if n.startswith("monai_fast")], module


def test_hardware_libraries_are_called_only_in_telemetry():
    import re

    pattern = re.compile(r"\btorch\.cuda\.|\bimport pynvml\b|\bfrom pynvml\b|^\s*import nvtx\b|^\s*from nvtx\b", re.M)
    offenders = [
        str(p.relative_to(ROOT)) for p in _modules("") if "telemetry" not in p.parts and pattern.search(p.read_text())
    ]
    assert not offenders, f"hardware calls outside telemetry/: {offenders}"
