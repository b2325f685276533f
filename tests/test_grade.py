"""The grader survives hostile and broken submissions, and cannot be talked into a score.

Most cases grade a variant of the memory-axpb solution against its public tests
(two tests: n = 1024, whole blocks; n = 1000, a masked tail). A variant that misbehaves
only for n = 1000 must fail that test alone, with feedback, and keep the other.

The second half is the bank of attacks from issue 21 (a hostile student's bank), each in
local mode and, where the grader runs as root, in sandbox-user mode: the deployment
that matters, where the submission runs as an unprivileged user.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import linecache
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import labkit
from labkit.grade import exercise, forkserver, guard, notebook, perf_inputs, runner, sandbox, supervisor, wire
from labkit.grade.harness import InProcessSubmission, Randn, Rules, SandboxSubmission
from labkit.grade.sandbox import IsolationError, Limits, Sandbox, SubmissionFailed, sandbox_ids
from labkit.grade.student import check

EX = exercise.load("memory-axpb")
FAST_LIMITS = Limits(call_timeout_s=5, cpu_s=60, memory_mb=4096, total_s=120)
# Without its run-time rules: the cases below test values, crashes and the sandbox, and a
# variant computing in torch must fail for its values, not only for launching no kernel.
FAST = dataclasses.replace(EX, limits=FAST_LIMITS, kernels=(), forbidden=())
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
    ("while True: pass", ["longer than 5 s"]),
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
                                  "import labkit.grade.runner", "import labkit.grade.worker"])
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


def test_cli_always_writes_results(tmp_path):
    out = tmp_path / "results.json"
    code = subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb",
                           str(tmp_path / "missing.py"), "--out", str(out), "--trust-submission"],
                          capture_output=True).returncode
    assert code == 2 and json.loads(out.read_text())["score"] == 0
    assert "no submission at" in json.loads(out.read_text())["output"]


def test_unreadable_notebook_is_graded_zero(tmp_path):
    sub, out = tmp_path / "memory-axpb.ipynb", tmp_path / "results.json"
    sub.write_text("{not json")
    subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb", str(tmp_path),
                    "--out", str(out), "--public-only", "--trust-submission"], check=True, capture_output=True)
    written = json.loads(out.read_text())
    assert written["score"] == 0 and "cannot read the submission" in written["output"]


def test_timed_runs_check_every_result():
    """The performance path, on the CPU: right answers are timed, wrong ones rejected."""
    sets = [[Randn((3000,), seed=s), 2.0, 1.0] for s in range(2)]
    with Sandbox(SOLUTION, FAST.limits) as box:
        result = SandboxSubmission(box).measure("axpb", lambda x, a, b: a * x + b, sets,
                                                bytes_moved=8 * 3000, rounds=2)
        assert result.calls == 4 and result.tbps > 0
    # One output buffer for every call is fine: the full outputs checked are the last it held.
    reused = with_axpb("return solved(x, a, b, globals().setdefault('_out', torch.empty_like(x)))")
    with Sandbox(reused, FAST.limits) as box:
        result = SandboxSubmission(box).measure("axpb", lambda x, a, b: a * x + b, sets, bytes_moved=1, rounds=3)
        assert result.calls == 6
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


def test_guard_reads_of_a_bool_argument_are_not_writes():
    # torch copies bool bytes as 0/1, so a bool buffer could not keep the margin pattern:
    # a mask that was only read came back reported as overwritten on both sides.
    mask = torch.tensor([[True, False, True], [False, True, True]])
    placed = guard.Placed(guard.describe(mask), "cpu")
    assert placed.view.dtype == torch.bool and torch.equal(placed.view.clone(), mask)
    after = placed.after()
    assert guard.margin_report(after, "mask", (2, 3)) is None and torch.equal(after["span"].reshape(2, 3), mask)
    placed.view.as_strided((1,), (1,), placed.margin + placed.length).fill_(True)  # one past the end
    report = guard.margin_report(placed.after(), "mask", (2, 3))
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


# == The bank of attacks from issue 21 ===================================================
# Each entry is an attack a hostile student tried; the comment says which. They run in
# local mode and, where the tests run as root (CI does), in sandbox-user mode too.
# One user per test worker: ending a grading kills every process of its sandbox user, so
# two gradings at once must not share one (pytest-xdist names its workers gw0, gw1, ...).
SANDBOX_USER = "-".join(["labkit-sandbox", *filter(None, [os.environ.get("PYTEST_XDIST_WORKER")])])


def _sandbox_user() -> str:
    """The sandbox user, created if missing; a skip, saying why, where that mode cannot run."""
    if os.geteuid() != 0:
        pytest.skip("sandbox-user mode needs the tests to run as root (CI does)")
    try:
        pwd.getpwnam(SANDBOX_USER)
    except KeyError:  # another test worker may be creating it at the same moment: look again after
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               SANDBOX_USER], capture_output=True, text=True)
        try:
            pwd.getpwnam(SANDBOX_USER)
        except KeyError:
            pytest.fail(f"as root, could not create the sandbox user: {made.stderr.strip()}")
    ids = sandbox_ids(SANDBOX_USER)
    if os.environ.get("CI"):
        _let_the_sandbox_user_reach_python(ids)
    try:
        sandbox.check_runnable(ids)
    except IsolationError as e:
        pytest.skip(str(e))
    return SANDBOX_USER


def _let_the_sandbox_user_reach_python(ids: tuple[int, int]) -> None:
    """On CI only (a throwaway machine, as root): the venv's interpreter may live under a
    private folder (pyenv under /root, mode 0700), which makes every sandbox-mode test skip.
    A Gradescope image installs Python where every user can read it; CI gets there by adding
    the traverse bit (o+x, no listing) to the folders on the way, so the bank of attacks runs
    in sandbox-user mode there as the issue demands."""
    for needed in (Path(sys.executable).resolve(), Path(os.__file__).resolve(), *map(Path, sandbox._site_dirs())):
        for folder in reversed(needed.parents):
            if not sandbox.readable_by(folder, *ids) and folder.stat().st_uid == 0:
                folder.chmod(folder.stat().st_mode | stat.S_IXOTH)


@pytest.fixture(params=["local", "sandbox"])
def user(request) -> str | None:
    return _sandbox_user() if request.param == "sandbox" else None


@pytest.fixture
def sandbox_tmp(monkeypatch):
    """The folder this test's sandboxes are made in; it must be empty again at the end."""
    root = Path(tempfile.mkdtemp(prefix="labkit-test-"))
    os.chmod(root, 0o711)  # the sandbox user reaches its own work/ through it
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    left = sorted(p.name for p in root.iterdir())
    shutil.rmtree(root, ignore_errors=True)
    assert not left, f"the grader left {left} behind"


