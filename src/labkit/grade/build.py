"""What the commands build from an exercise folder: the student folder, the Gradescope
autograder zip, and the self-test that keeps every exercise honest."""

from __future__ import annotations

import json
import shutil
import stat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import backend
from . import notebook, runner
from .exercise import Exercise, ExerciseError

LABKIT_ROOT = Path(__file__).resolve().parents[1]


# -- the student's folder ---------------------------------------------------------------
def student_folder(exercise: Exercise, out_root: Path) -> Path:
    """``<out_root>/<id>/``: the notebook with stubs, the public tests, and their points."""
    dest = out_root / exercise.id
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "tests").mkdir(parents=True)
    nb = notebook.student_notebook(notebook.read(exercise.notebook))
    notebook.nbformat.write(nb, str(dest / exercise.notebook.name))
    shutil.copytree(exercise.public_tests, dest / "tests" / "public",
                    ignore=shutil.ignore_patterns("__pycache__"))
    public = runner._public_test_names(exercise)
    meta = {"id": exercise.id, "title": exercise.title, "chapter": exercise.chapter,
            "points": {k: v for k, v in exercise.points.items() if k in public}}
    (dest / "exercise.json").write_text(json.dumps(meta, indent=2) + "\n")
    return dest


# -- the Gradescope autograder ----------------------------------------------------------
SANDBOX_USER = "labkit-sandbox"
SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, on its Ubuntu image, to build the autograder.
set -euo pipefail
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv python3-pip
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q --upgrade pip
# CPU-only torch; Triton runs kernels in its interpreter (labkit sets TRITON_INTERPRET=1).
/autograder/venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cpu "{torch}"
/autograder/venv/bin/pip install -q "{triton}" "{numpy}" "{pytest}" "{nbformat}" 'tomli; python_version < "3.11"'
# Submissions run as this unprivileged user: they cannot read the tests or write results.
id -u {user} >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin {user}
chmod -R go-rwx /autograder/source
"""
RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this, as root, for every submission. The submission runs as {user}, who
# can read neither /autograder/source (setup.sh made it private) nor write the results.
# results.json is always written: by the grader (a zero that says why, if it fails), or,
# if the grader process itself dies before writing one, by the fallback below (score 0).
mkdir -p /autograder/results
export PYTHONPATH=/autograder/source/lib
/autograder/venv/bin/python -m labkit.grade grade /autograder/source/exercise/{id} /autograder/submission \\
    --out /autograder/results/results.json --sandbox-user {user} \\
    || test -s /autograder/results/results.json || cat > /autograder/results/results.json <<'JSON'
{{"score": 0, "output": "The grader stopped before it could score this submission. Nothing was scored; tell the course staff.", "tests": []}}
JSON
"""


def _requirement(name: str) -> str:
    from .exercise import exercises_root

    for line in (exercises_root().parent / "requirements.txt").read_text().splitlines():
        if line.split(">")[0].split("<")[0].split("=")[0].strip() == name:
            return line.strip()
    return name


def autograder_zip(exercise: Exercise, out_root: Path) -> Path:
    """``<out_root>/<id>.zip`` for Gradescope: setup.sh, run_autograder and the source.

    The source holds labkit's core and grader (no topic packages: they are the book's
    solutions) and the exercise's tests and points, never its notebook.
    """
    out_root.mkdir(parents=True, exist_ok=True)
    path = out_root / f"{exercise.id}.zip"
    reqs = {n: _requirement(n) for n in ("torch", "triton", "numpy", "pytest", "nbformat")}

    def add_text(z: zipfile.ZipFile, name: str, text: str, executable: bool = False) -> None:
        info = zipfile.ZipInfo(name)
        info.external_attr = (0o755 if executable else 0o644) << 16 | stat.S_IFREG << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(info, text)

    with zipfile.ZipFile(path, "w") as z:
        add_text(z, "setup.sh", SETUP_SH.format(user=SANDBOX_USER, **reqs), executable=True)
        add_text(z, "run_autograder", RUN_AUTOGRADER.format(id=exercise.id, user=SANDBOX_USER),
                 executable=True)
        core = [p for p in LABKIT_ROOT.glob("*.py")] + [p for p in (LABKIT_ROOT / "grade").glob("*.py")]
        for p in sorted(core):
            add_text(z, f"lib/labkit/{p.relative_to(LABKIT_ROOT)}", p.read_text())
        base = f"exercise/{exercise.id}"
        add_text(z, f"{base}/exercise.toml", (exercise.root / "exercise.toml").read_text())
        for p in exercise.test_files(hidden=True):
            add_text(z, f"{base}/{p.relative_to(exercise.root)}", p.read_text())
    return path


