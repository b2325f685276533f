"""Grade one submission: static checks, the tests under pytest, Gradescope's results.json.

The tests run under pytest *in this process*, which is trusted: it generates inputs,
computes expected values and decides every outcome. The submission runs only inside a
:class:`~labkit.grade.sandbox.Sandbox`, reached through the ``submission`` fixture, so
nothing it prints, writes or patches reaches a score. Scores come from the exercise's
points table (a test that crashed still has its points there); a test that was never run
counts as failed.
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from labkit import backend

from .exercise import Exercise
from .harness import Credit, SandboxSubmission
from .sandbox import Sandbox

PUBLIC, HIDDEN = "visible", "after_due_date"


@dataclass
class Outcome:
    name: str
    status: str  # passed | failed | skipped
    message: str = ""
    title: str = ""
    public: bool = True
    credit: float | None = None
    output: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    exercise: Exercise
    outcomes: dict[str, Outcome]
    results: dict
    notes: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return self.results["score"]

    @property
    def max_score(self) -> float:
        return sum(t["max_score"] for t in self.results["tests"])


def static_problems(source: str, exercise: Exercise) -> list[str]:
    """Reasons to score the submission zero before running it (read from its text only)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [f"the submission is not valid Python: {e.msg} (line {e.lineno}): {e.text!r}"]
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    return [f"the submission uses `{name}`, which this exercise asks you to implement yourself"
            for name in exercise.forbidden if name in used]


