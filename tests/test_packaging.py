from pathlib import Path

import pytest
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


def _imports(path: Path, type_checking: bool = False, source: str | None = None, in_functions: bool = True) -> set[str]:
    """Modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks left out unless ``type_checking``;
    imports inside functions left out unless ``in_functions``).

    A relative import is named by its absolute module (``from ..apps.demo import x`` in ``monai_fast/report/a.py``
    is ``monai_fast.apps.demo``); ``source``, when given, is read as the text of ``path``.
    """
    import ast

    tree = ast.parse(path.read_text() if source is None else source)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING" and not type_checking:
            node.body = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not in_functions:
            node.body = []
    package = path.relative_to(ROOT).parent.parts
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            names.add(".".join((*base, node.module) if node.module else base))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / "monai_fast" / folder).rglob("*.py") if "__pycache__" not in p.parts)


ABOVE_HANDLERS = ("monai_fast.report", "monai_fast.bundle", "monai_fast.apps")

#: the plugin (with ``monai_fast/__init__.py``): everything a trainer may use; the application
#: (``monai_fast.apps``: recipes, commands, launchers, data sources, the demo) is built on it
PLUGIN = (
    "monai_fast.extras",
    "monai_fast.files",
    "monai_fast.folders",
    "monai_fast.openmp",
    "monai_fast.precision_names",
    "monai_fast.progress",
    "monai_fast.threads",
    "monai_fast.telemetry",
    "monai_fast.data",
    "monai_fast.distributed",
    "monai_fast.tune",
    "monai_fast.handlers",
    "monai_fast.report",
    "monai_fast.bundle",
)

#: the layers, lowest first (docs/design.md): a module imports its own layer and those below, never one above
LAYERS = [
    (
        "ground floor",
        (
            "monai_fast.files",
            "monai_fast.folders",
            "monai_fast.extras",
            "monai_fast.precision_names",
            "monai_fast.progress",
            "monai_fast.openmp",
            "monai_fast.threads",
        ),
    ),
    ("telemetry", ("monai_fast.telemetry",)),
    ("data, distributed", ("monai_fast.data", "monai_fast.distributed")),
    ("tuner core", ("monai_fast.tune",)),
    ("handlers", ("monai_fast.handlers",)),
    ("report", ("monai_fast.report",)),
    ("bundles", ("monai_fast.bundle",)),
    ("data sources, launchers", ("monai_fast.apps.sources", "monai_fast.apps.launch")),
    ("recipes", ("monai_fast.apps.recipes",)),
    ("inference, training", ("monai_fast.apps.inference", "monai_fast.apps.training")),
    ("demo", ("monai_fast.apps.demo",)),
    ("command line", ("monai_fast.apps.cli", "monai_fast.__main__")),
]


def _layer(module: str) -> int | None:
    """The layer of ``module``: the longest matching prefix wins."""
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
    assert _layer("monai_fast.apps.recipes.tuning") > _layer("monai_fast.handlers") > _layer("monai_fast.tune.result")
    assert _layer("monai_fast.apps.sources.msd") > max(_layer(p) for p in PLUGIN)
    assert _layer("monai_fast.apps.cli.train") == len(LAYERS) - 1 and _layer("numpy") is None


def test_handlers_import_nothing_above_them():
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(ABOVE_HANDLERS))
        for p in _modules("handlers")
    }
    assert not {k: v for k, v in bad.items() if v}, f"handlers/ imports an upper layer: {bad}"


def test_the_tuner_core_imports_nothing_above_handlers():
    above = (*ABOVE_HANDLERS, "monai_fast.handlers")
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p, type_checking=True) if n.startswith(above))
        for p in _modules("tune")
    }
    assert not {k: v for k, v in bad.items() if v}, (
        f"the tuner core imports an upper layer (type hints included): {bad}"
    )


