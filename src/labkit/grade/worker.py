"""The sandboxed side of grading: load a submission and answer the grader's requests.

This module runs in a fresh interpreter started by :mod:`labkit.grade.sandbox` with
``python -I -S``, a ``sys.path`` holding only the standard library, the site directories
of torch/triton/numpy, and a copy of labkit's *core* (backend, check, validate and the
pieces of ``labkit.grade`` this file needs): the book's topic packages, which hold the
solutions, do not exist there. The trusted supervisor (:mod:`labkit.grade.supervisor`)
started it as the sandbox user, if there is one. It lowers its own limits, imports torch
and triton (:func:`preload`), installs its :class:`Watch`, says it is ready, takes the
grader's modules out of reach of imports, and only then imports the submission. Everything
below that point is untrusted: the grader decides every score from the bytes it receives,
checked by :mod:`labkit.grade.wire`, and treats what :class:`Watch` reports as what an
unmodified process would say, nothing more.

In local mode on the CPU the worker is instead a fork of :mod:`labkit.grade.forkserver`'s
interpreter, started the same way, with :func:`preload` done before the fork and the
limits set after it. That path reaches the grader's own labkit, so the topic packages
exist on disk; the import finder installed first refuses them all the same.

Requests (one frame each): ``call`` (run a function on tensors placed in guarded
buffers), ``prepare``, ``timed`` and ``outputs`` (performance runs on inputs generated
here by seed).
"""

from __future__ import annotations

import contextlib
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
                   "labkit.grade.perf_inputs", "labkit.grade.tracing", "labkit.grade.supervisor",
                   "labkit.grade.forkserver"}


class _RefuseSolutions(importlib.abc.MetaPathFinder):
    """Refuse labkit's topic packages with a message a student can act on (and, once
    ``sealed``, the grader's own modules)."""

    sealed = False

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002
        allowed = ALLOWED_LABKIT | (set() if self.sealed else LABKIT_INTERNAL)
        if name.startswith("labkit.") and name not in allowed:
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


def _error(kind: str, exc: BaseException | None = None, message: str = "", path: str = "") -> dict:
    if exc is not None:
        message = f"{type(exc).__name__}: {exc}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        if frames:
            message += "\n" + "".join(traceback.format_list(frames[-3:])).rstrip()
    return {"ok": False, "kind": kind, "message": message[:6000]}


class ForbiddenCall(Exception):
    """A library function the exercise asks the student to write was called."""