@pytest.fixture
def drop_box():
    """A folder anyone may write to: where a submission's escaped process would leave a mark."""
    box = Path(tempfile.mkdtemp(prefix="labkit-drop-"))
    os.chmod(box, 0o1777)
    yield box
    shutil.rmtree(box, ignore_errors=True)


def private_exercise(ex_id: str, tmp_path: Path, limits: Limits = FAST_LIMITS) -> exercise.Exercise:
    """A copy of an exercise, notebook included, that only the grader's user can read
    (what setup.sh does on Gradescope with chmod -R go-rwx)."""
    dest = tmp_path / "private" / ex_id
    shutil.copytree(exercise.load(ex_id).root, dest)
    os.chmod(tmp_path / "private", 0o700)
    return dataclasses.replace(exercise.load(dest), limits=limits)


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def by_name(report: runner.Report) -> dict[str, dict]:
    return {t["name"].split(":")[0]: t for t in report.results["tests"]}


def test_sandbox_mode_grades_the_solution_and_refuses_a_readable_exercise(tmp_path, sandbox_tmp):
    user = _sandbox_user()
    ex = private_exercise("memory-axpb", tmp_path)
    report = runner.grade(ex, SOLUTION, hidden=False, user=user)
    assert report.score == EX.points[WHOLE] + EX.points[TAIL], report.results["output"]
    public = Path(tempfile.mkdtemp(prefix="labkit-public-"))
    try:
        os.chmod(public, 0o755)
        shutil.copytree(ex.root, public / ex.id)  # modes as in the checkout: readable by all
        with pytest.raises(IsolationError, match="could read"):
            runner.grade(dataclasses.replace(ex, root=public / ex.id, notebook=public / ex.id / ex.notebook.name),
                         SOLUTION, hidden=False, user=user)
    finally:
        shutil.rmtree(public)