def _loaded_by_name(path: Path) -> set[str]:
    """Modules ``path`` names in an ``import_module("...")`` call."""
    import ast

    return {
        node.args[0].value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def test_no_plugin_module_loads_the_application_by_name():
    loaders = {
        _module_name(p) for p in _plugin_modules() if any(n.startswith("monai_fast.apps") for n in _loaded_by_name(p))
    }
    assert not loaders, loaders


def _plugin_modules() -> list[Path]:
    return [p for p in _modules("") if _module_name(p).startswith(PLUGIN) or _module_name(p) == "monai_fast"]


def test_the_plugin_never_imports_the_application():
    assert any(p.name == "window_tune.py" for p in _plugin_modules())
    assert any(p.name == "run.py" and p.parent.name == "bundle" for p in _plugin_modules())
    assert not any(_module_name(p).startswith("monai_fast.apps") for p in _plugin_modules())
    bad = {
        _module_name(p): sorted(n for n in _imports(p, type_checking=True) if n.startswith("monai_fast.apps"))
        for p in _plugin_modules()
    }
    assert not {k: v for k, v in bad.items() if v}, f"plugin modules that import monai_fast.apps: {bad}"


def _imported_from(module: str) -> set[str]:
    """Every ``monai_fast`` module that ``module`` may load: its imports (in functions and type hints too), theirs,
    and the packages above each (their imports at import time), followed through the source."""
    seen: dict[str, bool] = {}  # module -> its functions' imports followed too
    todo = [(module, True)]
    while todo:
        name, whole = todo.pop()
        if seen.get(name) is True or seen.get(name) == whole:
            continue
        seen[name] = whole
        parts = name.split(".")
        todo += [(".".join(parts[:i]), False) for i in range(2, len(parts))]  # a module's packages run first
        path = ROOT.joinpath(*parts)
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if path.is_file():  # else a name imported from a package: the package itself is followed
            todo += [
                (n, True) for n in _imports(path, type_checking=True, in_functions=whole) if n.startswith("monai_fast.")
            ]
    return set(seen)


@pytest.mark.parametrize("module", ["monai_fast.apps.cli.train", "monai_fast.apps.training"])
def test_the_train_command_and_its_product_never_reach_the_harness(module):
    import subprocess
    import sys

    reached = sorted(n for n in _imported_from(module) if n.startswith("monai_fast.apps.demo"))
    assert not reached, f"{module} reaches the harness through its imports: {reached}"
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('monai_fast.apps.demo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} loads the harness: {out}"


def test_the_import_follower_sees_the_harness_behind_the_race_commands():
    assert "monai_fast.apps.demo" in _imported_from("monai_fast.apps.cli.race_cmds")


def test_the_import_reader_resolves_relative_and_type_hint_imports():
    where = ROOT / "monai_fast" / "report" / "x.py"
    assert "monai_fast.apps.demo.core" in _imports(where, source="from ..apps.demo.core import race\n")
    assert "monai_fast.apps.demo" in _imports(where, source="from ..apps.demo import core\n")
    hinted = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from monai_fast.apps.demo import x\n"
    assert "monai_fast.apps.demo" not in _imports(where, source=hinted)
    assert "monai_fast.apps.demo" in _imports(where, type_checking=True, source=hinted)


def test_importing_the_tuner_does_not_import_the_recipes():
    import subprocess
    import sys

    code = "import sys, monai_fast.tune; print('monai_fast.apps.recipes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_ground_floor_imports_nothing_of_ours():
    for module in ("files.py", "folders.py", "openmp.py", "extras.py", "threads.py"):
        assert not [n for n in _imports(ROOT / "monai_fast" / module) if n.startswith("monai_fast")], module


def test_hardware_libraries_are_called_only_in_telemetry():
    import re

    pattern = re.compile(r"\btorch\.cuda\.|\bimport pynvml\b|\bfrom pynvml\b|^\s*import nvtx\b|^\s*from nvtx\b", re.M)
    offenders = [
        str(p.relative_to(ROOT)) for p in _modules("") if "telemetry" not in p.parts and pattern.search(p.read_text())
    ]
    assert not offenders, f"hardware calls outside telemetry/: {offenders}"


def test_no_two_extras_install_the_same_packages():
    """Each extra in setup.cfg is one name for one set of packages: two with the same list would be aliases."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {name: frozenset(value.split()) for name, value in cfg["options.extras_require"].items()}
    by_packages: dict[frozenset[str], list[str]] = {}
    for name, packages in extras.items():
        by_packages.setdefault(packages, []).append(name)
    assert [names for names in by_packages.values() if len(names) > 1] == []


def test_the_report_package_docstring_names_each_of_its_modules():
    """``monai_fast.report``'s docstring says what each of its modules holds, and nothing it does not have."""
    import monai_fast.report as report

    modules = {p.name for p in (ROOT / "monai_fast" / "report").glob("*.py") if p.name != "__init__.py"}
    assert {m for m in modules if f"``{m}``" not in report.__doc__} == set()
    assert "race table" not in report.__doc__