class Watch:
    """What a graded call does at run time: Triton launches, torch operators, allocations.

    - Every Triton launch goes through ``JITFunction.run`` (``InterpretedFunction.run``
      under the interpreter), wrapped here to count launches.
    - A ``TorchDispatchMode`` sees every torch operator the call runs *outside* a Triton
      launch (the interpreter's own tensor work is not the submission's), by its aten
      name: ``torch.softmax`` arrives as ``aten._softmax``, whatever the Python name it
      was reached by.
    - Tensors the call allocates uninitialised (``torch.empty`` and kin) are placed in
      guarded buffers, like arguments: a kernel writing past the end of its own output
      lands in a margin, and one that pads its output so that unmasked stores land in the
      padding is caught where the returned tensor does not cover what was written.
    - Dotted names in the exercise's ``forbidden`` list (``torch.distributed.all_reduce``)
      are replaced by functions that raise, here and in processes forked from here.

    This runs in the submission's own process, so it reports what an honest or careless
    submission does; a submission that deliberately tampers with it can lie, which is why
    the grader also checks values and times from its own side.
    """

    ALLOCATORS = ("empty.memory_format", "empty_like.default", "empty_strided.default",
                  "new_empty.default", "new_empty_strided.default")

    def __init__(self, config: dict):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from labkit.grade import guard

        self.guard = guard
        self.launches, self.in_kernel = 0, 0
        self.ops: dict[str, int] = {}
        self.allocations: list = []
        self.forbidden_calls: list[str] = []
        watch = self
        allocators = {getattr(getattr(torch.ops.aten, n.split(".")[0]), n.split(".")[1]) for n in self.ALLOCATORS}

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if watch.in_kernel:
                    return out
                name = f"{func.namespace}.{func.overloadpacket.__name__}"
                watch.ops[name] = watch.ops.get(name, 0) + 1
                guardable = isinstance(out, torch.Tensor) and out.numel() and out.layout == torch.strided
                if func in allocators and guardable and all(st >= 0 for st in out.stride()):
                    n = guard.span_length(tuple(out.shape), tuple(out.stride()))
                    buffer = torch.empty(n + 2 * guard.MARGIN_ELEMENTS, dtype=out.dtype, device=out.device)
                    buffer.view(torch.uint8).fill_(guard.MARGIN_BYTE)
                    watch.allocations.append((buffer, n))
                    return buffer.as_strided(out.shape, out.stride(), guard.MARGIN_ELEMENTS)
                return out

        self.mode = Recorder
        self._count_launches()
        for dotted in config.get("forbidden", []):
            if "." in dotted:
                self._forbid(dotted)

    def _count_launches(self) -> None:
        import triton.runtime.jit as jit

        classes = [jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        except ImportError:  # pragma: no cover  (a triton without the interpreter)
            pass
        watch = self
        for cls in classes:
            def run(self, *args, __run=cls.run, **kwargs):
                watch.launches += 1
                watch.in_kernel += 1
                try:
                    return __run(self, *args, **kwargs)
                finally:
                    watch.in_kernel -= 1

            cls.run = run

    def _forbid(self, dotted: str) -> None:
        import importlib

        module_name, _, attr = dotted.rpartition(".")
        watch = self
        try:
            modules = [importlib.import_module(module_name)]
        except ImportError:
            return
        modules += [m for m in list(sys.modules.values())
                    if m is not None and m.__name__.startswith(module_name + ".")
                    and getattr(m, attr, None) is getattr(modules[0], attr, None)]
        if getattr(modules[0], attr, None) is None:
            return

        def refuse(*args, **kwargs):
            watch.forbidden_calls.append(dotted)
            raise ForbiddenCall(f"{dotted} is what this exercise asks you to write yourself")

        for m in modules:
            setattr(m, attr, refuse)

    def start(self) -> None:
        self.launches, self.in_kernel = 0, 0
        self.ops, self.allocations, self.forbidden_calls = {}, [], []

    def report(self, value: object) -> dict:
        """What the call did, and the out-of-bounds writes into what it allocated."""
        import torch

        guard = self.guard
        problems = []
        returned = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
        for buffer, n in self.allocations:
            m = guard.MARGIN_ELEMENTS
            damaged = guard.margin_damage(buffer[:m]) + guard.margin_damage(buffer[m + n:])
            if damaged:
                problems.append(f"the call wrote {damaged} element(s) outside a tensor it allocated "
                                "(torch.empty...): a load or store is missing its mask")
                continue
            for out in returned:
                if out.dtype != buffer.dtype or out.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                    continue
                covered = torch.zeros(buffer.numel(), dtype=torch.bool, device=buffer.device)
                covered.as_strided(out.shape, out.stride(), out.storage_offset()).fill_(True)
                region = buffer[m:m + n][~covered[m:m + n]]
                damaged = guard.margin_damage(region)
                if damaged:
                    problems.append(f"the kernel wrote {damaged} element(s) of its output's buffer that the "
                                    "returned tensor does not cover (padding absorbing unmasked stores): "
                                    "a load or store is missing its mask")
        return {"launches": self.launches, "ops": sorted(self.ops), "problems": problems,
                "forbidden_calls": sorted(set(self.forbidden_calls))}


class Worker:
    def __init__(self, config: dict):
        import torch

        from labkit.grade import guard, perf_inputs, tracing

        self.torch, self.guard, self.perf_inputs, self.tracing = torch, guard, perf_inputs, tracing
        self.path = config["submission"]
        self.device = torch.device("cuda" if config.get("gpu") and torch.cuda.is_available() else "cpu")
        self.watch = Watch(config.get("watch", {}))
        self.module = None
        self.sets: list[list] = []
        self.signs: list = []
        self.kept: list = []

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
        guard = self.guard
        fn = self._function(msg.get("name"))
        if fn is None:
            return _error("missing", message=f"the submission defines no function {msg.get('name')!r}")
        through = msg.get("through")
        if through is not None:
            if through not in self.tracing.MODES:
                return _error("protocol", message=f"unknown way through torch's tracing {through!r}")
            fn = self.tracing.through(fn, through)
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
            self.watch.start()
            # Dynamo and fake tensors refuse another dispatch mode: such a call is not watched op by op
            with self.watch.mode() if through is None else contextlib.nullcontext():
                value = fn(*args, **kwargs)
                self._sync()
            watched = self.watch.report(value)
        except BaseException as e:  # noqa: BLE001  (sys.exit and KeyboardInterrupt fail the call)
            return {**_error("raised", e, path=self.path), "watch": self.watch.report(None)}
        return {"ok": True, "value": value, "args_after": [p.after() for p in placed], "watch": watched}

    def prepare(self, msg: dict) -> dict:
        checksum_signs, materialize = self.perf_inputs.checksum_signs, self.perf_inputs.materialize
        self.sets = [[materialize(a, self.device) for a in args] for args in msg["sets"]]
        self.signs = [checksum_signs(r["numel"], r["seed"], self.device) for r in msg["signs"]]
        self._sync()
        return {"ok": True}

    def timed(self, msg: dict) -> dict:
        """Run the calls; answer each with its checksum (signs rolled by the call's shift,
        known only now); keep the outputs of the calls listed in ``keep`` for :meth:`kept`."""
        fn = self._function(msg.get("name"))
        if fn is None:
            return _error("missing", message=f"the submission defines no function {msg.get('name')!r}")
        checksum = self.perf_inputs.checksum
        torch = self.torch
        keep = set(msg.get("keep", []))
        sums, self.kept, storage = [], [], []
        self.watch.start()
        try:
            for c, (set_index, arg_index, flat_index, value, shift) in enumerate(msg["calls"]):
                args = self.sets[set_index]
                args[arg_index].view(-1)[flat_index] = value
                out = fn(*args)
                sums.append(checksum(out, self.signs[set_index], shift))
                storage.append(out.untyped_storage().data_ptr() if isinstance(out, torch.Tensor) else None)
                if c in keep:
                    self.kept.append([c, out])
            self._sync()
            checksums = torch.stack(sums).cpu() if sums else torch.empty(0, dtype=torch.float64)
        except BaseException as e:  # noqa: BLE001
            return _error("raised", e, path=self.path)
        for entry in self.kept:  # an output buffer used again holds the last call that used it
            entry[0] = max(j for j in range(entry[0], len(storage)) if storage[j] == storage[entry[0]])
        return {"ok": True, "checksums": checksums, "launches": self.watch.launches}

    def outputs(self, msg: dict) -> dict:
        """One kept output per request: at real sizes each is a gigabyte."""
        index = msg.get("index")
        if not isinstance(index, int) or not 0 <= index < len(self.kept):
            return _error("protocol", message=f"no kept output {index!r}")
        call, output = self.kept[index]
        return {"ok": True, "call": call, "output": output}


def _hide_the_grader() -> None:
    """Take the grader's modules out of ``sys.modules``: an ``import labkit.grade.worker``
    in the submission then meets the refusing finder instead of this module."""
    for name in list(sys.modules):
        if name in LABKIT_INTERNAL:
            del sys.modules[name]


def preload() -> _RefuseSolutions:
    """The trusted imports, done before any submission code runs (under the grader's start
    timeout): everything the worker and the allowed part of labkit need. Returns the finder
    that refuses labkit's topics, installed first and sealed by :func:`serve`."""
    finder = _RefuseSolutions()
    sys.meta_path.insert(0, finder)
    import torch  # noqa: F401
    import triton  # noqa: F401

    import labkit  # noqa: F401
    import labkit.check  # noqa: F401
    import labkit.validate  # noqa: F401
    from labkit.grade import guard, perf_inputs, tracing, wire  # noqa: F401

    return finder


def serve(config: dict, finder: _RefuseSolutions) -> None:
    """Say ready, load the submission and answer requests until the grader's pipe closes."""
    from labkit.grade import wire

    fd_in, fd_out = config["fd_in"], config["fd_out"]
    worker = Worker(config)
    wire.send(fd_out, {"ok": True, "ready": True})
    _hide_the_grader()
    finder.sealed = True
    wire.send(fd_out, worker.load())
    handlers = {"call": worker.call, "prepare": worker.prepare, "timed": worker.timed, "outputs": worker.outputs}
    while True:
        try:
            msg = wire.receive(fd_in)
        except EOFError:
            return
        handler = handlers.get(msg.get("op"))
        reply = handler(msg) if handler else _error("protocol", message=f"unknown op {msg.get('op')!r}")
        try:
            frame = wire.pack(reply)
        except Exception as e:  # noqa: BLE001  (whatever the submission returned, the grader hears why)
            frame = wire.pack(_error("bad_return", message=f"the submission returned something "
                                     f"the grader cannot read: {type(e).__name__}: {e}"))
        view = memoryview(frame)
        while view:
            view = view[os.write(fd_out, view):]


def main() -> None:
    config = json.loads(sys.argv[1])
    _apply_limits(config)
    serve(config, preload())


if __name__ == "__main__":
    main()
