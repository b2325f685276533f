"""The grader survives hostile and broken submissions, and cannot be talked into a score.

Every case grades a variant of the memory-axpb solution against its public tests
(two tests: n = 1024, whole blocks; n = 1000, a masked tail). A variant that misbehaves
only for n = 1000 must fail that test alone, with feedback, and keep the other.
"""

from __future__ import annotations

import dataclasses
import json
import linecache
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import labkit
from labkit.grade import exercise, guard, notebook, perf_inputs, runner, wire
from labkit.grade.harness import InProcessSubmission, Randn, SandboxSubmission
from labkit.grade.sandbox import Limits, Sandbox, SubmissionFailed
from labkit.grade.student import check

EX = exercise.load("memory-axpb")
FAST = dataclasses.replace(EX, limits=Limits(call_timeout_s=8, cpu_s=60, memory_mb=4096))
SOLUTION = notebook.submission_source(notebook.read(EX.notebook))
WHOLE, TAIL = "test_whole_blocks", "test_tail_is_masked"


def with_axpb(body: str, prelude: str = "") -> str:
    """The solution, with ``axpb`` redefined; ``solved(...)`` is the correct one."""
    return (SOLUTION + "\nsolved = axpb\n" + prelude
            + "\ndef axpb(x, a, b, out=None):\n" + "".join(f"    {ln}\n" for ln in body.strip().splitlines()))


def outcomes(source: str, ex=FAST) -> dict[str, dict]:
    report = runner.grade(ex, source, hidden=False)
    return {t["name"].split(":")[0]: t for t in report.results["tests"]} | {"_score": report.score,
                                                                           "_notes": report.notes}


def only_tail_fails(source: str, *feedback: str) -> dict:
    got = outcomes(source)
    assert got[WHOLE]["status"] == "passed", got[WHOLE]["output"]
    assert got[TAIL]["status"] == "failed" and got[TAIL]["score"] == 0
    for text in feedback:
        assert text in got[TAIL]["output"], got[TAIL]["output"]
    return got


ON_TAIL = "if x.numel() == 1000:\n    {}\nreturn solved(x, a, b, out)"


def test_solution_passes_public_tests():
    got = outcomes(SOLUTION)
    assert got["_score"] == EX.points[WHOLE] + EX.points[TAIL]


@pytest.mark.parametrize("action, feedback", [
    ("raise RuntimeError('boom')", ["RuntimeError: boom"]),
    ("return out[:-1]", ["expected shape (1000,), got (999,)"]),
    ("return solved(x, a, b).double()", ["expected dtype torch.float32, got torch.float64"]),
    ("return torch.full_like(x, float('nan'))", ["1000 NaN"]),
    ("import ctypes; ctypes.string_at(0)", ["segmentation fault"]),
    ("while True: pass", ["longer than 8 s"]),
    ("return bytearray(8 << 30)", ["MemoryError"]),
    ("import sys; sys.exit(0)", ["SystemExit"]),
    ("return lambda: 0", ["cannot read"]),
    ("x.zero_(); return torch.full_like(x, b)", ["FAILED"]),
    ("import json, os, sys; os.write(json.loads(sys.argv[1])['fd_out'], b'\\xff' * 16)",
     ["unreadable reply"]),
], ids=["exception", "wrong-shape", "wrong-dtype", "nan", "segfault", "infinite-loop",
        "out-of-memory", "sys-exit", "unreadable-return", "overwrites-its-input", "garbage-on-the-pipe"])
def test_misbehaviour_fails_only_its_own_test(action, feedback):
    only_tail_fails(with_axpb(ON_TAIL.format(action)), *feedback)


def test_process_exit_is_survived_by_the_next_test():
    got = outcomes(with_axpb("if x.numel() == 1024:\n    import os; os._exit(3)\nreturn solved(x, a, b, out)"))
    assert got[WHOLE]["status"] == "failed" and "exit status 3" in got[WHOLE]["output"]
    assert got[TAIL]["status"] == "passed"


def test_exit_at_import_scores_zero_with_the_reason():
    got = outcomes(SOLUTION + "\nimport sys\nsys.exit('no')\n")
    assert got["_score"] == 0
    assert "could not be loaded" in got[TAIL]["output"] and "SystemExit" in got[TAIL]["output"]


@pytest.mark.parametrize("line", ["import labkit.softmax", "from labkit import memory",
                                  "import labkit.grade.runner"])
