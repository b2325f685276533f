"""The sandboxed side of grading: load a submission and answer the grader's requests.

This module runs in a fresh interpreter started by :mod:`labkit.grade.sandbox` with
``python -I -S``, a ``sys.path`` holding only the standard library, the site directories
of torch/triton/numpy, and a copy of labkit's *core* (backend, check, validate and the
pieces of ``labkit.grade`` this file needs): the book's topic packages, which hold the
solutions, do not exist here. It lowers its own limits, drops root privileges when told
to, and only then imports the submission. Everything below that point is untrusted: the
grader decides every score from the bytes it receives, checked by :mod:`labkit.grade.wire`.

Requests (one frame each): ``call`` (run a function on tensors placed in guarded
buffers), ``prepare`` and ``timed`` (performance runs on inputs generated here by seed).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import traceback

# The labkit modules a submission may import; everything else under labkit is refused.
ALLOWED_LABKIT = {"labkit", "labkit.backend", "labkit.check", "labkit.validate"}
LABKIT_INTERNAL = {"labkit.grade", "labkit.grade.wire", "labkit.grade.guard", "labkit.grade.worker",
                   "labkit.grade.perf_inputs"}


class _RefuseSolutions(importlib.abc.MetaPathFinder):
    """Refuse labkit's topic packages with a message a student can act on."""

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002
        if name.startswith("labkit.") and name not in ALLOWED_LABKIT | LABKIT_INTERNAL:
            raise ImportError(
                f"{name} is not available to submissions: labkit's topics hold the book's "
                "own solutions. Use torch, triton and labkit.check only."
            )
        return None


def _apply_limits(config: dict) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))
    cpu = int(config["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    if config.get("memory_mb"):  # CPU mode only: a CUDA context reserves huge address space
        limit = int(config["memory_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _drop_privileges(user: str | None) -> None:
    if not user or os.geteuid() != 0:
        return
    import pwd

    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    if os.geteuid() == 0:
        raise RuntimeError("could not drop root privileges")


def _error(kind: str, exc: BaseException | None = None, message: str = "", path: str = "") -> dict:
    if exc is not None:
        message = f"{type(exc).__name__}: {exc}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        if frames:
            message += "\n" + "".join(traceback.format_list(frames[-3:])).rstrip()
    return {"ok": False, "kind": kind, "message": message[:6000]}


class Worker:
    def __init__(self, config: dict):
        import torch

        self.torch = torch
        self.path = config["submission"]
        self.device = torch.device("cuda" if config.get("gpu") and torch.cuda.is_available() else "cpu")
        self.module = None
        self.sets: list[list] = []
        self.signs: list = []

    def load(self) -> dict:
        spec = importlib.util.spec_from_file_location("submission", self.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["submission"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001  (a submission may even sys.exit here)
            return _error("import", e, path=self.path)
        self.module = module
        names = [n for n in dir(module) if callable(getattr(module, n, None)) and not n.startswith("_")]
        return {"ok": True, "functions": names}

    def _function(self, name: object):
        fn = getattr(self.module, name, None) if isinstance(name, str) else None
        return fn if callable(fn) else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def call(self, msg: dict) -> dict:
        from labkit.grade import guard

        fn = self._function(msg.get("name"))
        if fn is None:
            return _error("missing", message=f"the submission defines no function {msg.get('name')!r}")
        placed: list = []

        def place(v):
            if guard.is_tensor_arg(v):
                placed.append(guard.Placed(v, self.device))
                return placed[-1].view
            if isinstance(v, (list, tuple)):
                return type(v)(place(x) for x in v)
            return v

        try:
            args = place(msg.get("args", []))
            kwargs = {k: place(v) for k, v in msg.get("kwargs", {}).items()}
            value = fn(*args, **kwargs)
            self._sync()
        except BaseException as e:  # noqa: BLE001  (sys.exit and KeyboardInterrupt fail the call)
            return _error("raised", e, path=self.path)
        return {"ok": True, "value": value, "args_after": [p.after() for p in placed]}

    def prepare(self, msg: dict) -> dict:
        from labkit.grade.perf_inputs import checksum_signs, materialize

        self.sets = [[materialize(a, self.device) for a in args] for args in msg["sets"]]
        self.signs = [checksum_signs(r["numel"], r["seed"], self.device) for r in msg["signs"]]
        self._sync()
        return {"ok": True}

    def timed(self, msg: dict) -> dict:
        fn = self._function(msg.get("name"))
        if fn is None:
            return _error("missing", message=f"the submission defines no function {msg.get('name')!r}")
        from labkit.grade.perf_inputs import checksum

        torch = self.torch
        sums = []
        try:
            for set_index, arg_index, flat_index, value in msg["calls"]:
                args = self.sets[set_index]
                args[arg_index].view(-1)[flat_index] = value
                sums.append(checksum(fn(*args), self.signs[set_index]))
            self._sync()
            checksums = torch.stack(sums).cpu() if sums else torch.empty(0, dtype=torch.float64)
        except BaseException as e:  # noqa: BLE001
            return _error("raised", e, path=self.path)
        return {"ok": True, "checksums": checksums}


def main() -> None:
    config = json.loads(sys.argv[1])
    _apply_limits(config)
    sys.meta_path.insert(0, _RefuseSolutions())
    from labkit.grade import wire

    fd_in, fd_out = config["fd_in"], config["fd_out"]
    worker = Worker(config)
    _drop_privileges(config.get("user"))
    wire.send(fd_out, worker.load())
    handlers = {"call": worker.call, "prepare": worker.prepare, "timed": worker.timed}
    while True:
        try:
            msg = wire.receive(fd_in)
        except EOFError:
            return
        handler = handlers.get(msg.get("op"))
        reply = handler(msg) if handler else _error("protocol", message=f"unknown op {msg.get('op')!r}")
        try:
            frame = wire.pack(reply)
        except wire.WireError as e:
            frame = wire.pack(_error("bad_return", message=f"the submission returned something "
                                     f"the grader cannot read: {e}"))
        view = memoryview(frame)
        while view:
            view = view[os.write(fd_out, view):]


if __name__ == "__main__":
    main()
