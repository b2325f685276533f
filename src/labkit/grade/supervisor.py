"""The trusted process between the grader and a submission's worker: it starts the worker,
adopts everything the worker leaves behind, and ends all of it.

The grader starts this file with ``python -I -S`` (standard library only, nothing from the
sandbox) and talks to it over its stdin (commands) and stdout (events, one JSON object a
line). It makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``), so a process the
submission detaches, with ``setsid``, a double fork and a clean environment, is still its
descendant. When the grader sends ``stop``, or dies (its stdin closes), the supervisor
kills every descendant and, when the worker runs as a sandbox user, every process of that
user (``kill(-1)`` from a process of that user, which reaches exactly those), then checks
in ``/proc`` that none is left, says so and exits. When the grader died it also removes the
sandbox folder and what the sandbox user left in ``/tmp``, ``/var/tmp`` and ``/dev/shm``.
As root (the sandbox-user mode) it cannot be signalled by the submission.

The worker is normally a fresh interpreter (``argv``, exec'd). In local mode the grader's
:mod:`~labkit.grade.forkserver` runs this same code in a process forked from an interpreter
that has already imported torch, and passes ``start_worker``: the worker is then a fork of
that process rather than an exec, and everything else here is unchanged.

Events: ``{"worker": pid}`` once started, ``{"exit": status}`` when the worker ends by
itself (negative: the signal), ``{"stopped": true|false}`` last (false: something survived).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

PR_SET_CHILD_SUBREAPER = 36
KILL_DEADLINE_S = 10.0


def _emit(event: dict) -> None:
    try:
        os.write(1, (json.dumps(event) + "\n").encode())
    except OSError:  # the grader is gone; the cleanup goes on regardless
        pass


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process in /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                # the command name, field 2, is in parentheses and may hold spaces
                found[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return found


def uid_processes(uid: int) -> list[int]:
    """Processes whose real, effective or saved uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                line = next(ln for ln in f if ln.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid in {int(v) for v in line.split()[1:4]}:
            found.append(int(name))
    return found


def _descendants(root: int) -> list[int]:
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _kill_as(uid: int, gid: int) -> None:
    """``kill(-1, SIGKILL)`` from a process of ``uid``: every process of that user, at once."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _reap() -> list[tuple[int, int]]:
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, status))


SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")


def remove_files_of(uid: int) -> None:
    """Remove what ``uid`` left in the folders every user may write to (call it once none of
    that user's processes is left: then nothing can race the removal)."""
    for folder in SHARED_FOLDERS:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
                if st.st_uid != uid:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)  # fd-based: follows no symlink
                else:
                    os.unlink(path)
            except OSError:
                continue


def kill_everything(uid: int | None, gid: int | None) -> bool:
    """Kill all descendants (and all processes of ``uid``); True once none is left."""
    me = os.getpid()
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        for pid in _descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if uid is not None:
            _kill_as(uid, gid)
        time.sleep(0.02)
        _reap()
        left = _descendants(me) + (uid_processes(uid) if uid is not None else [])
        if not left:
            return True
    return False


def supervise(config: dict, start_worker: Callable[[], NoReturn] | None = None) -> int:
    """Start the worker, report on it, end everything on ``stop``; the exit status to use.
    ``start_worker`` runs in the worker's process once it is set up (fds, user, folder) and
    never returns; without it the worker is ``config["argv"]``, exec'd with ``config["env"]``."""
    uid, gid = config.get("uid"), config.get("gid")
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    log_fd = config["log_fd"]
    pid = os.fork()
    if pid == 0:  # the worker: its own session, the sandbox user, the log as stdout and stderr
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)  # not the supervisor's stdin: the grader's commands
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.chdir(config["cwd"])
            if uid is not None:
                import resource

                # a fork bomb stops at this many processes (threads count too) of the user
                resource.setrlimit(resource.RLIMIT_NPROC, (config["nproc"], config["nproc"]))
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
            keep = {0, 1, 2, *config["pass_fds"]}
            for fd in os.listdir("/proc/self/fd"):
                if int(fd) not in keep:
                    try:
                        os.close(int(fd))
                    except OSError:
                        pass
            for fd in config["pass_fds"]:
                os.set_inheritable(fd, True)
            if start_worker is not None:
                start_worker()
            os.execve(config["argv"][0], config["argv"], config["env"])
        except BaseException as e:  # noqa: BLE001  (said on the worker's log, which the grader shows)
            os.write(2, f"the sandbox could not start the worker: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(127)
    for fd in [log_fd, *config["pass_fds"]]:
        os.close(fd)
    _emit({"worker": pid, "subreaper": subreaper})
    worker_running, told_to_stop = True, False
    while True:
        import select

        ready = select.select([0], [], [], 0.2)[0]
        if ready:
            line = os.read(0, 4096)
            told_to_stop = line.startswith(b"stop")
            break
        for ended, status in _reap():
            if ended == pid and worker_running:
                worker_running = False
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _emit({"exit": code})
    clean = kill_everything(uid, gid)
    if not told_to_stop:  # the grader died: nobody else will clean up
        if config.get("root"):
            shutil.rmtree(config["root"], ignore_errors=True)
        if uid is not None and clean:
            remove_files_of(uid)
    _emit({"stopped": clean})
    return 0 if clean else 3


if __name__ == "__main__":
    sys.exit(supervise(json.loads(sys.argv[1])))
