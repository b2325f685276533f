"""Grade one submission: the tests under pytest, Gradescope's results.json.

The tests run under pytest *in this process*, which is trusted: it generates inputs,
computes expected values and decides every outcome. The submission runs only inside a
:class:`~labkit.grade.sandbox.Sandbox`, reached through the ``submission`` fixture, so
nothing it prints, writes or patches reaches a score. Scores come from the exercise's
points table (a test that crashed still has its points there); a test that was never run
counts as failed.

Hidden tests draw different values on every run: while one runs, ``torch.Generator``
mixes each seed it is given with a salt drawn for this grading, so a submission that
memorised the public tests' outputs, or keys answers by shape, meets numbers it has
never seen. Public tests keep their seeds (``check()`` in the notebook is reproducible).

Isolation: with ``user`` (a sandbox user, the grader as root) the submission cannot read
the exercise's tests and notebook (checked before anything runs), cannot write where the
results go, and nothing of it survives the run. Without one (*local mode*) it runs as
the grader's own user and could do anything that user can: local mode is for code one
trusts (the book's own self-test, a student grading their own notebook), and says so.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from labkit import backend

from .exercise import Exercise
from .harness import Credit, Rules, SandboxSubmission
from .sandbox import IsolationError, Sandbox, readable_by, sandbox_ids

PUBLIC, HIDDEN = "visible", "after_due_date"
LOCAL_MODE_NOTE = ("graded in local mode, without a sandbox user: the submission ran with the grader's own "
                   "permissions, so this score is only as trustworthy as the code (use --sandbox-user to "
                   "grade untrusted submissions)")


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
    starts: int = 0  # how many times the submission's process was started (each load costs one)

    @property
    def score(self) -> float:
        return self.results["score"]

    @property
    def max_score(self) -> float:
        return sum(t["max_score"] for t in self.results["tests"])


def static_problems(source: str) -> list[str]:
    """Reasons to score the submission zero before running it: it is not Python.

    What a submission may not call (``forbidden`` in exercise.toml) is checked while it
    runs (:class:`~labkit.grade.harness.Rules`), by what it calls, not by the names it
    defines: a correct ``softmax`` kernel whose launcher happens to be named ``softmax``
    is fine, and ``getattr(torch, "soft" + "max")`` is caught.
    """
    try:
        ast.parse(source)
    except SyntaxError as e:
        return [f"the submission is not valid Python: {e.msg} (line {e.lineno}): {e.text!r}"]
    return []


# What a submission reaching into the grader's worker would need; no exercise's answer does.
TAMPER_SIGNS = ("gc.", "get_objects", "get_referrers", "_getframe", "f_back", "f_locals", "f_globals",
                "__globals__", "__closure__", "ctypes", "labkit.grade", "_python_dispatch", "DispatchMode",
                "JITFunction", "InterpretedFunction", "sys.modules")


def staff_review(source: str) -> dict | None:
    """A results entry visible to the course staff only, when the source shows signs of
    tampering with the worker: the checks that run inside the submission's process (kernel
    launches, operators) cannot be trusted against such code, so a person should read it.
    It changes no score: the signs are names, and a name is not proof."""
    signs = sorted({s for s in TAMPER_SIGNS if s in source})
    if not signs:
        return None
    return {"name": "staff review: read this submission", "score": 0.0, "max_score": 0.0, "visibility": "hidden",
            "output": "The source uses " + ", ".join(f"`{s}`" for s in signs) + ": ways to reach into the grader's "
                      "worker process, where kernel launches and torch operators are counted. Values and times "
                      "are checked by the grader itself; whether the kernel is the student's own is not."}


class _Salted:
    """``torch.Generator`` whose seeds are mixed with a salt (hidden tests' fresh values)."""

    def __init__(self, salt: int):
        import torch

        original = torch.Generator

        class SaltedGenerator(original):
            def manual_seed(self, seed: int):
                return super().manual_seed((int(seed) * 0x9E3779B97F4A7C15 + salt) % (1 << 63))

        self.original, self.salted = original, SaltedGenerator

    def __enter__(self) -> None:
        import torch

        torch.Generator = self.salted

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.Generator = self.original


class _Plugin:
    """Gives tests their ``submission`` and ``credit`` fixtures and records outcomes."""

    def __init__(self, exercise: Exercise, sandbox: Sandbox, salt: int):
        self.exercise, self.sandbox = exercise, sandbox
        self.salt = salt
        self.submission = SandboxSubmission(sandbox, Rules(exercise.kernels, exercise.forbidden))
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
    def pytest_runtest_call(self, item: pytest.Item):
        if self.exercise.hidden_tests not in Path(str(item.path)).parents:
            return (yield)
        # per test: two hidden tests with the same seed and shape still see different values
        salt = int.from_bytes(hashlib.blake2b(f"{self.salt}:{item.name}".encode(), digest_size=8).digest(), "little")
        with _Salted(salt):
            return (yield)

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
    # -c /dev/null: no ini file, so nothing is written to a temporary folder and no
    # configuration of the folder the grader runs in applies
    args = [*map(str, files), "-c", os.devnull, "--rootdir", str(exercise.root),
            "--confcutdir", str(exercise.root), "--import-mode=importlib",
            "-p", "no:cacheprovider", "-p", "no:terminal", "-p", "no:xdist",
            "-W", "ignore::DeprecationWarning"]
    return int(pytest.main(args, plugins=[plugin]))


def check_out_of_sight(exercise: Exercise, user: str) -> None:
    """Refuse to grade as ``user`` if that user could read the tests, notebook or points."""
    ids = sandbox_ids(user)
    private = [exercise.root / "exercise.toml", exercise.notebook, *exercise.test_files(hidden=True)]
    seen = [p for p in private if p.exists() and readable_by(p, *ids)]
    if seen:
        raise IsolationError(
            f"the sandbox user {user} could read {', '.join(map(str, seen[:3]))}: make the exercise "
            f"folder private first (chmod -R go-rwx {exercise.root})")


def grade(exercise: Exercise, source: str, *, hidden: bool = True, user: str | None = None,
          hidden_visibility: str = HIDDEN, compile_check: bool = False, salt: int | None = None) -> Report:
    """Grade ``source`` (a submission module) against the exercise's tests.

    ``user``: the sandbox user the submission runs as (the grader must be root); without
    one the run is in local mode, noted in the results. ``compile_check``: on a CPU, also
    compile each kernel launch for the H200 (:mod:`labkit.compile_check`), so a kernel only
    the interpreter accepts fails its test. ``salt``: the hidden tests' values (random by
    default; fixed only to reproduce a run).
    """
    start = time.monotonic()
    if user:
        check_out_of_sight(exercise, user)
    salt = random.SystemRandom().randrange(1 << 62) if salt is None else salt
    notes = static_problems(source)
    outcomes: dict[str, Outcome] = {}
    starts = 0
    if not notes:
        with Sandbox(source, exercise.limits, gpu=backend.on_gpu(), user=user, compile_check=compile_check,
                     watch={"forbidden": list(exercise.forbidden)}) as sandbox:
            plugin = _Plugin(exercise, sandbox, salt)
            code = _run_pytest(exercise, plugin, exercise.test_files(hidden=hidden))
            if code in (pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
                notes.append(f"grader error, tell the course staff: pytest exited with {code}")
            outcomes = plugin.outcomes
            notes += [f"grader error, tell the course staff: {e}" for e in plugin.collect_errors]
            if sandbox.import_error:
                notes.append(f"the submission could not be loaded:\n{sandbox.import_error}")
            starts = sandbox.starts
        if sandbox.leftovers:
            if user:  # a score is final only once nothing of the submission runs
                raise IsolationError("processes of the submission survived the run; no score is given")
            notes.append("some processes the submission started could not be ended")
    results = results_json(exercise, outcomes, notes, time.monotonic() - start,
                           hidden=hidden, hidden_visibility=hidden_visibility)
    review = staff_review(source)
    if review:
        results["tests"].append(review)
    info = ([f"note: {LOCAL_MODE_NOTE}"] if not user else []) + (
        [f"note: the hidden tests drew their values with salt {salt}"] if hidden else [])
    results["output"] = "\n".join([results["output"], *info])
    return Report(exercise, outcomes, results, notes, starts)


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
    """Write results.json atomically (a reader never sees half a file), through a file
    created fresh (``mkstemp``: never through a name someone else placed there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(results, indent=2))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def failure_results(message: str) -> dict:
    """What is written when the grader itself fails: zero, and why."""
    return {"score": 0.0, "execution_time": 0.0, "tests": [],
            "output": f"The grader failed before it could score this submission: {message}\n"
                      "Nothing was scored; tell the course staff."}