def test_escapes_through_the_sandbox_folder_change_nothing(user, tmp_path, sandbox_tmp, drop_box):
    """Attacks 1-4: output.log replaced by a symlink to a root-owned script or a FIFO, then a
    crash so that the grader restarts the worker; a writer detached with setsid, a double
    fork and a clean environment, waiting to overwrite results once the grader is done."""
    target = tmp_path / "run_autograder"
    target.write_text("#!/bin/sh\necho the real script\n")
    marker = f"labkit-escape-{os.getpid()}-{time.monotonic_ns()}"
    prelude = f"""
import os, subprocess
_root = os.path.dirname(os.getcwd())
for _name, _make in (("output.log", lambda p: os.symlink({str(target)!r}, p)), ("output.fifo", os.mkfifo)):
    try:
        _make(os.path.join(_root, _name))
    except OSError:
        pass
subprocess.Popen(["/bin/sh", "-c", "(sleep 3; echo forged > {drop_box}/forged) & : {marker}"],
                 start_new_session=True, env={{}})
for _shared in ("/tmp", "/dev/shm"):
    try:
        open(os.path.join(_shared, "{marker}"), "w").write("left behind")
    except OSError:
        pass
"""
    source = with_axpb("if x.numel() == 1024:\n    print('echo pwned'); os._exit(3)\nreturn solved(x, a, b, out)",
                       prelude)
    start = time.monotonic()
    got = by_name(runner.grade(private_exercise("memory-axpb", tmp_path), source, hidden=False, user=user))
    assert time.monotonic() - start < FAST_LIMITS.total_s + FAST_LIMITS.start_timeout_s  # a FIFO once hung it
    assert got[WHOLE]["status"] == "failed" and "exit status 3" in got[WHOLE]["output"]
    assert got[TAIL]["status"] == "passed"
    assert not processes_with(marker), "a detached process of the submission outlived the grading"
    time.sleep(4)  # the writer would have fired by now
    assert not (drop_box / "forged").exists()
    assert target.read_text() == "#!/bin/sh\necho the real script\n"
    if user:  # in local mode the submission's files are the grader user's own, and stay
        assert not any(Path(shared, marker).exists() for shared in ("/tmp", "/dev/shm"))
    else:
        for shared in ("/tmp", "/dev/shm"):
            Path(shared, marker).unlink(missing_ok=True)


def test_a_submission_cannot_find_the_exercise(tmp_path, sandbox_tmp):
    """Attacks 2 and 5: read the instructor's notebook or hidden tests, through the
    grader's working folder (/proc/<ppid>/cwd, up the chain of parents) or their path."""
    ex = private_exercise("memory-axpb", tmp_path)
    prelude = f"""
import glob, os
def _spy():
    places, pid = [{str(ex.root)!r}], os.getppid()
    while pid > 1:
        try:
            places.append(os.readlink(f"/proc/{{pid}}/cwd"))
            pid = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
    stolen = []
    for place in places:
        for path in glob.glob(os.path.join(place, "**", "*"), recursive=True):
            if path.endswith((".ipynb", "exercise.toml")) or "hidden" in path:
                try:
                    stolen.append(open(path).read())
                except OSError:
                    pass
    return stolen
STOLEN = _spy()
print("stole", len(STOLEN), "files")
"""
    report = runner.grade(ex, with_axpb("return solved(x, a, b, out) if STOLEN else torch.zeros_like(x)", prelude),
                          hidden=False, user=_sandbox_user())
    assert report.score == 0 and "stole 0 files" in report.results["tests"][0]["output"], report.results["output"]


