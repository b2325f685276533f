"""``python -m labkit.grade``: student versions, grading, autograder zips, self-tests."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import labkit  # noqa: F401  (sets the interpreter mode before anything imports triton)

from . import build, notebook, runner, sandbox
from .exercise import all_exercises, load


def _exercises(ids: list[str]):
    return [load(i) for i in ids] if ids else all_exercises()


def _find_submission(path: Path, exercise_id: str) -> Path:
    """A file, or the one a folder holds (Gradescope puts uploads in a folder)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no submission at {path}")
    for pattern in (f"{exercise_id}.ipynb", "*.ipynb", "submission.py", "*.py"):
        found = sorted(path.rglob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(f"{path} holds no .ipynb or .py file to grade")


LOCAL_MODE_REFUSAL = (
    "refusing to grade without isolation: without --sandbox-user the submission would run as "
    "this user, able to read the tests and solutions and to overwrite the results. Grade "
    "untrusted submissions as root with --sandbox-user <user>; pass --trust-submission to grade "
    "code you trust (your own notebook) in local mode."
)


class _Stopped:
    signal: str | None = None


def _end_on_signal(signum: int, frame: object) -> None:  # noqa: ARG001
    # KeyboardInterrupt is what pytest lets through (it ends the session, the sandbox closes)
    _Stopped.signal = signal.Signals(signum).name
    raise KeyboardInterrupt


def cmd_grade(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    # Killed by a timeout or Ctrl-C, the grader still ends the sandbox and removes its folder.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _end_on_signal)
    try:
        if not args.sandbox_user and not args.trust_submission:
            raise sandbox.IsolationError(LOCAL_MODE_REFUSAL)
        if args.sandbox_user:
            ids = sandbox.sandbox_ids(args.sandbox_user)
            if sandbox.writable_by(out.parent, *ids) or (out.exists() and sandbox.writable_by(out, *ids)):
                raise sandbox.IsolationError(f"the sandbox user could write {out}: put the results elsewhere")
        else:
            print(f"WARNING: {runner.LOCAL_MODE_NOTE}", file=sys.stderr)
        exercise = load(Path(args.exercise).resolve() if Path(args.exercise).is_dir() else args.exercise)
        path = _find_submission(Path(args.submission).resolve(), exercise.id)
        os.chdir("/")  # the grader's folder is nothing a submission should find through /proc
        try:
            source = notebook.source_of(path)
        except Exception as e:  # noqa: BLE001  (an unreadable notebook is the submission's fault)
            source = f"raise SystemExit({f'cannot read the submission {path.name}: {e}'!r})\n"
        report = runner.grade(exercise, source, hidden=not args.public_only, user=args.sandbox_user)
        if _Stopped.signal:
            raise SystemExit(f"the grader was stopped by signal {_Stopped.signal}")
    except (Exception, KeyboardInterrupt, SystemExit) as e:  # noqa: BLE001  (results.json is written whatever happens)
        if isinstance(e, KeyboardInterrupt):
            e = SystemExit(f"the grader was stopped by signal {_Stopped.signal or 'SIGINT'}")
        runner.write_results(runner.failure_results(f"{type(e).__name__}: {e}"), out)
        print(f"grader error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    runner.write_results(report.results, out)
    print(report.results["output"])
    return 0


def cmd_student(args: argparse.Namespace) -> int:
    for ex in _exercises(args.ids):
        print(build.student_folder(ex, Path(args.out)))
    return 0


def cmd_autograder(args: argparse.Namespace) -> int:
    for ex in _exercises(args.ids):
        print(build.autograder_zip(ex, Path(args.out)))
    return 0


def cmd_selftest(args: argparse.Namespace) -> int:
    status = 0
    for ex in _exercises(args.ids):
        print(f"{ex.id}:", flush=True)
        result = build.selftest(ex, progress=lambda line: print(f"  {line}", flush=True))
        for line in [f"PROBLEM: {p}" for p in result.problems]:
            print(f"  {line}")
        print(f"{ex.id}: {'ok' if result.ok else 'FAILED'}", flush=True)
        status |= not result.ok
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.grade", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("student", help="write student versions (stubs, public tests) of exercises")
    p.add_argument("ids", nargs="*", help="exercise ids (default: all)")
    p.add_argument("--out", default="_build/student")
    p.set_defaults(fn=cmd_student)
    p = sub.add_parser("grade", help="grade a submission; write Gradescope's results.json")
    p.add_argument("exercise", help="exercise id or folder")
    p.add_argument("submission", help=".ipynb or .py file, or a folder holding one")
    p.add_argument("--out", default="results.json")
    p.add_argument("--public-only", action="store_true", help="run the public tests only")
    p.add_argument("--sandbox-user", default=None,
                   help="run the submission as this unprivileged user (the grader must be root)")
    p.add_argument("--trust-submission", action="store_true",
                   help="grade without a sandbox user (local mode): only for code you trust")
    p.set_defaults(fn=cmd_grade)
    p = sub.add_parser("autograder", help="build Gradescope autograder zips")
    p.add_argument("ids", nargs="*")
    p.add_argument("--out", default="_build/autograder")
    p.set_defaults(fn=cmd_autograder)
    p = sub.add_parser("selftest", help="solution full, stub zero, known-wrong submissions lose points")
    p.add_argument("ids", nargs="*")
    p.set_defaults(fn=cmd_selftest)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
