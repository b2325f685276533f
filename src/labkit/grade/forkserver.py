"""Local-mode gradings without paying for torch's import each time: a fork server.

A sandbox's worker is a fresh interpreter, and on the CPU most of a short grading is its
start: importing torch, triton and the tracing module (Dynamo, fake tensors) takes about
5 s of a grading's 8-10 s. In local mode (no sandbox user, CPU: the book's own self-test,
a student grading their own notebook) the grader instead keeps one *fork server* per
environment: an interpreter started exactly as a worker is (``python -I -S -u``, the
worker's environment and ``sys.path``) that runs :func:`labkit.grade.worker.preload` once
and then, for each sandbox, forks a process that becomes the sandbox's supervisor. The
supervisor's worker is in turn a fork of that, so it starts with every trusted import done
and goes straight to loading the submission. What the grader sees is the same protocol,
the same limits (applied in the worker, whose CPU time starts at zero) and the same
cleanup: the forked supervisor is a subreaper with the grader's command pipe as its stdin,
exactly as an exec'd one.

The fork server is never used with a sandbox user or a GPU. There, every process of the
sandbox user dies between gradings, and a long-lived parent would be a process a
submission could reach; and a CUDA context does not survive a fork. In local mode the
submission already runs with the grader's own rights, so a server it could tamper with
gives it nothing it did not have. The server holds no file: it imports labkit's core from
where the grader's own labkit lives, and ends when the grader's end of its socket closes,
when the grader exits or dies.

Protocol, over a Unix socket pair: the server sends ``R`` once ready. Each request is a
length-prefixed JSON object (``supervision``: the supervisor's configuration; ``worker``:
the worker's) with five descriptors attached: the supervisor's command pipe and event pipe,
the worker's log, request and reply pipes. The answer is the supervisor's pid, with a pidfd
for it attached (none if it is already gone).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

_HEADER = struct.Struct("!I")
_BOOT = ("import sys, json; c = json.loads(sys.argv[1]); sys.path[:0] = c['path']; "
         "from labkit.grade.forkserver import main; del sys, json, c; main()")
# Set per sandbox (its own folder): they change no import, so one server serves every sandbox.
PER_SANDBOX = ("HOME", "TMPDIR", "TRITON_CACHE_DIR")


# -- the server: in the -I -S interpreter -------------------------------------------------
def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    frame = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds))  # the descriptors travel with the first byte
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _receive(sock: socket.socket, max_fds: int = 5) -> tuple[dict, list[int]]:
    """One message and the descriptors sent with it; EOFError once the peer has closed."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    if not data:
        raise EOFError
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        more = sock.recv(1 << 16)
        if not more:
            raise EOFError
        data += more
    return json.loads(data[_HEADER.size:]), fds


