"""The grader's side of the sandbox: start, feed, time out and end a submission's process.

One :class:`Sandbox` serves one submission for a whole grading run: tests share its
process (each process start imports torch and triton, seconds under the interpreter),
and when a call crashes or hangs the process is killed and the next call starts a fresh
one. A crash therefore fails only the test whose call caused it.

What the privileged side (this process) never does is trust a path the submission can
change. The sandbox folder (``/tmp/labkit-sandbox-*``) belongs to the grader; the
submission's user owns only ``work/`` inside it, its home and temporary folder. The
grader reads nothing back from the folder: the worker's stdout and stderr come through a
pipe it holds, and answers through another. The worker is ``python -I -S`` (no site hooks,
no environment paths) with a clean environment and limits on CPU time, address space (CPU
mode), file size and, for a sandbox user, processes. It is started by the trusted
:mod:`~labkit.grade.supervisor`, which adopts whatever the submission detaches and kills
all of it, every process of the sandbox user included, before :meth:`Sandbox.stop`
returns. So once :meth:`Sandbox.close` has returned, nothing of the submission is
running, its folder is gone, and so is anything the sandbox user left in ``/tmp``,
``/var/tmp`` or ``/dev/shm``.

In local mode on the CPU (no sandbox user: code the grader trusts), the supervisor and its
worker are not exec'd but forked from a :mod:`~labkit.grade.forkserver` that imported torch
and triton once for the whole grading session: the same protocol, limits and cleanup,
without paying the 5 s of imports on every grading. ``LABKIT_GRADE_FORK_SERVER=0`` turns it
off.

Every wait is bounded: starting the interpreter (``start_timeout_s``), loading the
submission and each call (``call_timeout_s``), and the whole run (``total_s``): past it,
no further request reaches the submission and the remaining tests fail at once. A load
that fails or times out is remembered: later tests report it without trying again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import forkserver, wire

LABKIT_ROOT = Path(__file__).resolve().parents[1]
# labkit's core as the sandbox sees it: enough to import labkit, check results and serve
# requests, and none of the topic packages that hold the book's solutions.
SANDBOX_FILES = (
    "__init__.py", "backend.py", "compile_check.py", "check.py", "validate.py",
    "grade/wire.py", "grade/guard.py", "grade/worker.py", "grade/perf_inputs.py", "grade/tracing.py",
)
_BOOT = ("import sys, json; c = json.loads(sys.argv[1]); sys.path[:0] = c['path']; "
         "from labkit.grade.worker import main; del sys, json, c; main()")
SUPERVISOR = Path(__file__).resolve().with_name("supervisor.py")
# Removes the sandbox folder once its stdin closes: when the grader closes the sandbox, or
# dies, even between two workers (the supervisor, which also removes it, lives per worker).
_JANITOR = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], ignore_errors=True)"
LOG_LIMIT = 1 << 20  # bytes of the submission's output kept for feedback
FORK_SERVER = os.environ.get("LABKIT_GRADE_FORK_SERVER", "1") != "0"  # local CPU mode only; see below


@dataclass(frozen=True)
class Limits:
    call_timeout_s: float = 30.0   # loading the submission, and each call into it
    cpu_s: int = 300               # CPU time of one sandbox process
    memory_mb: int = 4096          # address space of one sandbox process (CPU only)
    start_timeout_s: float = 120.0  # starting the interpreter and importing torch/triton (trusted)
    total_s: float = 480.0         # the whole grading run, from the sandbox's creation
    nproc: int = 512               # processes and threads of the sandbox user


class SubmissionFailed(AssertionError):
    """A call into the submission failed; the message is the student's feedback."""


class IsolationError(RuntimeError):
    """The sandbox cannot be set up as safely as asked (a missing user, a readable test)."""


_SIGNALS = {
    signal.SIGSEGV: "a segmentation fault: the code read or wrote memory it does not own "
                    "(often a load or store without a mask)",
    signal.SIGBUS: "a bus error: a misaligned or out-of-range memory access",
    signal.SIGABRT: "an abort (a failed assertion inside torch or triton)",
    signal.SIGKILL: "being killed (out of memory, or over the grader's limits)",
    signal.SIGXCPU: "running out of its CPU-time limit",
    signal.SIGFPE: "a floating-point exception",
}