def test_labkit_solutions_and_the_grader_cannot_be_imported(line):
    got = outcomes(line + "\n" + SOLUTION)
    assert got["_score"] == 0
    assert "not available to submissions" in got[WHOLE]["output"] or "No module" in got[WHOLE]["output"]


def test_forged_scores_count_for_nothing(tmp_path):
    """Patch the checks, print pass lines, write results files now and later: score 0."""
    results = tmp_path / "results.json"
    forger = f"""
import labkit.check, subprocess, torch, json
labkit.check.assert_close = lambda *a, **k: None
torch.allclose = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
fake = json.dumps({{"score": 100, "tests": []}})
print("PASS 10/10 test_tail_is_masked"); print(fake)
open({str(results)!r}, "w").write(fake)
subprocess.Popen(["sh", "-c", "sleep 3; echo '" + fake + "' > {results}"], start_new_session=True)
return torch.zeros_like(x)
"""
    report = runner.grade(FAST, with_axpb(forger), hidden=False)
    runner.write_results(report.results, results)
    time.sleep(4)  # the background writer would have fired by now
    written = json.loads(results.read_text())
    assert written["score"] == 0 == report.score
    assert all(t["status"] == "failed" for t in written["tests"])
    assert "does not affect the score" in written["tests"][1]["output"]


def test_forbidden_names_score_zero_before_running():
    ex = dataclasses.replace(FAST, forbidden=("softmax",))
    got = outcomes(with_axpb("return torch.softmax(x, 0)"), ex)
    assert got["_score"] == 0 and any("softmax" in n for n in got["_notes"])


def test_cli_always_writes_results(tmp_path):
    out = tmp_path / "results.json"
    code = subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb",
                           str(tmp_path / "missing.py"), "--out", str(out)], capture_output=True).returncode
    assert code == 2 and json.loads(out.read_text())["score"] == 0


def test_unreadable_notebook_is_graded_zero(tmp_path):
    sub, out = tmp_path / "memory-axpb.ipynb", tmp_path / "results.json"
    sub.write_text("{not json")
    subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb", str(tmp_path),
                    "--out", str(out), "--public-only"], check=True, capture_output=True)
    written = json.loads(out.read_text())
    assert written["score"] == 0 and "cannot read the submission" in written["output"]


def test_timed_runs_check_every_result():
    """The performance path, on the CPU: right answers are timed, wrong ones rejected."""
    sets = [[Randn((3000,), seed=s), 2.0, 1.0] for s in range(2)]
    with Sandbox(SOLUTION, FAST.limits) as box:
        result = SandboxSubmission(box).measure("axpb", lambda x, a, b: a * x + b, sets,
                                                bytes_moved=8 * 3000, rounds=2)
        assert result.calls == 4 and result.tbps > 0
    memoised = with_axpb("cache = globals().setdefault('_cache', {})\n"
                         "if x.data_ptr() not in cache: cache[x.data_ptr()] = solved(x, a, b)\n"
                         "return cache[x.data_ptr()]")
    # Reversed, the output keeps its plain sum: only the signed checksum tells it apart.
    for wrong in (memoised, with_axpb("return solved(x, a, b).flip(0)")):
        with Sandbox(wrong, FAST.limits) as box, pytest.raises(SubmissionFailed, match="wrong result"):
            SandboxSubmission(box).measure("axpb", lambda x, a, b: a * x + b, sets, bytes_moved=1, rounds=2)
    with Sandbox(with_axpb("return solved(x, a, b)[:-1]"), FAST.limits) as box, \
            pytest.raises(SubmissionFailed, match="expected an output of 3000 elements"):
        SandboxSubmission(box).measure("axpb", lambda x, a, b: a * x + b, sets, bytes_moved=1, rounds=1)


def test_checksum_signs_are_fixed_by_the_seed():
    w = perf_inputs.checksum_signs(10_000, seed=7, device="cpu")
    assert w.dtype == torch.int8 and set(w.unique().tolist()) == {-1, 1}
    assert torch.equal(w, perf_inputs.checksum_signs(10_000, seed=7, device="cpu"))
    assert not torch.equal(w, perf_inputs.checksum_signs(10_000, seed=8, device="cpu"))
    with pytest.raises(TypeError, match="return a tensor"):
        perf_inputs.checksum([1.0], w)


