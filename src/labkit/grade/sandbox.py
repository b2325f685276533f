"""The grader's side of the sandbox: start, feed, time out and kill a submission's process.

One :class:`Sandbox` serves one submission for a whole grading run: tests share its
process (each process start imports torch and triton, seconds under the interpreter),
and when a call crashes or hangs the process is killed and the next call starts a fresh
one. A crash therefore fails only the test whose call caused it.

The process is ``python -I -S`` (no site hooks, no environment paths, no editable
installs) in its own session, its own temporary directory and a clean environment, with
limits on CPU time, address space (CPU mode) and file size; when the grader runs as root
and a sandbox user is named, the process drops to that user before loading the
submission. Its stdout and stderr go to a log the grader reads back only as text.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import wire

LABKIT_ROOT = Path(__file__).resolve().parents[1]
# labkit's core as the sandbox sees it: enough to import labkit, check results and serve
# requests, and none of the topic packages that hold the book's solutions.
SANDBOX_FILES = (
    "__init__.py", "backend.py", "compile_check.py", "check.py", "validate.py",
    "grade/wire.py", "grade/guard.py", "grade/worker.py", "grade/perf_inputs.py",
)
_BOOT = ("import sys, json; c = json.loads(sys.argv[1]); sys.path[:0] = c['path']; "
         "from labkit.grade.worker import main; main()")
TOKEN_VARIABLE = "LABKIT_SANDBOX_TOKEN"


@dataclass(frozen=True)
class Limits:
    call_timeout_s: float = 60.0
    cpu_s: int = 300
    memory_mb: int = 4096
    start_timeout_s: float = 180.0


class SubmissionFailed(AssertionError):
    """A call into the submission failed; the message is the student's feedback."""


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


def _sweep(token: str) -> None:
    """Kill any process left behind that carries this sandbox's token (a daemonized child)."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:  # no procfs: the process group kill is all there is
        return
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


class Sandbox:
    """A submission's source, and the process that runs it (started on first use)."""

    def __init__(self, source: str, limits: Limits | None = None, *, gpu: bool = False,
                 user: str | None = None, compile_check: bool = False):
        self.limits = limits or Limits()
        self.gpu, self.user, self.compile_check = gpu, user, compile_check
        self.token = os.urandom(12).hex()
        self.root = Path(tempfile.mkdtemp(prefix="labkit-sandbox-"))
        lib = self.root / "lib" / "labkit"
        for rel in SANDBOX_FILES:
            (lib / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(LABKIT_ROOT / rel, lib / rel)
        (lib / "grade" / "__init__.py").write_text('"""The sandbox\'s part of labkit.grade."""\n')
        self.submission = self.root / "submission.py"
        self.submission.write_text(source)
        self.work = self.root / "work"
        self.work.mkdir()
        self.log_path = self.root / "output.log"
        self.log_path.touch()
        if user and os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(user)
            for path in [self.root, *self.root.rglob("*")]:
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.proc: subprocess.Popen | None = None
        self.import_error: str | None = None
        self.starts = 0

    # -- process lifetime -------------------------------------------------------------
    def _start(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        config = {
            "path": [str(self.root / "lib"), *_site_dirs()],
            "submission": str(self.submission), "fd_in": req_r, "fd_out": rep_w,
            "cpu_s": self.limits.cpu_s, "memory_mb": None if self.gpu else self.limits.memory_mb,
            "gpu": self.gpu, "user": self.user,
        }
        env = {
            "PATH": "/usr/bin:/bin", "HOME": str(self.work), "TMPDIR": str(self.work),
            "LABKIT_MODE": "gpu" if self.gpu else "cpu", "TRITON_CACHE_DIR": str(self.work / ".triton"),
            "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
            TOKEN_VARIABLE: self.token,
        }
        if not self.gpu:
            env["TRITON_INTERPRET"] = "1"
            if self.compile_check:
                env["LABKIT_COMPILE_CHECK"] = "1"
        for name in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "CUDA_HOME"):
            if name in os.environ:
                env[name] = os.environ[name]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-u", "-c", _BOOT, json.dumps(config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(req_r, rep_w), cwd=self.work, env=env, start_new_session=True,
            )
        os.close(req_r)
        os.close(rep_w)
        self._to, self._from = req_w, rep_r
        self.starts += 1
        hello = self._receive(self.limits.start_timeout_s, "loading the submission")
        if not hello.get("ok"):
            self.import_error = str(hello.get("message", "unknown error"))
            self.stop()

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for fd in (self._to, self._from):
                os.close(fd)
            self.proc = None
        _sweep(self.token)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- talking to it ----------------------------------------------------------------
    def _died(self, while_doing: str) -> SubmissionFailed:
        proc = self.proc
        assert proc is not None
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.stop()
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            why = _SIGNALS.get(sig, f"signal {sig.name}")
            return SubmissionFailed(f"the submission's process died while {while_doing}, from {why}")
        return SubmissionFailed(
            f"the submission's process ended while {while_doing} (exit status {code}); "
            "something in it called os._exit, or closed the grader's pipe"
        )

    def _receive(self, timeout: float, while_doing: str) -> dict:
        try:
            return wire.receive(self._from, deadline=time.monotonic() + timeout)
        except TimeoutError:
            self.stop()
            raise SubmissionFailed(
                f"the submission took longer than {timeout:.0f} s while {while_doing} and was "
                "stopped (an infinite loop, or a grid far larger than the problem)"
            ) from None
        except (EOFError, OSError):
            raise self._died(while_doing) from None
        except wire.WireError as e:
            self.stop()
            raise SubmissionFailed(f"the submission's process sent an unreadable reply ({e})") from None

    def request(self, message: dict, *, timeout: float | None = None, what: str = "running") -> dict:
        """Send one request and return the reply; raise :class:`SubmissionFailed` if none comes."""
        if self.import_error is None and self.proc is None:
            self._start()
        if self.import_error is not None:
            raise SubmissionFailed(f"the submission could not be loaded:\n{self.import_error}")
        try:
            wire.send(self._to, message)
        except OSError:
            raise self._died(what) from None
        return self._receive(timeout or self.limits.call_timeout_s, what)

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def output_since(self, offset: int, limit: int = 4000) -> str:
        """What the submission printed since ``offset``, as text, truncated to ``limit``."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            data = f.read(limit + 1)
        text = data[:limit].decode("utf-8", errors="replace")
        return text + ("\n[... output truncated]" if len(data) > limit else "")
