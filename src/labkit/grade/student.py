"""``check()``: the public tests, run in the student's notebook, with explanations.

It calls the notebook's own functions directly (an :class:`InProcessSubmission`), so it
is fast and needs no grader; the tensors still travel through guarded buffers, so a
missing mask is reported instead of corrupting the kernel's memory. It runs the public
tests only: it finds them beside the notebook (``tests/public/`` of the student folder)
or in the exercise's folder of the checkout, never the hidden ones.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .harness import Credit, InProcessSubmission


@dataclass
class CheckSummary:
    exercise: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def all_passed(self) -> bool:
        return not self.failed and bool(self.passed)

    def __repr__(self) -> str:
        return (f"CheckSummary({self.exercise!r}: {len(self.passed)} passed, {len(self.failed)} failed, "
                f"{len(self.skipped)} skipped)")


def public_tests_dir(exercise_id: str) -> Path:
    local = Path.cwd() / "tests" / "public"
    if local.is_dir() and (Path.cwd() / "exercise.json").is_file():
        if json.loads((Path.cwd() / "exercise.json").read_text()).get("id") == exercise_id:
            return local
    from .exercise import load

    return load(exercise_id).public_tests


def _points(exercise_id: str, tests_dir: Path) -> dict[str, float]:
    meta = tests_dir.parents[1] / "exercise.json"
    if meta.is_file():
        return json.loads(meta.read_text()).get("points", {})
    from .exercise import load

    return load(exercise_id).points


def _tests(tests_dir: Path) -> list:
    found = []
    for path in sorted(tests_dir.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"labkit_check_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found += [fn for name, fn in vars(module).items() if name.startswith("test_") and callable(fn)]
    return found


def check(exercise_id: str, namespace: dict | None = None, *, quiet: bool = False) -> CheckSummary:
    """Run the public tests of ``exercise_id`` on the functions in ``namespace``.

    ``namespace`` defaults to the caller's globals (the notebook). Prints one line per
    test and, for each failure, what was expected and what came back.
    """
    if namespace is None:
        caller = inspect.currentframe().f_back
        namespace = caller.f_globals if caller is not None else {}
    tests_dir = public_tests_dir(exercise_id)
    points = _points(exercise_id, tests_dir)
    submission = InProcessSubmission(namespace)
    summary = CheckSummary(exercise_id)
    lines = []
    for fn in _tests(tests_dir):
        kwargs = {"submission": submission}
        if "credit" in inspect.signature(fn).parameters:
            kwargs["credit"] = Credit()
        title = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        label = f"{fn.__name__} ({points.get(fn.__name__, 0):g} pts)" + (f": {title}" if title else "")
        try:
            fn(**kwargs)
        except pytest.skip.Exception as e:
            summary.skipped[fn.__name__] = str(e.msg)
            lines.append(f"skip  {label}\n{textwrap.indent(str(e.msg), '      ')}")
        except AssertionError as e:
            summary.failed[fn.__name__] = str(e)
            lines.append(f"FAIL  {label}\n{textwrap.indent(str(e) or 'assertion failed', '      ')}")
        except Exception as e:  # noqa: BLE001  (a broken result shows up here, never a crash)
            summary.failed[fn.__name__] = f"{type(e).__name__}: {e}"
            lines.append(f"FAIL  {label}\n      unexpected error while checking: {type(e).__name__}: {e}")
        else:
            summary.passed.append(fn.__name__)
            lines.append(f"ok    {label}")
    total = len(summary.passed) + len(summary.failed)
    lines.append(f"\n{len(summary.passed)} of {total} public tests pass"
                 + (" (more, hidden tests decide the grade)." if summary.all_passed else "."))
    if not quiet:
        print("\n".join(lines))
    return summary