def _site_dirs() -> list[str]:
    import numpy
    import torch
    import triton

    dirs = [str(Path(m.__file__).resolve().parents[1]) for m in (torch, triton, numpy)]
    return list(dict.fromkeys(dirs))


def sandbox_ids(user: str | None) -> tuple[int, int] | None:
    """(uid, gid) of the sandbox user, or None in local mode (no user, or not root)."""
    if not user:
        return None
    if os.geteuid() != 0:
        raise IsolationError(f"--sandbox-user {user} needs the grader to run as root")
    import pwd

    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise IsolationError(f"no user {user!r}: create it (useradd --system {user})") from None
    if entry.pw_uid == 0:
        raise IsolationError(f"the sandbox user {user!r} is root")
    return entry.pw_uid, entry.pw_gid


def check_runnable(ids: tuple[int, int]) -> None:
    """Refuse a sandbox user who could not run this Python, its standard library or torch."""
    needed = [Path(sys.executable).resolve(), Path(os.__file__).resolve(), *map(Path, _site_dirs())]
    hidden = [p for p in needed if not readable_by(p, *ids)]
    if hidden:
        raise IsolationError(f"the sandbox user cannot read {hidden[0]}: install Python and torch where "
                             "every user can read them (a virtual environment under a private home is not)")


def readable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether ``uid`` (group ``gid``, no other groups) can read ``path``, from mode bits."""
    path = Path(path).resolve()
    if not all(_mode_allows(d, uid, gid, 1) for d in reversed(path.parents)):
        return False
    return _mode_allows(path, uid, gid, 4)


def writable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether ``uid`` could create or replace files in folder ``path`` (or write file ``path``)."""
    path = Path(path).resolve()
    st = path.stat()
    if not all(_mode_allows(d, uid, gid, 1) for d in reversed(path.parents)):
        return False
    if path.is_dir():
        return _mode_allows(path, uid, gid, 2) and _mode_allows(path, uid, gid, 1) and not (
            st.st_mode & 0o1000 and st.st_uid != uid)  # sticky: others' files stay theirs
    return _mode_allows(path, uid, gid, 2)


def _mode_allows(p: Path, uid: int, gid: int, bit: int) -> bool:
    st = p.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid == gid:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