class _Plugin:
    """Gives tests their ``submission`` and ``credit`` fixtures and records outcomes."""

    def __init__(self, exercise: Exercise, sandbox: Sandbox):
        self.exercise, self.sandbox = exercise, sandbox
        self.submission = SandboxSubmission(sandbox)
        self.outcomes: dict[str, Outcome] = {}
        self.credits: dict[str, Credit] = {}
        self.collect_errors: list[str] = []
        self._log_offset = 0

    @pytest.fixture(name="submission", scope="session")
    def submission_fixture(self) -> SandboxSubmission:
        return self.submission

    @pytest.fixture(name="credit")
    def credit_fixture(self, request: pytest.FixtureRequest) -> Credit:
        return self.credits.setdefault(request.node.name, Credit())

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {report.longreprtext[-2000:]}")

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self._log_offset = self.sandbox.log_size()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if call.when == "call" or report.outcome != "passed":
            self._record(item, call, report)
        return report

    def _record(self, item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> None:
        name = item.name
        if name in self.outcomes and self.outcomes[name].status != "passed":
            return  # keep the first failure (a teardown error after a failed call adds nothing)
        doc = (getattr(item, "function", None).__doc__ or "").strip().splitlines()
        message = ""
        if report.skipped:
            status = "skipped"
            message = str(call.excinfo.value.msg) if call.excinfo else "skipped"
        elif report.failed:
            status = "failed"
            exc = call.excinfo.value if call.excinfo else None
            if isinstance(exc, AssertionError):
                message = str(exc) or "assertion failed"
            elif exc is not None:
                message = ("unexpected error while checking the result: "
                           + "".join(traceback.format_exception_only(type(exc), exc)).strip())
        else:
            status = "passed"
        credit = self.credits.get(name)
        self.outcomes[name] = Outcome(
            name=name, status=status, message=message, title=doc[0] if doc else "",
            public=self.exercise.public_tests in Path(str(item.path)).parents,
            credit=credit.fraction if credit and credit.fraction is not None else None,
            output=self.sandbox.output_since(self._log_offset), seconds=call.duration,
        )
        if credit and credit.message:
            self.outcomes[name].message = credit.message


def _run_pytest(exercise: Exercise, plugin: _Plugin, files: list[Path]) -> int:
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")
        args = [*map(str, files), "-c", str(ini), "--rootdir", str(exercise.root),
                "--confcutdir", str(exercise.root), "--import-mode=importlib",
                "-p", "no:cacheprovider", "-p", "no:terminal", "-p", "no:xdist",
                "-W", "ignore::DeprecationWarning"]
        return int(pytest.main(args, plugins=[plugin]))


def grade(exercise: Exercise, source: str, *, hidden: bool = True, user: str | None = None,
          hidden_visibility: str = HIDDEN, compile_check: bool = False) -> Report:
    """Grade ``source`` (a submission module) against the exercise's tests.

    ``compile_check``: on a CPU, also compile each kernel launch for the H200
    (:mod:`labkit.compile_check`), so a kernel only the interpreter accepts fails its test.
    """
    start = time.monotonic()
    notes = static_problems(source, exercise)
    outcomes: dict[str, Outcome] = {}
    if not notes:
        with Sandbox(source, exercise.limits, gpu=backend.on_gpu(), user=user,
                     compile_check=compile_check) as sandbox:
            plugin = _Plugin(exercise, sandbox)
            code = _run_pytest(exercise, plugin, exercise.test_files(hidden=hidden))
            if code in (pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
                notes.append(f"grader error, tell the course staff: pytest exited with {code}")
            outcomes = plugin.outcomes
            notes += [f"grader error, tell the course staff: {e}" for e in plugin.collect_errors]
            if sandbox.import_error:
                notes.append(f"the submission could not be loaded:\n{sandbox.import_error}")
    results = results_json(exercise, outcomes, notes, time.monotonic() - start,
                           hidden=hidden, hidden_visibility=hidden_visibility)
    return Report(exercise, outcomes, results, notes)


def _test_output(o: Outcome) -> str:
    parts = [o.title] if o.title else []
    if o.message:
        parts.append(o.message)
    if o.output.strip():
        parts.append("The submission printed (shown for information; it does not affect the score):\n"
                     + o.output.rstrip())
    return "\n\n".join(parts)


def results_json(exercise: Exercise, outcomes: dict[str, Outcome], notes: list[str], seconds: float,
                 *, hidden: bool = True, hidden_visibility: str = HIDDEN) -> dict:
    """Gradescope's results.json, with one entry per row of the points table."""
    public_names = _public_test_names(exercise)
    tests, reasons = [], {}
    for name, points in exercise.points.items():
        public = name in public_names
        if not hidden and not public:
            continue
        o = outcomes.get(name) or Outcome(name, "failed", "not run: " + ("; ".join(notes) or
                                          "no test of this name was collected"), public=public)
        entry = {"name": f"{name}: {o.title}" if o.title else name,
                 "visibility": PUBLIC if public else hidden_visibility, "output": _test_output(o)}
        reasons[entry["name"]] = o.message.splitlines()[0] if o.message else ""
        if o.status == "skipped":
            entry.update(score=0.0, max_score=0.0, output=f"Skipped: {o.message}")
        else:
            fraction = (o.credit if o.credit is not None else 1.0) if o.status == "passed" else 0.0
            entry.update(score=round(points * fraction, 4), max_score=points, status=o.status)
        tests.append(entry)
    for name in sorted(set(outcomes) - set(exercise.points)):
        notes.append(f"grader error, tell the course staff: test {name} has no row in the points table")
    results = {"score": round(sum(t["score"] for t in tests), 4), "execution_time": round(seconds, 2),
               "tests": tests, "stdout_visibility": "hidden"}
    results["output"] = summary(exercise, results, notes, reasons)
    return results


def _public_test_names(exercise: Exercise) -> set[str]:
    names = set()
    for path in exercise.test_files(hidden=False):
        tree = ast.parse(path.read_text())
        names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return names


def summary(exercise: Exercise, results: dict, notes: list[str], reasons: dict[str, str]) -> str:
    """The readable version: one line per test, why each failure failed, then notes."""
    max_score = sum(t["max_score"] for t in results["tests"])
    lines = [f"{exercise.id}: {results['score']:g} / {max_score:g} points "
             f"({results['execution_time']:.0f} s)"]
    for t in results["tests"]:
        mark = {"passed": "PASS", "failed": "FAIL"}.get(t.get("status", ""), "SKIP")
        lines.append(f"  {mark} {t['score']:>5g}/{t['max_score']:<4g} {t['name']}")
        if mark == "FAIL" and reasons.get(t["name"]):
            lines.append(f"               {reasons[t['name']]}")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def write_results(results: dict, path: str | Path) -> None:
    """Write results.json atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)


def failure_results(message: str) -> dict:
    """What is written when the grader itself fails: zero, and why."""
    return {"score": 0.0, "execution_time": 0.0, "tests": [],
            "output": f"The grader failed before it could score this submission: {message}\n"
                      "Nothing was scored; tell the course staff."}