def test_the_grader_cannot_be_killed_or_outlived(tmp_path, sandbox_tmp, drop_box):
    """Attack 4, second half: kill the grader after planting a result, kill everything in
    sight, and leave a writer behind. As the sandbox user, none of it reaches the grader."""
    ex = private_exercise("memory-axpb", tmp_path)
    marker = f"labkit-kill-{os.getpid()}-{time.monotonic_ns()}"
    body = f"""
import os, signal, subprocess
subprocess.Popen(["/bin/sh", "-c", "(sleep 3; echo forged > {drop_box}/forged) & : {marker}"],
                 start_new_session=True, env={{}})
for pid in (os.getppid(), -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as e:
        print("kill", pid, type(e).__name__)
return torch.zeros_like(x)
"""
    report = runner.grade(ex, with_axpb(body), hidden=False, user=_sandbox_user())
    assert report.score == 0 and "kill" in report.results["tests"][0]["output"]
    assert not processes_with(marker)
    time.sleep(4)
    assert not (drop_box / "forged").exists()


def test_hangs_cost_seconds_and_leave_nothing(sandbox_tmp):
    """Attack 10: an endless loop at import is paid once (not once per test), one in the
    graded function at most once per test, and the whole run stops at its budget. The
    bounds asserted are the design's (a start, plus the timeouts), far from the old costs
    of one start timeout per test (8 x 180 s)."""
    marker = f"labkit-hang-{os.getpid()}-{time.monotonic_ns()}"
    leave_behind = (f"def _leave_behind():\n    import subprocess\n    subprocess.Popen(['/bin/sh', '-c', "
                    f"'sleep 300; : {marker}'], start_new_session=True, env={{}})\n")
    limits = Limits(call_timeout_s=3, cpu_s=60, total_s=12)
    ex = dataclasses.replace(EX, limits=limits)
    start = time.monotonic()
    at_import = runner.grade(ex, SOLUTION + leave_behind + "_leave_behind()\nwhile True:\n    pass\n")  # 8 tests
    assert time.monotonic() - start < limits.start_timeout_s + limits.call_timeout_s
    assert at_import.score == 0 and at_import.starts == 1
    assert all("longer than 3 s while loading" in t["output"] for t in at_import.results["tests"]
               if t.get("status") == "failed")
    assert not processes_with(marker)
    start = time.monotonic()
    in_call = runner.grade(ex, leave_behind + with_axpb("_leave_behind()\nwhile True: pass"))
    assert time.monotonic() - start < limits.total_s + limits.start_timeout_s + limits.call_timeout_s
    assert in_call.score == 0 and any("time budget" in t["output"] for t in in_call.results["tests"])
    assert not processes_with(marker)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_grader_leaves_nothing(how, tmp_path):
    """Attack 10, last part: the grader itself killed mid-run (a timeout, Ctrl-C)."""
    marker = f"labkit-killed-{os.getpid()}-{time.monotonic_ns()}"
    sub, out, tmp = tmp_path / "submission.py", tmp_path / "results.json", tmp_path / "tmp"
    tmp.mkdir()
    sub.write_text(with_axpb(f"import subprocess\nsubprocess.Popen(['/bin/sh', '-c', 'sleep 300; : {marker}'], "
                             "start_new_session=True, env={})\nwhile True: pass"))
    grader = subprocess.Popen([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb", str(sub), "--out",
                               str(out), "--trust-submission"], env={**os.environ, "TMPDIR": str(tmp)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker), "the submission never started"
    parents = supervisor._parents()
    servers = [pid for pid in processes_with("labkit.grade.forkserver") if parents.get(pid) == grader.pid]
    assert servers, "the grader started no fork server"
    grader.send_signal(how)
    grader.wait(timeout=60)
    deadline = time.monotonic() + 20
    while (processes_with(marker) or list(tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with(marker) and not list(tmp.iterdir())
    while set(servers) & set(processes_with("labkit.grade.forkserver")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(servers) & set(processes_with("labkit.grade.forkserver")), "the fork server outlived the grader"
    if how == signal.SIGTERM:
        written = json.loads(out.read_text())
        assert written["score"] == 0 and "SIGTERM" in written["output"]


def test_local_mode_refuses_untrusted_code_by_default(tmp_path):
    """Attacks 4 and 5 cannot be stopped when the submission runs as the grader's own user:
    the command line says so and grades only with --trust-submission."""
    sub, out = tmp_path / "submission.py", tmp_path / "results.json"
    sub.write_text(SOLUTION)
    done = subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb", str(sub), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "refusing to grade without isolation" in done.stderr
    assert json.loads(out.read_text())["score"] == 0


def test_results_go_only_where_the_sandbox_user_cannot_write(tmp_path):
    _sandbox_user()
    sub, shared = tmp_path / "submission.py", Path(tempfile.mkdtemp(prefix="labkit-shared-"))
    sub.write_text(SOLUTION)
    os.chmod(shared, 0o777)  # writable by all, and not sticky: anyone may replace anyone's file
    try:
        done = subprocess.run([sys.executable, "-m", "labkit.grade", "grade", "memory-axpb", str(sub), "--out",
                               str(shared / "results.json"), "--sandbox-user", SANDBOX_USER],
                              capture_output=True, text=True)
    finally:
        results = shared / "results.json"
        written = json.loads(results.read_text()) if results.exists() else None
        shutil.rmtree(shared)
    assert done.returncode == 2 and "could write" in done.stderr and written["score"] == 0


SOFTMAX_EX = exercise.load("softmax-rows")
SOFTMAX = notebook.submission_source(notebook.read(SOFTMAX_EX.notebook))


def test_kernel_exercises_grade_kernels(sandbox_tmp):
    """Attacks 7 and 9: torch in place of the kernel (plainly, behind a dummy launch, or
    reached by a computed name) earns nothing; a correct kernel under any name is fine."""
    source = SOFTMAX + '''
softmax_rows = softmax

def torch_softmax(x):
    return torch.softmax(x, -1)

def exp_behind_a_launch(x):
    softmax(x)  # a launch, for show
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)

def computed_name(x):
    return getattr(torch, "soft" + "max")(x, -1)
'''
    rules = Rules(kernels=("softmax_rows", "torch_softmax", "exp_behind_a_launch", "computed_name"),
                  forbidden=SOFTMAX_EX.forbidden)
    x = labkit.check.randn(5, 37, seed=3)
    with Sandbox(source, FAST_LIMITS, watch={"forbidden": list(SOFTMAX_EX.forbidden)}) as box:
        submission = SandboxSubmission(box, rules)
        submission.expect_close(submission.call("softmax_rows", x), torch.softmax(x.double(), -1), dtype=torch.float32)
        with pytest.raises(SubmissionFailed, match=r"launched no Triton kernel") as e:
            submission.call("torch_softmax", x)
        assert "aten._softmax" in str(e.value)
        with pytest.raises(SubmissionFailed, match=r"aten\.exp"):
            submission.call("exp_behind_a_launch", x)
        with pytest.raises(SubmissionFailed, match=r"aten\._softmax"):
            submission.call("computed_name", x)


def test_the_solution_under_another_name_scores_full_marks():
    """Attack 9: the old name check failed a correct kernel whose wrapper was named softmax."""
    ex = dataclasses.replace(SOFTMAX_EX, limits=FAST_LIMITS)
    report = runner.grade(ex, SOFTMAX + "\nsoftmax_rows = softmax\n", hidden=False)
    assert report.score == report.max_score, report.results["output"]


def test_unmasked_stores_into_the_submissions_own_buffers_fail(sandbox_tmp):
    """Attack 6: an unmasked kernel whose output allocation is padded, so that the stores
    past the end land in its own padding; and the same kernel on an exact allocation."""
    source = SOLUTION + '''
@triton.jit
def unmasked_kernel(x_ptr, y_ptr, a, b, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + offsets, a * x + b)

def padded(x, a, b):
    buffer = torch.empty(x.numel() + 4096, dtype=x.dtype)
    unmasked_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, buffer, a, b, x.numel(), BLOCK=BLOCK)
    return buffer[:x.numel()]

def exact(x, a, b):
    out = torch.empty_like(x)
    unmasked_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, a, b, x.numel(), BLOCK=BLOCK)
    return out
'''
    x = labkit.check.randn(1000, seed=1)
    with Sandbox(source, FAST_LIMITS) as box:
        submission = SandboxSubmission(box)
        submission.expect_close(submission.call("axpb", x, 2.0, 1.0), 2.0 * x.double() + 1.0, dtype=torch.float32)
        with pytest.raises(SubmissionFailed, match="does not cover"):
            submission.call("padded", x, 2.0, 1.0)
        with pytest.raises(SubmissionFailed, match="outside a tensor it allocated"):
            submission.call("exact", x, 2.0, 1.0)


def test_hidden_tests_vary_values_at_repeated_shapes():
    """Attack 8: answers memoised by shape (the first call computed, later ones replayed)
    are wrong wherever a hidden test meets a shape again."""
    memo = with_axpb("key = (tuple(x.shape), x.dtype)\ncache = globals().setdefault('_memo', {})\n"
                     "if key in cache:\n    print('HIT')\n    return cache[key].clone()\n"
                     "cache[key] = solved(x, a, b)\nreturn cache[key].clone()")
    tests = by_name(runner.grade(FAST, memo))
    hits = [name for name, t in tests.items() if "HIT" in t["output"]]
    assert hits, "no hidden test repeats a shape: this check checks nothing"
    assert all(tests[name]["status"] == "failed" for name in hits), {n: tests[n]["status"] for n in hits}


@pytest.mark.parametrize("ex_id", ["grpo-loss", "moe-dispatch-combine", "kvcache-decode"])
def test_public_tests_ship_no_reference(ex_id):
    """Attack 7, second half: grpo-loss's public tests defined its float64 reference, a
    solution to paste; so did the other plain-torch exercises'. Now they hold stored values."""
    for path in exercise.load(ex_id).test_files(hidden=False):
        tree = ast.parse(path.read_text())
        references = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                      and (n.name.startswith("expected_") or n.name in {"recompute", "keys_and_values", "rope"})]
        assert not references, f"{path.name} defines {references}"


def test_speed_cannot_be_forged_from_inside_the_sandbox(sandbox_tmp):
    """Attack 11: a hook in the worker that slows the requests the grader used to subtract,
    or answers checksums without the outputs behind them."""
    sets = [[Randn((3000,), seed=s), 2.0, 1.0] for s in range(2)]

    def reference(x, a, b):
        return a * x + b

    slow = SOLUTION + '''
import gc, time
def stall(x, a, b):
    if not globals().get("_done"):
        handlers = next(o for o in gc.get_objects()
                        if isinstance(o, dict) and set(o) == {"call", "prepare", "timed", "outputs"})
        honest_timed, honest_outputs = handlers["timed"], handlers["outputs"]
        def timed(msg):  # slow on everything but the timed calls' own work
            time.sleep(0.5)
            return honest_timed(msg)
        def outputs(msg):
            time.sleep(0.5)
            return honest_outputs(msg)
        handlers["timed"], handlers["outputs"] = timed, outputs
        globals()["_done"] = True
    return axpb(x, a, b)
'''
    with Sandbox(slow, FAST_LIMITS) as box:
        submission = SandboxSubmission(box)
        submission.call("stall", labkit.check.randn(10, seed=0), 2.0, 1.0)
        result = submission.measure("stall", reference, sets, bytes_moved=8 * 3000, rounds=2)
    # the sleep inside the timed request is counted, none subtracted: at least 0.5 s over 4 calls
    assert 8 * 3000 / (result.tbps * 1e12) >= 0.5 / 4
    made_up = SOLUTION + '''
import gc
def fake(x, a, b):
    if not globals().get("_done"):
        handlers = next(o for o in gc.get_objects()
                        if isinstance(o, dict) and set(o) == {"call", "prepare", "timed", "outputs"})
        handlers["outputs"] = lambda msg: {"ok": True, "call": 3, "output": torch.zeros(3000)}
        globals()["_done"] = True
    return axpb(x, a, b)
'''
    with Sandbox(made_up, FAST_LIMITS) as box, pytest.raises(AssertionError, match="output of timed call"):
        submission = SandboxSubmission(box)
        submission.call("fake", labkit.check.randn(10, seed=0), 2.0, 1.0)
        submission.measure("fake", reference, sets, bytes_moved=8 * 3000, rounds=2)


def test_any_legal_tensor_crosses_the_wire(sandbox_tmp):
    """Attack 12: a size-1 output with stride 3 (``.contiguous()`` keeps it) crashed the
    worker; so could other legal layouts."""
    source = '''
import torch
def layouts(x):
    return [torch.empty(3).as_strided((1,), (3,)).fill_(7.0), x.t(), x[:, ::2], x.expand(2, 3, 4),
            x[0, 0], torch.empty(0, 3), x.unsqueeze(1).as_strided((3, 1, 4), (4, 99, 1)), (x > 0)[:, 1:]]
'''
    x = torch.arange(12.0).reshape(3, 4)
    with Sandbox(source, FAST_LIMITS) as box:
        got = SandboxSubmission(box).call("layouts", x)
    want = [torch.tensor([7.0]), x.t(), x[:, ::2], x.expand(2, 3, 4), x[0, 0], torch.empty(0, 3), x.unsqueeze(1),
            (x > 0)[:, 1:]]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


FAMILY = """
import os, torch
def family():
    stat = open(f"/proc/{os.getppid()}/stat", "rb").read()
    return torch.tensor([os.getpid(), os.getppid(), int(stat[stat.rindex(b")") + 2:].split()[1])])
"""


def test_local_gradings_fork_their_workers_from_one_server(sandbox_tmp):
    """In local mode on the CPU a worker is a fork of a server that imported torch once: its
    grandparent, the same for every sandbox of this grader; the supervisor between them is
    forked for each sandbox."""
    pids = []
    for _ in range(2):
        with Sandbox(FAMILY, FAST_LIMITS) as box:
            pids.append(SandboxSubmission(box).call("family").tolist())
            assert box.forked
    (worker1, supervisor1, server1), (worker2, supervisor2, server2) = pids
    assert server1 == server2 and len({worker1, worker2, supervisor1, supervisor2, server1}) == 5
    assert server1 in {s.proc.pid for s in forkserver._servers.values() if s}


def test_without_the_fork_server_workers_are_exec_d(sandbox_tmp, monkeypatch):
    """With the server turned off, the supervisor is exec'd by the grader itself."""
    monkeypatch.setattr(sandbox, "FORK_SERVER", False)
    with Sandbox(FAMILY, FAST_LIMITS) as box:
        worker, supervisor, grader = SandboxSubmission(box).call("family").tolist()
        assert not box.forked and grader == os.getpid()


@pytest.mark.parametrize("action, feedback", [
    ("import ctypes; ctypes.string_at(0)", ["segmentation fault"]),
    ("import json, os, sys; os.write(json.loads(sys.argv[1])['fd_out'], b'\\xff' * 16)",
     ["unreadable reply"]),
    ("import sys; sys.exit(0)", ["SystemExit"]),
], ids=["segfault", "garbage-on-the-pipe", "sys-exit"])
def test_exec_d_workers_fail_only_their_own_test_too(action, feedback, monkeypatch):
    """A few of the misbehaviours above, with the workers exec'd as in sandbox-user mode."""
    monkeypatch.setattr(sandbox, "FORK_SERVER", False)
    only_tail_fails(with_axpb(ON_TAIL.format(action)), *feedback)


def test_a_killed_fork_server_is_replaced():
    """A local-mode submission can kill the server its worker was forked from: its own
    grading goes on, and the next one starts a new server."""
    body = ("import os, signal\nstat = open(f'/proc/{os.getppid()}/stat', 'rb').read()\n"
            "os.kill(int(stat[stat.rindex(b')') + 2:].split()[1]), signal.SIGKILL)\nreturn solved(x, a, b, out)")

    def live_servers():
        return {s.proc.pid for s in forkserver._servers.values() if s and s.proc.poll() is None}

    outcomes(SOLUTION)  # this grader's server is running
    before = live_servers()
    first = outcomes(with_axpb(body))
    assert first["_score"] == EX.points[WHOLE] + EX.points[TAIL]
    assert len(before - live_servers()) == 1, "the submission did not kill its server"
    second = outcomes(SOLUTION)
    assert second["_score"] == EX.points[WHOLE] + EX.points[TAIL]
    assert len(live_servers() - before) == 1, "no new server was started"


def test_a_lost_fork_answer_costs_one_exec_and_a_new_server(monkeypatch, sandbox_tmp):
    """The server forked a supervisor but its answer was lost (the server died, or was too
    slow). That supervisor's worker may already have written to the sandbox's pipes, so the
    grader stops it and starts this worker again on new pipes, exec'd; the next sandbox gets
    a new server."""
    receive, lost = forkserver._receive, []

    def lose_the_first_answer(sock, max_fds=5):
        answer = receive(sock, max_fds)
        if max_fds == 1 and not lost:  # the grader's side: the server's answer to a fork
            lost.append(answer[0]["pid"])
            raise EOFError
        return answer

    monkeypatch.setattr(forkserver, "_receive", lose_the_first_answer)
    with Sandbox(FAMILY, FAST_LIMITS) as box:
        worker, supervisor, grader = SandboxSubmission(box).call("family").tolist()
        assert lost and not box.forked and grader == os.getpid()
    deadline = time.monotonic() + 20
    while Path(f"/proc/{lost[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{lost[0]}").exists(), "the supervisor whose answer was lost is still running"
    with Sandbox(FAMILY, FAST_LIMITS) as box:
        worker, supervisor, server = SandboxSubmission(box).call("family").tolist()
        assert box.forked and server in {s.proc.pid for s in forkserver._servers.values() if s}


def test_tampering_is_flagged_for_the_staff():
    """What the sandbox cannot stop (code rewriting its own worker) is shown to the staff,
    in an entry students do not see, worth nothing either way."""
    plain = runner.grade(FAST, SOLUTION, hidden=False).results["tests"]
    assert not any(t["name"].startswith("staff review") for t in plain)
    flagged = runner.grade(FAST, SOLUTION + "\nimport gc\n_w = gc.get_objects\n", hidden=False).results
    review = [t for t in flagged["tests"] if t["name"].startswith("staff review")]
    assert len(review) == 1 and review[0]["visibility"] == "hidden" and review[0]["max_score"] == 0
    assert flagged["score"] == EX.points[WHOLE] + EX.points[TAIL]


def test_tracing_modes_answer_from_torch_itself():
    from labkit.grade import tracing

    @torch.library.custom_op("gradetest::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @double.register_fake
    def _(x):
        return torch.empty_like(x)

    double.register_autograd(lambda ctx, g: g * 2, setup_context=lambda ctx, inputs, output: None)
    x = torch.randn(3, 4)
    assert set(tracing.through(double, "opcheck")(x).values()) == {"SUCCESS"}
    assert tracing.through(double, "fake")(x) == [[[3, 4], "float32", [4, 1], True]]
    [dx] = tracing.through(double, "grad")(x, torch.ones(3, 4))
    assert torch.equal(dx, torch.full((3, 4), 2.0))

    @torch.library.custom_op("gradetest::bad_fake", mutates_args=())
    def bad_fake(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @bad_fake.register_fake
    def _(x):
        return torch.empty_like(x, dtype=torch.float64)

    assert tracing.through(bad_fake, "opcheck")(x)["test_faketensor"] != "SUCCESS"
    with pytest.raises(TypeError, match="output's gradient"):
        tracing.through(double, "grad")(x)
