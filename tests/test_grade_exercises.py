"""Every exercise under exercises/ holds up: the solution scores full marks, the stub zero,
each known-wrong submission loses points; the student notebook runs in Jupyter and its
check() reports failures; the Gradescope zip grades on its own, without the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import labkit  # noqa: F401
from labkit.grade import build, exercise

# Folder names, loaded inside each test: one malformed exercise fails its own tests only.
IDS = sorted(p.name for p in exercise.exercises_root().iterdir() if (p / "exercise.toml").is_file())


@pytest.mark.parametrize("ex_id", IDS)
def test_selftest(ex_id):
    ex = exercise.load(ex_id)
    result = build.selftest(ex)
    assert result.ok, "\n".join(result.lines + result.problems)


def _execute(path: Path) -> list[str]:
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("ex_id", IDS)
def test_student_notebook_runs_and_check_reports_failures(ex_id, tmp_path):
    ex = exercise.load(ex_id)
    folder = build.student_folder(ex, tmp_path)
    assert sorted(p.name for p in (folder / "tests").iterdir()) == ["public"], "hidden tests leaked"
    nb = nbformat.read(str(folder / ex.notebook.name), as_version=4)
    assert "BEGIN SOLUTION" not in json.dumps(nb) and not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    outputs = _execute(folder / ex.notebook.name)
    assert "FAIL" in outputs[-1] and "0 of" in outputs[-1], outputs[-1]


@pytest.mark.parametrize("ex_id", IDS)
def test_solution_notebook_passes_its_check(ex_id):
    outputs = _execute(exercise.load(ex_id).notebook)
    assert "FAIL" not in outputs[-1] and "public tests pass" in outputs[-1], outputs[-1]


def test_exercises_are_tied_to_chapters():
    chapters = {p.stem for p in Path(labkit.__file__).resolve().parents[2].glob("chapters/*/*.ipynb")}
    for ex in map(exercise.load, IDS):
        assert ex.functions and ex.title and ex.chapter
        if chapters:  # chapters are written alongside; the id must name one once it exists
            assert ex.chapter in chapters | {"memory-hierarchy", "triton-softmax"}, ex.chapter


def test_autograder_zip_grades_without_the_checkout(tmp_path):
    ex = exercise.load("memory-axpb")
    path = build.autograder_zip(ex, tmp_path)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        z.extractall(tmp_path / "source")
    assert {"setup.sh", "run_autograder", "lib/labkit/grade/runner.py", "lib/labkit/grade/supervisor.py",
            "exercise/memory-axpb/exercise.toml",
            "exercise/memory-axpb/tests/hidden/test_axpb_hidden.py"} <= names
    assert not any(n.endswith(".ipynb") for n in names), "the solution notebook must not ship"
    assert all(n.count("/") <= 2 for n in names if n.startswith("lib/labkit/") and "/grade/" not in n)
    assert modes["run_autograder"] & 0o111 and modes["setup.sh"] & 0o111
    src = tmp_path / "source"
    sub = tmp_path / "submission"
    sub.mkdir()
    (sub / "memory-axpb.ipynb").write_text(ex.notebook.read_text())
    env = {**os.environ, "PYTHONPATH": str(src / "lib")}
    probe = subprocess.run([sys.executable, "-c", "import labkit; print(labkit.__file__)"], env=env,
                           cwd=src, capture_output=True, text=True, check=True)
    assert probe.stdout.startswith(str(src)), probe.stdout
    out = tmp_path / "results" / "results.json"
    subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "exercise/memory-axpb", str(sub),
                    "--out", str(out), "--trust-submission"], env=env, cwd=src, check=True, capture_output=True)
    results = json.loads(out.read_text())
    assert results["score"] == 10 and {t.get("status") for t in results["tests"]} == {"passed", None}
    assert {t["visibility"] for t in results["tests"]} == {"visible", "after_due_date"}
