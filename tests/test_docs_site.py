"""The docs are a product's: the site builds with --strict, the front pages stay short, no development diary.

``mkdocs build --strict`` fails on a broken link, a page missing from the navigation, or an API
reference whose docstring does not parse; the words check keeps development history (rounds,
issue numbers, "today", one machine's "this host") out of the project's own text.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: phrases that belong to the history (git, CHANGELOG.md), not to the project's text
HISTORY = re.compile(
    r"\bsessions? \d+|\bdevelopment rounds?\b|(?<!MONAI )\bissues? #?\d+\b|\btoday('s)?\b"
    r"|\bthis project's (?:CPU|\d-core|machine|host|Xeon)"
    r"|\bon (?:this|a loaded|a quiet|a busy) \d-core (?:host|machine)\b"
    r"|\b(?:this|our) \d-core\b|\bon a \d-core VM\b|\bsince the fix\b|\bonce in (?:ten|\d+) runs\b"
    r"|no GPU (?:has been|was) lent|\bwas fixed\b|\bas of now\b",
    re.IGNORECASE,
)


def _project_texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "ROADMAP.md", ROOT / "benchmarks" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "monai_fast").rglob("*.py")) + sorted((ROOT / "tutorials").glob("*.py"))
    files += sorted((ROOT / "tutorials").glob("*.ipynb")) + sorted((ROOT / "benchmarks").glob("*.py"))
    return files


def _lines(path: Path) -> list[str]:
    """The file's lines; a notebook's are its cells' source lines, so a phrase wrapped in a cell is one text."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        return "".join("".join(c["source"]) + "\n" for c in cells).splitlines()
    return text.splitlines()


def history_hits(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, phrase) of every history phrase, also one wrapped over lines.

    The lines are joined with their whitespace collapsed, and a comment's leading ``#`` dropped, so
    "on this project's" at one line's end and "2-core CPU" at the next one's start are one phrase.
    """
    words: list[str] = []
    starts: list[int] = []  # offset of each word in the joined text
    numbers: list[int] = []  # the line each word is on
    offset = 0
    for n, line in enumerate(lines, 1):
        for i, word in enumerate(line.split()):
            if i == 0 and set(word) <= {"#"}:
                continue  # a comment's marker, between the halves of a wrapped phrase
            words.append(word)
            starts.append(offset)
            numbers.append(n)
            offset += len(word) + 1
    text = " ".join(words)
    return [(numbers[bisect.bisect_right(starts, m.start()) - 1], m.group(0)) for m in HISTORY.finditer(text)]


def test_no_development_history_in_the_project_text():
    offenders = []
    for path in _project_texts():
        for n, phrase in history_hits(_lines(path)):
            offenders.append(f"{path.relative_to(ROOT)}:{n}: {phrase}")
    assert not offenders, "development history in the project's text:\n" + "\n".join(offenders)


def test_the_history_check_catches_what_it_should():
    for text in [
        "in session 12 it was",
        "see issue 28",
        "today's order",
        "this project's 2-core CPU",
        "on a loaded 2-core host gave 0.2x",
        "single steps scatter on a 2-core VM",
        "it has not happened in 40 runs since the fix",
    ]:
        assert HISTORY.search(text), text
    wrapped = ["    CPU competes; on this project's", "    2-core CPU that cost", "# hit once in", "# ten runs"]
    assert [n for n, _ in history_hits(wrapped)] == [1, 3]
    for text in [
        "a torchrun rendezvous on the first host",
        "ONNX Runtime session",
        "this host's share of the job",
        "round 1: every backend in turn",
        "processes on this host",
        "OpenMP threads on a busy host",
        "MONAI issues #913 / #3843",
    ]:
        assert not HISTORY.search(text), text


@pytest.mark.parametrize("name", ["README.md", "benchmarks/README.md"])
def test_front_pages_are_short(name):
    size = len((ROOT / name).read_text(encoding="utf-8"))
    assert size <= 15_000, f"{name} is {size} characters; the detail belongs on the docs site"


def test_every_result_is_on_the_results_page():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    missing = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json") if f"`{p.name}`" not in page]
    assert not missing, f"run python benchmarks/report.py: {missing}"


def test_every_result_is_cited_or_read():
    """Every file and folder in benchmarks/results is named by a page, or read by a test or a script.

    A result that nothing cites is a diary entry: git keeps it, the tree does not. A folder (one
    run's logs and JSON) counts as cited when a page names the folder.
    """
    pages = [ROOT / "README.md", ROOT / "ROADMAP.md", ROOT / "benchmarks" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "tests").glob("*.py"))
    pages += sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    cited = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    entries = sorted((ROOT / "benchmarks" / "results").iterdir())
    uncited = [p.name + ("/" if p.is_dir() else "") for p in entries if p.name not in cited]
    assert not uncited, f"results that no page cites and nothing reads (git rm them, or cite them): {uncited}"


def test_the_results_page_generator_runs(tmp_path):
    out = tmp_path / "page.md"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.startswith("# Benchmarks and results") and "| result | machine | date | commit | file |" in text


def test_the_docs_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert mkdocs, "mkdocs is part of the dev extra: pip install -e '.[dev]'"
    r = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # docstrings render as Markdown: no raw Sphinx roles reach the page
    roles = sorted(set(re.findall(r":(?:class|func|meth|data|mod|attr|exc):(?:`|<code>)", api)))
    assert not roles, f"raw Sphinx roles on the API page: {roles}"
    # examples render as code, not as Markdown quotes whose comments turn into headings
    assert "<blockquote>" not in api, api[api.index("<blockquote>") - 300 : api.index("<blockquote>") + 300]
    # long code lines wrap and file names in tables stay whole (the site's own stylesheet)
    faults = (tmp_path / "site" / "faults" / "index.html").read_text()
    assert "stylesheets/extra.css" in faults
    css = (tmp_path / "site" / "stylesheets" / "extra.css").read_text()
    assert "white-space: pre-wrap" in css and "white-space: nowrap" in css


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layer_map_picture_shows_the_checked_layers():
    drawn = _load(ROOT / "scripts" / "draw_layers.py", "_draw_layers")
    checked = _load(ROOT / "tests" / "test_packaging.py", "_packaging_layers")
    assert [name for name, _ in drawn.LAYERS] == [name for name, _ in checked.LAYERS]
    assert "](img/layers.png)" in (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert (ROOT / "docs" / "img" / "layers.png").stat().st_size > 10_000
