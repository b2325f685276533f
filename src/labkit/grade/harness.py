"""What an exercise's tests use: the ``submission`` they call, and how they judge it.

A test receives a :class:`Submission` and never the student's functions themselves:

- in the grader it is a :class:`SandboxSubmission`: every call runs in the sandboxed
  process (:mod:`labkit.grade.sandbox`), and only tensors come back;
- in the notebook's ``check()`` it is an :class:`InProcessSubmission` over the notebook's
  globals, so feedback is immediate.

Both place a copy of every tensor argument in a guarded buffer (:mod:`labkit.grade.guard`)
and report writes out of bounds. The test's own tensors are never changed: a submission
that overwrote its inputs could otherwise move the expected values computed from them.
Expected values are computed by the test itself, in float64, in the grader's own process.
"""

from __future__ import annotations

import importlib.util
import math
import random
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from labkit import backend, check

from . import guard, perf_inputs
from .sandbox import Sandbox, SubmissionFailed

__all__ = ["Credit", "InProcessSubmission", "PerfResult", "Randn", "Rules", "SandboxSubmission",
           "SubmissionFailed", "poisoned", "public_module", "require_gpu"]

Randn = perf_inputs.Randn


def poisoned(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output buffer full of NaN (or the int max): unwritten elements fail the check."""
    return check.empty_poisoned(tuple(shape), dtype, "cpu")


def public_module(hidden_test_file: str, name: str) -> ModuleType:
    """The public test module ``name`` of the same exercise, for the helpers it defines.

    Hidden tests reuse the public tests' helpers this way instead of copying them (the
    student's folder holds only the public tests, so helpers live there).
    """
    path = Path(hidden_test_file).resolve().parents[1] / "public" / name
    spec = importlib.util.spec_from_file_location(f"public_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_gpu() -> None:
    """Skip a performance test on a machine without a GPU (reported as skipped, max 0)."""
    if not backend.on_gpu():
        pytest.skip("performance is graded on a GPU only; under the interpreter it is skipped")


@dataclass(frozen=True)
class Rules:
    """What an exercise checks at run time, beyond values (``exercise.toml``).

    ``kernels``: functions whose every graded call must launch a Triton kernel.
    ``forbidden``: torch operators (aten names, ``softmax`` for ``aten._softmax``; a
    trailing ``*`` matches a prefix) that a call must not run outside a Triton kernel, and
    dotted library functions (``torch.distributed.all_reduce``) that raise when called.
    """

    kernels: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()

    def forbidden_ops(self, ops: Sequence[str]) -> list[str]:
        def bare(op: str) -> str:
            return op.rsplit(".", 1)[-1].strip("_")

        def hit(op: str, entry: str) -> bool:
            return bare(op).startswith(entry[:-1]) if entry.endswith("*") else bare(op) == entry

        return [op for op in ops if any(hit(op, e) for e in self.forbidden if "." not in e)]

    def problems(self, name: str, watch: object, *, ok: bool) -> list[str]:
        """Why a call breaks the rules, from the worker's report of what it ran."""
        if not isinstance(watch, dict):
            return ["the submission's process sent no report of what the call ran"]
        found = [str(p) for p in watch.get("problems", []) if isinstance(p, str)]
        calls = [str(c) for c in watch.get("forbidden_calls", [])]
        found += [f"{name} called {c}, which this exercise asks you to write yourself" for c in calls]
        ops = self.forbidden_ops([str(o) for o in watch.get("ops", [])])
        if ops:
            found.append(f"{name} ran torch's {', '.join(ops)} outside a Triton kernel: this exercise "
                         "asks you to compute that yourself, so the call earns nothing")
        if ok and name in self.kernels and not watch.get("launches"):
            found.append(f"{name} launched no Triton kernel: this exercise grades your kernel, and a "
                         "result computed another way earns nothing")
        return found


@dataclass
class Credit:
    """Partial credit a test awards itself (performance tests): a fraction in [0, 1]."""

    fraction: float | None = None
    message: str = ""

    def award(self, fraction: float, message: str = "") -> None:
        self.fraction = min(1.0, max(0.0, float(fraction)))
        self.message = message


@dataclass(frozen=True)
class PerfResult:
    tbps: float
    ceiling_tbps: float
    calls: int

    @property
    def fraction(self) -> float:
        return self.tbps / self.ceiling_tbps

    def __str__(self) -> str:
        return (f"{self.tbps:.3g} TB/s, {self.fraction:.0%} of the copy bandwidth measured in "
                f"the same run ({self.ceiling_tbps:.3g} TB/s), over {self.calls} calls")


def _check_value_types(value: object, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_value_types(v, where)
        return
    raise TypeError(f"{where}: cannot pass a {type(value).__name__} to a submission")


class Submission:
    """The interface tests see. Subclasses implement :meth:`_invoke`."""

    def call(self, name: str, *args: object, **kwargs: object) -> object:
        """Run the submission's ``name(*args, **kwargs)``; return its result.

        Tensor arguments are copied into guarded buffers. Raises :class:`SubmissionFailed`
        (the feedback) if the call raised, crashed, timed out, or wrote out of bounds.
        """
        return self.call_with_args(name, *args, **kwargs)[0]

    def explain(self, name: str, *args: object, **kwargs: object) -> dict:
        """What ``torch._dynamo.explain`` reports for the submission's ``name(*args, **kwargs)``:
        ``graph_count``, ``graph_break_count`` and ``break_reasons`` (one line each)."""
        return self._call(name, args, kwargs, through="explain")[0]

    def call_fullgraph(self, name: str, *args: object, **kwargs: object) -> object:
        """The submission's ``name`` compiled with ``fullgraph=True`` (Dynamo's graph run
        eagerly) and called; a graph break fails the call with Dynamo's reason."""
        return self._call(name, args, kwargs, through="fullgraph")[0]

    def opcheck(self, name: str, *args: object) -> dict:
        """``torch.library.opcheck`` of the submission's custom op ``name`` called with ``args``:
        ``{test: "SUCCESS" or the error}``."""
        return self._call(name, args, {}, through="opcheck")[0]

    def fake_outputs(self, name: str, *args: object) -> list:
        """``[shape, dtype, strides, is_fake]`` of each output of ``name`` called on fake copies of
        ``args`` under ``FakeTensorMode``: what a custom op's fake kernel says, its kernel not run."""
        return self._call(name, args, {}, through="fake")[0]

    def gradients(self, name: str, *args: object, grad_output: torch.Tensor) -> list:
        """The gradients of ``name(*args)``'s output, given ``grad_output``, with respect to the
        floating tensor arguments, by autograd through what the submission registered."""
        return self._call(name, (*args, grad_output), {}, through="grad")[0]

    def call_with_args(self, name: str, *args: object, **kwargs: object) -> tuple[object, list[torch.Tensor]]:
        """Like :meth:`call`, and also the tensor arguments as the call left them (new
        tensors, in the order they were passed), for functions that write into an argument."""
        return self._call(name, args, kwargs)

    def _call(self, name: str, args: tuple, kwargs: dict, through: str | None = None
              ) -> tuple[object, list[torch.Tensor]]:
        _check_value_types(list(args) + list(kwargs.values()), f"call({name!r})")
        tensors: list[torch.Tensor] = []

        def describe(v: object) -> object:
            if isinstance(v, torch.Tensor):
                tensors.append(v)
                return guard.describe(v)
            if isinstance(v, (list, tuple)):
                return type(v)(describe(x) for x in v)
            return v

        value, after = self._invoke(name, describe(list(args)), {k: describe(v) for k, v in kwargs.items()},
                                    through)
        if not isinstance(after, list) or len(after) != len(tensors):
            raise SubmissionFailed("the submission's reply does not account for its arguments")
        problems, left = [], []
        for i, (t, a) in enumerate(zip(tensors, after)):
            self._check_after(t, a)
            left.append(guard.as_left(t, a["span"]))
            report = guard.margin_report(a, f"tensor argument #{i + 1}", tuple(t.shape))
            if report:
                problems.append(report)
        if problems:
            raise SubmissionFailed(f"{name}: " + "\n".join(problems))
        return value, left

    @staticmethod
    def _check_after(t: torch.Tensor, a: object) -> None:
        ok = isinstance(a, dict) and all(isinstance(a.get(k), torch.Tensor) for k in ("span", "before", "after"))
        if ok:
            n = guard.span_length(tuple(t.shape), tuple(t.stride()))
            ok = a["span"].dtype == t.dtype and a["span"].numel() == n and a["before"].dtype == t.dtype
        if not ok:
            raise SubmissionFailed("the submission's reply about its arguments is malformed")

    def _invoke(self, name: str, args: list, kwargs: dict, through: str | None = None) -> tuple[object, list]:
        """Run ``name`` (through torch's tracing as :mod:`labkit.grade.tracing` says, if ``through``)."""
        raise NotImplementedError

    @staticmethod
    def expect_close(out: object, ref: torch.Tensor, *, dtype: torch.dtype, name: str = "output",
                     tol: float | None = None) -> None:
        """``out`` is a tensor of ``ref``'s shape, of ``dtype``, close to ``ref`` (float64)."""
        if not isinstance(out, torch.Tensor):
            raise check.CheckFailed(f"{name}: expected a tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(ref.shape):
            raise check.CheckFailed(f"{name}: expected shape {tuple(ref.shape)}, got {tuple(out.shape)}")
        if out.dtype != dtype:
            raise check.CheckFailed(f"{name}: expected dtype {dtype}, got {out.dtype}")
        check.assert_close(out, ref, dtype=dtype, tol=tol, name=name)

    def measure(self, name: str, reference: Callable[..., torch.Tensor], sets: Sequence[Sequence[object]],
                *, bytes_moved: int, rounds: int = 3) -> PerfResult:
        raise NotImplementedError("performance is measured by the grader only")


class SandboxSubmission(Submission):
    """A submission running in a :class:`~labkit.grade.sandbox.Sandbox`."""

    def __init__(self, sandbox: Sandbox, rules: Rules | None = None):
        self.sandbox = sandbox
        self.rules = rules or Rules()

    def _invoke(self, name: str, args: list, kwargs: dict, through: str | None = None) -> tuple[object, list]:
        request = {"op": "call", "name": name, "args": args, "kwargs": kwargs}
        if through is not None:
            request["through"] = through
        reply = self.sandbox.request(request, what=f"running {name}")
        watch = reply.get("watch")
        # a reply that failed before the worker could report (an unreadable return) says why itself
        problems = self.rules.problems(name, watch, ok=True) if reply.get("ok") else (
            self.rules.problems(name, watch, ok=False) if watch is not None else [])
        if problems:
            raise SubmissionFailed("\n".join(problems))
        if not reply.get("ok"):
            raise SubmissionFailed(f"{name} failed: {reply.get('message', 'unknown error')}")
        return reply.get("value"), reply.get("args_after")

    def measure(self, name: str, reference: Callable[..., torch.Tensor], sets: Sequence[Sequence[object]],
                *, bytes_moved: int, rounds: int = 3, verified: int = 2) -> PerfResult:
        """Time ``name`` over ``rounds`` passes of the input ``sets`` (recipes like :class:`Randn`).

        The sandbox runs the code, so nothing it measures or reports about time is used:
        this process's clock times the whole timed request, and nothing measured through
        the sandbox is subtracted. Before every call the sandbox sets one element of the
        call's first tensor to a value drawn here (at least 4 away from the one it replaces)
        and answers with the output's checksum: its sum weighted by random signs rolled by
        a shift drawn here per call and sent only with the timed request
        (:func:`perf_inputs.checksum`). Every checksum is checked against ``reference`` on
        the same inputs, and the full outputs of ``verified`` calls chosen here at random are
        fetched afterwards and compared element by element, so a fast wrong, memoised or
        made-up answer earns nothing. The checksum's own cost, measured in this process on
        the same output, is subtracted; the rate reported never exceeds the copy bandwidth
        measured in the same run.
        """
        from labkit import ceilings, timing

        device = backend.device()
        specs = [[a.spec() if isinstance(a, Randn) else a for a in s] for s in sets]
        inputs = [[perf_inputs.materialize(a, device) for a in spec] for spec in specs]
        rng = random.SystemRandom()
        sign_recipes = [{"numel": reference(*args).numel(), "seed": rng.randrange(2**62)} for args in inputs]
        self.sandbox.request({"op": "prepare", "sets": specs, "signs": sign_recipes}, what="preparing inputs")
        calls, changed = [], {}
        for _ in range(rounds + 1):
            for i, s in enumerate(sets):
                k = next(j for j, a in enumerate(s) if isinstance(a, Randn))
                flat = rng.randrange(inputs[i][k].numel())
                old = changed.get((i, k, flat), inputs[i][k].view(-1)[flat].item())
                changed[(i, k, flat)] = -math.copysign(rng.uniform(4.0, 8.0), old)
                calls.append([i, k, flat, changed[(i, k, flat)], rng.randrange(sign_recipes[i]["numel"])])
        # The first round runs untimed (checked all the same): it compiles the kernels for
        # these sizes, which the earlier tests' small, odd sizes specialize differently.
        warmup, timed = calls[:len(sets)], calls[len(sets):]
        keep = sorted(rng.sample(range(len(timed)), min(verified, len(timed))))
        got = [self._checksums(name, warmup, "warming up")]
        start = time.perf_counter()
        got.append(self._checksums(name, timed, "timing", keep=keep))
        wall = time.perf_counter() - start
        got = torch.cat(got)
        # A submission that returns the same buffer every call leaves in it the last call
        # that used it; the worker says which (any later call's output is as good a check).
        kept = {}
        for index, chosen in enumerate(keep):
            reply = self.sandbox.request({"op": "outputs", "index": index}, what=f"returning the outputs of {name}")
            call = reply.get("call")
            if not reply.get("ok") or not isinstance(reply.get("output"), torch.Tensor) \
                    or not isinstance(call, int) or not chosen <= call < len(timed):
                raise SubmissionFailed(f"{name}: the outputs of the timed calls did not come back")
            kept[call] = reply["output"]
        signs = [perf_inputs.checksum_signs(r["numel"], r["seed"], device) for r in sign_recipes]
        out, out_signs = None, signs[0]
        for c, (i, k, flat, value, shift) in enumerate(calls):
            inputs[i][k].view(-1)[flat] = value
            out, out_signs = reference(*inputs[i]), signs[i]
            expected = perf_inputs.checksum(out, signs[i], shift).item()
            # A correct output's errors meet the signs at random: they add up like a norm.
            allowed = 10 * check.tolerance(out.dtype) * (out.double().norm().item() + 1.0)
            if not abs(got[c].item() - expected) <= allowed:
                raise SubmissionFailed(f"{name}: wrong result during the timed run (call {c + 1})")
            if c - len(warmup) in kept:
                self.expect_close(kept[c - len(warmup)].to(out.device), out.double(), dtype=out.dtype,
                                  name=f"{name}'s output of timed call {c + 1}")
        checksum_s = timing.measure(lambda: perf_inputs.checksum(out, out_signs, 1)).seconds
        ceiling = ceilings.copy_bandwidth_tbps()
        per_call = max(wall / len(timed) - checksum_s, bytes_moved / (ceiling * 1e12))
        return PerfResult(bytes_moved / per_call / 1e12, ceiling, len(timed))

    def _checksums(self, name: str, calls: list, doing: str, keep: Sequence[int] = ()) -> torch.Tensor:
        reply = self.sandbox.request({"op": "timed", "name": name, "calls": calls, "keep": list(keep)},
                                     what=f"{doing} {name}")
        if not reply.get("ok"):
            raise SubmissionFailed(f"{name} failed while {doing}: {reply.get('message')}")
        got = reply.get("checksums")
        if not isinstance(got, torch.Tensor) or got.shape != (len(calls),) or got.dtype != torch.float64:
            raise SubmissionFailed("the submission's timing reply is malformed")
        launches = reply.get("launches")
        if name in self.rules.kernels and not (isinstance(launches, int) and launches >= len(calls)):
            raise SubmissionFailed(f"{name} launched no Triton kernel in some timed calls: this exercise "
                                   "times your kernel")
        return got


class InProcessSubmission(Submission):
    """The notebook's own functions, called directly (what ``check()`` uses)."""

    def __init__(self, namespace: dict):
        self.namespace = namespace

    def _invoke(self, name: str, args: list, kwargs: dict, through: str | None = None) -> tuple[object, list]:
        fn = self.namespace.get(name)
        if not callable(fn):
            raise SubmissionFailed(f"the notebook defines no function {name!r} (run its cells first)")
        if through is not None:
            from . import tracing

            fn = tracing.through(fn, through)
        placed: list[guard.Placed] = []

        def place(v: object) -> object:
            if guard.is_tensor_arg(v):
                placed.append(guard.Placed(v, backend.device()))
                return placed[-1].view
            if isinstance(v, (list, tuple)):
                return type(v)(place(x) for x in v)
            return v

        try:
            value = fn(*place(args), **{k: place(v) for k, v in kwargs.items()})
        except Exception as e:  # noqa: BLE001  (the student's error is the feedback)
            tb = "".join(traceback.format_exception_only(type(e), e)).strip()
            raise SubmissionFailed(f"{name} raised {tb}") from e
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu").clone()
        return value, [p.after() for p in placed]
