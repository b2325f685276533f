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

__all__ = ["Credit", "InProcessSubmission", "PerfResult", "Randn", "SandboxSubmission",
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

    def call_with_args(self, name: str, *args: object, **kwargs: object) -> tuple[object, list[torch.Tensor]]:
        """Like :meth:`call`, and also the tensor arguments as the call left them (new
        tensors, in the order they were passed), for functions that write into an argument."""
        _check_value_types(list(args) + list(kwargs.values()), f"call({name!r})")
        tensors: list[torch.Tensor] = []

        def describe(v: object) -> object:
            if isinstance(v, torch.Tensor):
                tensors.append(v)
                return guard.describe(v)
            if isinstance(v, (list, tuple)):
                return type(v)(describe(x) for x in v)
            return v

        value, after = self._invoke(name, describe(list(args)), {k: describe(v) for k, v in kwargs.items()})
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

    def _invoke(self, name: str, args: list, kwargs: dict) -> tuple[object, list]:
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

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    def _invoke(self, name: str, args: list, kwargs: dict) -> tuple[object, list]:
        reply = self.sandbox.request({"op": "call", "name": name, "args": args, "kwargs": kwargs},
                                     what=f"running {name}")
        if not reply.get("ok"):
            raise SubmissionFailed(f"{name} failed: {reply.get('message', 'unknown error')}")
        return reply.get("value"), reply.get("args_after")

    def measure(self, name: str, reference: Callable[..., torch.Tensor], sets: Sequence[Sequence[object]],
                *, bytes_moved: int, rounds: int = 3) -> PerfResult:
        """Time ``name`` over ``rounds`` passes of the input ``sets`` (recipes like :class:`Randn`).

        After one untimed round, the grader's clock times the whole request. Before every
        call the sandbox sets one element of the call's first tensor to a value drawn here, at
        least 4 away from the value it replaces, and returns the output's checksum (its sum
        weighted by random signs, :func:`perf_inputs.checksum`). Each is checked against
        ``reference`` on the same inputs, so a fast wrong or memoised answer earns nothing. The checksum's own
        cost, measured in this process, and an empty request's round trip are subtracted.
        """
        from labkit import ceilings, timing

        device = backend.device()
        specs = [[a.spec() if isinstance(a, Randn) else a for a in s] for s in sets]
        inputs = [[perf_inputs.materialize(a, device) for a in spec] for spec in specs]
        rng = random.Random()
        sign_recipes = [{"numel": reference(*args).numel(), "seed": rng.randrange(2**62)} for args in inputs]
        self.sandbox.request({"op": "prepare", "sets": specs, "signs": sign_recipes}, what="preparing inputs")
        calls, changed = [], {}
        for _ in range(rounds + 1):
            for i, s in enumerate(sets):
                k = next(j for j, a in enumerate(s) if isinstance(a, Randn))
                flat = rng.randrange(inputs[i][k].numel())
                old = changed.get((i, k, flat), inputs[i][k].view(-1)[flat].item())
                changed[(i, k, flat)] = -math.copysign(rng.uniform(4.0, 8.0), old)
                calls.append([i, k, flat, changed[(i, k, flat)]])
        # The first round runs untimed (checked all the same): it compiles the kernels for
        # these sizes, which the earlier tests' small, odd sizes specialize differently.
        warmup, timed = calls[:len(sets)], calls[len(sets):]
        got = [self._checksums(name, warmup, "warming up")]
        start = time.perf_counter()
        got.append(self._checksums(name, timed, "timing"))
        wall = time.perf_counter() - start
        got = torch.cat(got)
        # A request's own round trip (pipes, framing, the worker's loop) is timed with no calls
        # in it and subtracted: at a millisecond a call, it is not small beside a few calls.
        request_s = min(self._round_trip(name) for _ in range(3))
        signs = [perf_inputs.checksum_signs(r["numel"], r["seed"], device) for r in sign_recipes]
        out = None
        for c, (i, k, flat, value) in enumerate(calls):
            inputs[i][k].view(-1)[flat] = value
            out = reference(*inputs[i])
            expected = perf_inputs.checksum(out, signs[i]).item()
            # A correct output's errors meet the signs at random: they add up like a norm.
            allowed = 10 * check.tolerance(out.dtype) * (out.double().norm().item() + 1.0)
            if not abs(got[c].item() - expected) <= allowed:
                raise SubmissionFailed(f"{name}: wrong result during the timed run (call {c + 1})")
        checksum_s = timing.measure(lambda: perf_inputs.checksum(out, signs[-1])).seconds
        per_call = max((wall - request_s) / len(timed) - checksum_s, 1e-9)
        return PerfResult(bytes_moved / per_call / 1e12, ceilings.copy_bandwidth_tbps(), len(timed))

    def _round_trip(self, name: str) -> float:
        start = time.perf_counter()
        self._checksums(name, [], "answering an empty request")
        return time.perf_counter() - start

    def _checksums(self, name: str, calls: list, doing: str) -> torch.Tensor:
        reply = self.sandbox.request({"op": "timed", "name": name, "calls": calls}, what=f"{doing} {name}")
        if not reply.get("ok"):
            raise SubmissionFailed(f"{name} failed while {doing}: {reply.get('message')}")
        got = reply.get("checksums")
        if not isinstance(got, torch.Tensor) or got.shape != (len(calls),) or got.dtype != torch.float64:
            raise SubmissionFailed("the submission's timing reply is malformed")
        return got


class InProcessSubmission(Submission):
    """The notebook's own functions, called directly (what ``check()`` uses)."""

    def __init__(self, namespace: dict):
        self.namespace = namespace

    def _invoke(self, name: str, args: list, kwargs: dict) -> tuple[object, list]:
        fn = self.namespace.get(name)
        if not callable(fn):
            raise SubmissionFailed(f"the notebook defines no function {name!r} (run its cells first)")
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