# -- the pieces, without a sandbox -----------------------------------------------------
def test_wire_round_trips_and_rejects_malformed_frames():
    msg = {"a": [1, 2.5, float("nan"), None, "s", (torch.arange(6.0).reshape(2, 3),)]}
    back = wire.unpack(wire.pack(msg)[8:])
    assert torch.equal(back["a"][5][0], msg["a"][5][0]) and back["a"][5].__class__ is tuple
    frame = bytearray(wire.pack({"t": torch.ones(4)})[8:])
    with pytest.raises(wire.WireError, match="do not add up"):
        wire.unpack(bytes(frame[:-1]))
    header = json.dumps({"body": {"__tensor__": 0, "dtype": "object", "shape": [1]}, "blobs": [8]}).encode()
    with pytest.raises(wire.WireError, match="unsupported dtype"):
        wire.unpack(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(wire.WireError, match="cannot send"):
        wire.pack({"f": object()})


def test_call_with_args_returns_what_the_call_left_and_spares_the_inputs():
    namespace: dict = {}
    exec("def scale_(x, out):\n    out.copy_(2 * x)\n    x.zero_()\n", namespace)  # noqa: S102
    x, out = torch.arange(1.0, 7.0).reshape(2, 3), torch.zeros(3, 2).t()
    value, (x_after, out_after) = InProcessSubmission(namespace).call_with_args("scale_", x, out)
    assert value is None and torch.equal(x, torch.arange(1.0, 7.0).reshape(2, 3))
    assert torch.equal(x_after, torch.zeros(2, 3)) and torch.equal(out_after, 2 * x)
    assert out_after.stride() == out.stride()


def test_guard_reports_writes_outside_the_view():
    x = torch.arange(10.0)[::2]  # a strided view: the span has 9 elements
    placed = guard.Placed(guard.describe(x), "cpu")
    assert torch.equal(placed.view, x)
    placed.buffer[placed.margin + placed.length] = 1.0  # one element past the end
    report = guard.margin_report(placed.after(), "out", (5,))
    assert report and "1 element(s) past the end" in report


def test_strip_solutions_and_its_errors():
    src = "def f():\n    # BEGIN SOLUTION\n    # STUB: return 0\n    return 42\n    # END SOLUTION\n"
    assert notebook.strip_solutions(src) == "def f():\n    return 0\n"
    assert "NotImplementedError" in notebook.strip_solutions(src.replace("    # STUB: return 0\n", ""))
    with pytest.raises(notebook.MarkerError, match="without END"):
        notebook.strip_solutions("# BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(notebook.MarkerError, match="without BEGIN"):
        notebook.strip_solutions("x = 1\n# END SOLUTION\n")


def test_exercise_loading_errors(tmp_path):
    with pytest.raises(exercise.ExerciseError, match="no exercise"):
        exercise.load("no-such-exercise")
    bad = tmp_path / "bad-one"
    bad.mkdir()
    (bad / "exercise.toml").write_text('id = "other"\n')
    with pytest.raises(exercise.ExerciseError, match="must match its folder"):
        exercise.load(bad)
    with pytest.raises(exercise.ExerciseError, match="occurs 0 times"):
        exercise.Wrong("w", (("absent", "x"),)).apply(SOLUTION)


def test_check_explains_failures_in_process(capsys):
    for source, expect in ((SOLUTION, "2 of 2 public tests pass"),
                           (notebook.strip_solutions(SOLUTION), "0 of 2 public tests pass")):
        namespace: dict = {}
        # Where IPython keeps a cell's source: Triton compiles a kernel from its source text.
        linecache.cache["<notebook>"] = (len(source), None, source.splitlines(True), "<notebook>")
        exec(compile(source, "<notebook>", "exec"), namespace)  # noqa: S102  (our own notebook)
        summary = check("memory-axpb", namespace)
        assert expect in capsys.readouterr().out
    assert not summary.all_passed and "NaN" in summary.failed[TAIL]


@pytest.mark.skipif(labkit.on_gpu(), reason="the check compiles what the interpreter runs; a GPU compiles anyway")
def test_compile_check_fails_a_kernel_only_the_interpreter_accepts():
    """A kernel reading a plain global (compiled kernels see only constexpr globals) passes under
    the interpreter; graded with the compile check, its tests fail and say why."""
    source = SOLUTION.replace("y = a * x + b", "y = a * x + b * ONE") + "\nONE = 1.0\n"
    assert source != SOLUTION + "\nONE = 1.0\n"
    plain = runner.grade(FAST, source, hidden=False)
    assert plain.score == plain.max_score, plain.results["output"]
    checked = runner.grade(FAST, source, hidden=False, compile_check=True)
    assert checked.score == 0
    assert all("axpb_kernel does not compile for sm_90" in t["output"] and "global variable ONE" in t["output"]
               for t in checked.results["tests"]), checked.results["output"]