# -- the self-test ----------------------------------------------------------------------
@dataclass
class SelfTest:
    exercise: Exercise
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    progress: Callable[[str], None] | None = None  # told each line as soon as it is known

    def say(self, line: str) -> None:
        self.lines.append(line)
        if self.progress:
            self.progress(line)

    @property
    def ok(self) -> bool:
        return not self.problems


def selftest(exercise: Exercise, progress: Callable[[str], None] | None = None) -> SelfTest:
    """Solution full marks, stub zero, every known-wrong submission loses points.
    ``progress`` hears each line as it is known (a GPU run grades for minutes)."""
    result = SelfTest(exercise, progress=progress)
    if not exercise.notebook.is_file():
        result.problems.append(f"the notebook {exercise.notebook.name} is missing")
        return result
    solution = notebook.submission_source(notebook.read(exercise.notebook))
    if not notebook.has_markers(solution):
        result.problems.append("the submission cells have no solution markers")
    for kind, folder in (("public", exercise.public_tests), ("hidden", exercise.hidden_tests)):
        if not list(folder.glob("test_*.py")):
            result.problems.append(f"no {kind} tests in {folder}")

    # When the run asks for the compile check (make test), the solution's kernels must compile
    # for the H200 under every test, hidden ones too; the wrong versions need only lose points.
    full = runner.grade(exercise, solution, compile_check=backend.COMPILE_CHECK)
    names = set(full.outcomes)
    if names != set(exercise.points):
        result.problems.append(f"tests {sorted(names)} do not match the points table {sorted(exercise.points)}")
    # The failure's own message, not only the test's name: a selftest that fails only on
    # another machine (CI) must say why there, where nobody can rerun it by hand.
    failed = [f"{t['name'].split(':')[0]}: {t.get('output', '')[-600:]}"
              for t in full.results["tests"] if t.get("status") == "failed"]
    if failed or full.score != full.max_score:
        result.problems.append(f"the solution scores {full.score:g}/{full.max_score:g}; failed: {failed}")
    result.say(f"solution: {full.score:g}/{full.max_score:g} ({full.results['execution_time']:.0f} s)")

    stub = runner.grade(exercise, notebook.strip_solutions(solution))
    if stub.score != 0:
        result.problems.append(f"the stub scores {stub.score:g}, not 0")
    result.say(f"stub: {stub.score:g}/{stub.max_score:g} ({stub.results['execution_time']:.0f} s)")

    for wrong in exercise.wrong:
        try:
            source = wrong.apply(solution)
        except ExerciseError as e:
            result.problems.append(str(e))
            continue
        report = runner.grade(exercise, source)
        scores = {t["name"].split(":")[0]: (t["score"], t["max_score"]) for t in report.results["tests"]}
        kept = [n for n in wrong.lose if n in scores and scores[n][0] >= scores[n][1]]
        unknown = [n for n in wrong.lose if n not in scores]
        if report.score >= report.max_score:
            result.problems.append(f"wrong submission {wrong.name!r} scores full marks")
        if kept:
            result.problems.append(f"wrong submission {wrong.name!r} keeps full points on {kept}")
        if unknown:
            result.problems.append(f"wrong submission {wrong.name!r} names unknown tests {unknown}")
        result.say(f"wrong, {wrong.name}: {report.score:g}/{report.max_score:g} "
                   f"({report.results['execution_time']:.0f} s)")
    return result
