"""The book's mechanical rules: the toc and the files agree, notebooks carry no outputs,
and every chapter does what CHAPTER.md asks that a program can check."""

import json
import subprocess
from pathlib import Path

import pytest
from labkit import book
from labkit.results import REPO_ROOT

CHAPTERS = book.chapters()


def test_every_toc_entry_exists():
    missing = [entry for _, entry in book.toc_entries() if book.resolve(entry) is None]
    assert not missing, f"_toc.yml lists files that do not exist: {missing}"


def test_every_chapter_notebook_is_in_the_toc():
    listed = {c.path for c in CHAPTERS}
    on_disk = set((REPO_ROOT / "chapters").glob("*/*.ipynb"))
    assert on_disk - listed == set(), f"notebooks missing from _toc.yml: {sorted(on_disk - listed)}"
    pages = {book.resolve(e) for _, e in book.toc_entries()}
    stray = [p for p in (REPO_ROOT / "chapters").glob("*/*.md") if p not in pages]
    assert not stray, f"pages missing from _toc.yml: {stray}"


def test_the_five_parts_are_laid_out():
    captions = [c for c, _ in book.toc_entries() if c]
    for part in ("I. Silicon", "II. Transformer", "III. Inference", "IV. Distributed", "V. Post-training"):
        assert any(c.startswith(part) for c in captions), part


def _tracked_notebooks() -> list[Path]:
    out = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "*.ipynb"], capture_output=True, text=True)
    files = [REPO_ROOT / f for f in out.stdout.split()]
    return files or sorted(REPO_ROOT.glob("chapters/*/*.ipynb"))


@pytest.mark.parametrize("path", _tracked_notebooks(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs or execution counts; clear them before committing"


@pytest.mark.parametrize("path", _tracked_notebooks(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_cell_has_a_unique_id(path):
    """nbformat 4.5 gives every cell an id; a cell added by hand without one makes nbformat warn
    on every read (and will be an error in later versions)."""
    nb = json.loads(path.read_text())
    ids = [c.get("id") for c in nb["cells"]]
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]
    assert not missing, f"{path.name}: cells {missing} have no id; give each a short unique one"
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"


def _code(path: Path) -> str:
    nb = json.loads(path.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def _markdown(path: Path) -> str:
    nb = json.loads(path.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_chapter_contract(chapter):
    code, prose = _code(chapter.path), _markdown(chapter.path)
    assert "import labkit" in code.split("\n\n")[0] or code.lstrip().startswith("import labkit"), \
        "the first code cell imports labkit (it sets the execution mode before triton loads)"
    assert "labkit.describe()" in code, "the chapter says where it runs"
    assert "assert_close" in code, "every stage is checked against a reference"
    assert "show_source" in code, "labkit code is shown from the package, not pasted"
    interactive = sum(code.count(k) for k in ("slider_figure", "dropdown_figure", "sliders=", "updatemenus", "frames="))
    assert interactive >= 2, "at least two plotly figures that work without a kernel"
    assert "ipywidgets" in code, "one ipywidgets explorer for readers with a live kernel"
    assert "benchmarks.obtain" in code, "measured figures come from recorded or live benchmarks"
    assert "{cite}" in prose, "the chapter cites how the real systems do it"
    assert prose.lstrip().startswith("# "), "a chapter opens with its title"
