"""From one exercise notebook to the submission the grader runs and the student's copy.

Cells tagged ``submission`` are what a student writes; concatenated in order they are the
submission module. Inside them the solution stands between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; the student version replaces each region by its ``# STUB:`` lines (or
by ``raise NotImplementedError``) at the marker's indentation.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

SUBMISSION_TAG = "submission"
REMOVE_TAG = "remove-student"  # cells that exist only in the instructor's copy
_BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION\s*$")
_END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
_STUB = re.compile(r"^[ \t]*# STUB: ?(?P<code>.*)$")


class MarkerError(ValueError):
    """Unbalanced or nested solution markers."""


def strip_solutions(source: str) -> str:
    """``source`` with every solution region replaced by its stub."""
    out: list[str] = []
    region: list[str] | None = None
    indent = ""
    for number, line in enumerate(source.splitlines(), 1):
        if _BEGIN.match(line):
            if region is not None:
                raise MarkerError(f"line {number}: BEGIN SOLUTION inside another solution region")
            region, indent = [], _BEGIN.match(line)["indent"]
        elif _END.match(line):
            if region is None:
                raise MarkerError(f"line {number}: END SOLUTION without BEGIN SOLUTION")
            stubs = [m["code"] for m in map(_STUB.match, region) if m]
            out.extend(indent + s for s in (stubs or ['raise NotImplementedError("your code here")']))
            region = None
        elif region is not None:
            region.append(line)
        else:
            out.append(line)
    if region is not None:
        raise MarkerError("BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out) + ("\n" if source.endswith("\n") else "")


def has_markers(source: str) -> bool:
    return any(_BEGIN.match(line) for line in source.splitlines())


def read(path: str | Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def submission_source(nb: nbformat.NotebookNode) -> str:
    """The module a notebook submits: its ``submission`` cells, in order."""
    cells = [c for c in nb.cells if c.cell_type == "code" and SUBMISSION_TAG in c.get("metadata", {}).get("tags", [])]
    if not cells:
        raise ValueError(f"the notebook has no cell tagged {SUBMISSION_TAG!r}: nothing to grade")
    return "\n\n".join(f"# --- submission cell {i + 1}\n{c.source}" for i, c in enumerate(cells)) + "\n"


def student_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with solutions replaced by stubs, instructor-only cells dropped, no outputs."""
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if REMOVE_TAG not in c.get("metadata", {}).get("tags", [])]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs, cell.execution_count = [], None
    return nb


def source_of(path: str | Path) -> str:
    """A submission's module source, from a ``.ipynb`` (its tagged cells) or a ``.py``."""
    path = Path(path)
    if path.suffix == ".ipynb":
        return submission_source(read(path))
    if path.suffix == ".py":
        return path.read_text(encoding="utf-8", errors="replace")
    raise ValueError(f"a submission is a .ipynb or a .py file, got {path.name}")