class Sandbox:
    """A submission's source, and the process that runs it (started on first use)."""

    def __init__(self, source: str, limits: Limits | None = None, *, gpu: bool = False,
                 user: str | None = None, compile_check: bool = False, watch: dict | None = None):
        self.limits = limits or Limits()
        self.gpu, self.user, self.compile_check = gpu, user, compile_check
        self.watch = watch or {}
        self.ids = sandbox_ids(user)
        # Local mode on the CPU forks its workers from an interpreter that imported torch once
        # (labkit.grade.forkserver); True while that is how this sandbox's worker started.
        self.forked = FORK_SERVER and not self.ids and not gpu
        if self.ids:
            check_runnable(self.ids)
        self.deadline = time.monotonic() + self.limits.total_s
        # The grader's folder: root-owned (or the grader's) and only traversable by others;
        # the submission's user owns work/ alone.
        self.root = Path(tempfile.mkdtemp(prefix="labkit-sandbox-"))
        os.chmod(self.root, 0o711)
        self._janitor = subprocess.Popen([sys.executable, "-I", "-S", "-c", _JANITOR, str(self.root)],
                                         stdin=subprocess.PIPE, start_new_session=True)
        lib = self.root / "lib" / "labkit"
        for rel in SANDBOX_FILES:
            (lib / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(LABKIT_ROOT / rel, lib / rel)
        (lib / "grade" / "__init__.py").write_text('"""The sandbox\'s part of labkit.grade."""\n')
        self.submission = self.root / "submission.py"
        self.submission.write_text(source)
        for path in [self.root / "lib", *(self.root / "lib").rglob("*"), self.submission]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        self.work = self.root / "work"
        self.work.mkdir(mode=0o700)
        if self.ids:
            os.chown(self.work, *self.ids)
        self.proc: subprocess.Popen | None = None
        self.import_error: str | None = None
        self.starts = 0
        self._log = bytearray()
        self._log_total = 0
        self._log_lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._events: list[dict] = []
        self._worker_exit: int | None = None
        self.leftovers = False

    # -- process lifetime -------------------------------------------------------------
    def _read_log(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                with self._log_lock:
                    keep = max(0, min(len(chunk), LOG_LIMIT - len(self._log)))
                    self._log += chunk[:keep]
                    self._log_total += len(chunk)

    def _start(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        log_r, log_w = os.pipe()
        config = {
            "path": [str(self.root / "lib"), *_site_dirs()],
            "submission": str(self.submission), "fd_in": req_r, "fd_out": rep_w,
            "cpu_s": self.limits.cpu_s, "memory_mb": None if self.gpu else self.limits.memory_mb,
            "gpu": self.gpu, "watch": self.watch,
        }
        env = {
            "PATH": "/usr/bin:/bin", "HOME": str(self.work), "TMPDIR": str(self.work),
            "LABKIT_MODE": "gpu" if self.gpu else "cpu", "TRITON_CACHE_DIR": str(self.work / ".triton"),
            "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
        }
        if not self.gpu:
            env["TRITON_INTERPRET"] = "1"
            if self.compile_check:
                env["LABKIT_COMPILE_CHECK"] = "1"
        for name in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "CUDA_HOME"):
            if name in os.environ:
                env[name] = os.environ[name]
        supervision = {
            "env": env, "cwd": str(self.work), "pass_fds": [req_r, rep_w], "log_fd": log_w,
            "uid": self.ids[0] if self.ids else None, "gid": self.ids[1] if self.ids else None,
            "nproc": self.limits.nproc, "root": str(self.root),
        }
        self.proc = None
        if self.forked:
            try:
                self.proc = forkserver.launch(supervision, config, _site_dirs(), self.limits.start_timeout_s)
            except forkserver.LostFork:  # a worker may have had these pipes: start over with new ones, exec'd
                for fd in (req_r, req_w, rep_r, rep_w, log_r, log_w):
                    os.close(fd)
                self.forked = False
                return self._start()
            self.forked = self.proc is not None  # no server could start: exec, as in the other modes
        if self.proc is None:
            supervision["argv"] = [sys.executable, "-I", "-S", "-u", "-c", _BOOT, json.dumps(config)]
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(SUPERVISOR), json.dumps(supervision)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                pass_fds=(req_r, rep_w, log_w), cwd=self.root, env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,
            )
        for fd in (req_r, rep_w, log_w):
            os.close(fd)
        self._to, self._from = req_w, rep_r
        self._worker_exit = None
        reader = threading.Thread(target=self._read_log, args=(log_r,), daemon=True)
        reader.start()
        self._readers.append(reader)
        self.starts += 1
        first = self._event(self.limits.start_timeout_s)
        if "worker" not in first:
            self.stop()
            raise SubmissionFailed(f"grader error, tell the course staff: the sandbox did not start ({first})")
        ready = self._receive(min(self.limits.start_timeout_s, self._left()), "starting Python and torch",
                              remember=True)
        if not ready.get("ok"):
            self._fail_load(str(ready.get("message", "unknown error")))
        hello = self._receive(min(self.limits.call_timeout_s, self._left()), "loading the submission",
                              remember=True)
        if not hello.get("ok"):
            self._fail_load(str(hello.get("message", "unknown error")))

    def _fail_load(self, message: str) -> None:
        self.import_error = message
        self.stop()
        raise SubmissionFailed(f"the submission could not be loaded:\n{message}")

    def _event(self, timeout: float) -> dict:
        """The supervisor's next event line (``{}`` if none came in time)."""
        import select

        if self.proc is None or self.proc.stdout is None:
            return {}
        if not select.select([self.proc.stdout], [], [], max(timeout, 0))[0]:
            return {}
        line = self.proc.stdout.readline()
        try:
            return json.loads(line) if line else {}
        except json.JSONDecodeError:
            return {}

    def stop(self) -> None:
        """End the worker and everything it started; wait until the supervisor says none is left."""
        if self.proc is None:
            return
        proc = self.proc
        try:
            proc.stdin.write(b"stop\n")
            proc.stdin.flush()
        except OSError:  # the supervisor is gone (local mode: the submission can kill it)
            pass
        stopped = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            event = self._event(deadline - time.monotonic())
            if not event:
                break
            if "exit" in event:
                self._worker_exit = event["exit"]
            if "stopped" in event:
                stopped = event["stopped"]
                break
        self.proc = None
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if stopped is not True:
            self.leftovers = True
        for fd in (self._to, self._from):
            os.close(fd)
        proc.stdin.close()
        proc.stdout.close()

    def close(self) -> None:
        self.stop()
        for reader in self._readers:  # all writers of the log pipes are dead: they end
            reader.join(timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.ids and not self.leftovers:  # no process of the user is left to race this
            from .supervisor import remove_files_of

            remove_files_of(self.ids[0])
        self._janitor.stdin.close()
        self._janitor.wait()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- talking to it ----------------------------------------------------------------
    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _died(self, while_doing: str) -> SubmissionFailed:
        deadline = time.monotonic() + 5
        while self._worker_exit is None and time.monotonic() < deadline:
            event = self._event(deadline - time.monotonic())
            if not event:
                break
            if "exit" in event:
                self._worker_exit = event["exit"]
        self.stop()
        code = self._worker_exit
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            why = _SIGNALS.get(sig, f"signal {sig.name}")
            return SubmissionFailed(f"the submission's process died while {while_doing}, from {why}")
        return SubmissionFailed(
            f"the submission's process ended while {while_doing} (exit status {code}); "
            "something in it called os._exit, or closed the grader's pipe"
        )

    def _receive(self, timeout: float, while_doing: str, *, remember: bool = False) -> dict:
        """The next reply; a timeout, death or garbage becomes :class:`SubmissionFailed`.
        With ``remember`` (loading), the failure is kept: later requests report it at once."""
        try:
            return wire.receive(self._from, deadline=time.monotonic() + timeout)
        except TimeoutError:
            self.stop()
            budget = " (the grading's time budget ran out)" if self._left() <= 0 else ""
            message = (f"the submission took longer than {timeout:.0f} s while {while_doing}{budget} and "
                       "was stopped (an infinite loop, or a grid far larger than the problem)")
        except (EOFError, OSError):
            failure = self._died(while_doing)
            if not remember:
                raise failure from None
            message = str(failure)
        except wire.WireError as e:
            self.stop()
            message = f"the submission's process sent an unreadable reply ({e})"
        if remember:
            self.import_error = message
            raise SubmissionFailed(f"the submission could not be loaded:\n{message}")
        raise SubmissionFailed(message)

    def request(self, message: dict, *, timeout: float | None = None, what: str = "running") -> dict:
        """Send one request and return the reply; raise :class:`SubmissionFailed` if none comes."""
        if self.import_error is not None:
            raise SubmissionFailed(f"the submission could not be loaded:\n{self.import_error}")
        if self._left() <= 0:
            raise SubmissionFailed(f"not run: the grading's time budget of {self.limits.total_s:.0f} s "
                                   "was used up by earlier calls")
        if self.proc is None:
            self._start()
        try:
            wire.send(self._to, message)
        except OSError:
            raise self._died(what) from None
        return self._receive(min(timeout or self.limits.call_timeout_s, max(self._left(), 0.1)), what)

    def log_size(self) -> int:
        with self._log_lock:
            return self._log_total

    def output_since(self, offset: int, limit: int = 4000) -> str:
        """What the submission printed since ``offset``, as text, truncated to ``limit``."""
        time.sleep(0.01)  # let the reader thread catch up with what was just printed
        with self._log_lock:
            data = bytes(self._log[offset:offset + limit + 1])
            dropped = self._log_total > len(self._log)
        text = data[:limit].decode("utf-8", errors="replace")
        if len(data) > limit or (dropped and offset + len(data) >= len(self._log)):
            text += "\n[... output truncated]"
        return text