def _fresh_entropy() -> None:
    """Reseed the generators seeded when the server imported them, as a fresh interpreter
    would have (torch's default generator has a fixed seed in both, so it is left alone)."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _become_supervisor(request: dict, fds: list[int], finder) -> None:
    """In the forked child: take the pipes as stdin, stdout and the worker's, and supervise a
    worker that is this process forked once more."""
    from labkit.grade import supervisor, worker

    commands, events, log, fd_in, fd_out = fds
    os.dup2(commands, 0)
    os.dup2(events, 1)
    os.close(commands)
    os.close(events)
    supervision = {**request["supervision"], "log_fd": log, "pass_fds": [fd_in, fd_out]}
    config = {**request["worker"], "fd_in": fd_in, "fd_out": fd_out}

    def start_worker():
        import tempfile
        import traceback

        code = 1
        try:
            os.environ.clear()
            os.environ.update(supervision["env"])
            tempfile.tempdir = None  # found again from TMPDIR, the sandbox's own folder
            _fresh_entropy()
            sys.argv = ["-c", json.dumps(config)]  # what an exec'd worker is given
            worker._apply_limits(config)
            worker.serve(config, finder)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001  (the log is the worker's stderr: the grader shows it)
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)

    os._exit(supervisor.supervise(supervision, start_worker))


def main() -> None:
    from labkit.grade import worker

    config = json.loads(sys.argv[1])
    finder = worker.preload()
    import labkit.grade.supervisor  # noqa: F401  (stdlib only; imported once, here)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the supervisors that end
    sock = socket.socket(fileno=config["fd"])
    sock.sendall(b"R")
    while True:
        try:
            request, fds = _receive(sock)
        except (EOFError, ConnectionError):
            return
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _become_supervisor(request, fds, finder)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = [os.pidfd_open(pid)]
        except ProcessLookupError:  # it ended already: the grader hears so from its pipes
            pidfd = []
        try:
            _send(sock, {"pid": pid}, pidfd)
        except OSError:
            return
        finally:
            for fd in pidfd:
                os.close(fd)


# -- the grader's side --------------------------------------------------------------------
class LostFork(OSError):
    """The server took a request but its answer never came: it may have forked a worker that
    holds the request's pipes and has already written to them. The caller must start again
    with new pipes (the supervisor, if there is one, has been told to stop)."""


class Forked:
    """A forked supervisor, seen as the grader sees an exec'd one (a ``Popen``'s ``stdin``,
    ``stdout``, ``wait`` and ``kill``)."""

    def __init__(self, pid: int, pidfd: int | None, commands: int, events: int):
        self.pid, self._pidfd = pid, pidfd
        self.stdin = open(commands, "wb", buffering=0)
        self.stdout = open(events, "rb", buffering=0)
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        import select

        if self._pidfd is not None and not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("supervisor", timeout)
        self._close_pidfd()
        self.returncode = 0  # the server reaps it; its status is in the events it sent
        return 0

    def kill(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        self._close_pidfd()


class Server:
    """One fork server process and the grader's end of its socket."""

    def __init__(self, env: dict, path: list[str], timeout: float):
        ours, theirs = socket.socketpair()
        self.sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-u", "-c", _BOOT, json.dumps({"path": path, "fd": theirs.fileno()})],
            env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd="/", start_new_session=True,
        )
        theirs.close()
        ours.settimeout(timeout)
        try:
            ready = ours.recv(1)
        except OSError:
            ready = b""
        if ready != b"R":
            self.close()
            raise OSError("the fork server did not start")

    def send(self, request: dict, fds: list[int], timeout: float) -> None:
        self.sock.settimeout(timeout)
        _send(self.sock, request, fds)

    def answer(self, timeout: float) -> tuple[int, int | None]:
        """The forked supervisor's pid, and a pidfd for it (None if it has ended already)."""
        self.sock.settimeout(timeout)
        reply, pidfd = _receive(self.sock, max_fds=1)
        return int(reply["pid"]), (pidfd[0] if pidfd else None)

    def close(self) -> None:
        self.sock.close()  # the server's loop ends at EOF
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_servers: dict[tuple, Server | None] = {}  # None: it failed to start; this grader does without
_lock = threading.Lock()


def _server(env: dict, path: list[str], timeout: float) -> Server | None:
    key = (tuple(sorted((k, v) for k, v in env.items() if k not in PER_SANDBOX)), tuple(path))
    if key not in _servers:
        try:
            _servers[key] = Server({k: v for k, v in env.items() if k not in PER_SANDBOX}, path, timeout)
        except OSError:
            _servers[key] = None
    return _servers[key]


def _drop(server: Server) -> None:
    for key, known in list(_servers.items()):
        if known is server:
            del _servers[key]
    server.close()


def launch(supervision: dict, worker: dict, site_path: list[str], timeout: float) -> Forked | None:
    """A supervisor forked from the server for this environment, running ``worker``; None
    where no server can run (the caller then execs one). ``supervision`` is what the exec'd
    supervisor would get, less ``argv``; its ``log_fd`` and ``pass_fds`` (the worker's
    request and reply pipes) travel to the server, and the caller closes its copies.
    Raises :class:`LostFork` when those pipes may have reached a worker that was then lost."""
    core = str(Path(__file__).resolve().parents[2])  # where labkit's own package lives
    path = [core, *site_path]
    request = {"supervision": {k: v for k, v in supervision.items() if k not in ("log_fd", "pass_fds")},
               "worker": {k: v for k, v in worker.items() if k not in ("fd_in", "fd_out", "path")}}
    with _lock:
        for _attempt in range(2):  # a server the last submission killed is replaced once
            server = _server(supervision["env"], path, timeout)
            if server is None:
                return None
            commands_r, commands_w = os.pipe()
            events_r, events_w = os.pipe()
            try:
                server.send(request, [commands_r, events_w, supervision["log_fd"], *supervision["pass_fds"]],
                            timeout)
            except OSError:  # the server was gone before it could read anything: try a new one
                for fd in (commands_r, commands_w, events_r, events_w):
                    os.close(fd)
                _drop(server)
                continue
            os.close(commands_r)
            os.close(events_w)
            try:
                pid, pidfd = server.answer(timeout)
            except (OSError, EOFError, ValueError, KeyError, TypeError):
                # Told to stop (not merely left without a grader), a supervisor forked for this
                # request ends its worker and keeps the sandbox's folder, which the caller needs.
                try:
                    os.write(commands_w, b"stop\n")
                except OSError:  # nobody reads the pipe: no supervisor was forked
                    pass
                for fd in (commands_w, events_r):
                    os.close(fd)
                _drop(server)
                raise LostFork("the fork server's answer was lost") from None
            return Forked(pid, pidfd, commands_w, events_r)
        return None


@atexit.register
def _close_all() -> None:
    for server in list(filter(None, _servers.values())):
        server.close()
    _servers.clear()
