"""A submission's function run through PyTorch's tracing machinery, for exercises about it.

- ``through(fn, "explain")`` answers what ``torch._dynamo.explain`` reports for a call (graph
  count, graph-break count, each break's reason);
- ``through(fn, "fullgraph")`` calls ``fn`` compiled with ``fullgraph=True`` (Dynamo's graph
  run by the ``eager`` backend, so no Inductor compile), which raises at the first graph break;
- ``through(op, "opcheck")`` answers ``torch.library.opcheck`` for a custom op called with
  these arguments (floating tensors made to require gradients, so the autograd tests run):
  ``{test: "SUCCESS" or the error}``;
- ``through(fn, "fake")`` calls ``fn`` on fake copies of the arguments under
  ``FakeTensorMode`` and answers each output's ``[shape, dtype, strides, is_fake]``: what a
  custom op's fake kernel promises, computed without its real kernel;
- ``through(fn, "grad")`` takes the arguments plus a last one, the output's gradient, and
  answers the gradients of ``fn``'s output with respect to the floating tensor arguments, by
  autograd through whatever ``fn`` registered.

None of these run under the grader's operator recorder (Dynamo and fake tensors refuse a
foreign dispatch mode). The torch functions are taken when this module is imported, which
the grader's worker does before it loads a submission: a submission that replaces
``torch._dynamo.explain``, ``torch.compile`` or ``torch.library.opcheck`` does not change
what is measured here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

MODES = ("explain", "fullgraph", "opcheck", "fake", "grad")
_EXPLAIN = torch._dynamo.explain
_COMPILE = torch.compile
_RESET = torch._dynamo.reset
_OPCHECK = torch.library.opcheck
_GRAD = torch.autograd.grad


def _leaf(v: object) -> object:
    """A floating tensor argument as a fresh leaf that requires gradients; anything else as given."""
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().clone().requires_grad_()
    return v


def _describe(out: object) -> list:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected the function to return a tensor, got {type(out).__name__}")
    return [list(out.shape), str(out.dtype).replace("torch.", ""), list(out.stride()), isinstance(out, FakeTensor)]


def through(fn: Callable, mode: str) -> Callable:
    """``fn`` wrapped to run through PyTorch's machinery in ``mode`` (one of :data:`MODES`)."""
    if mode == "explain":
        def explained(*args, **kwargs) -> dict:
            _RESET()  # a fresh trace: nothing cached from an earlier call hides a break
            report = _EXPLAIN(fn)(*args, **kwargs)
            return {"graph_count": int(report.graph_count), "graph_break_count": int(report.graph_break_count),
                    "break_reasons": [str(r.reason).strip().splitlines()[0] for r in report.break_reasons]}
        return explained
    if mode == "fullgraph":
        def compiled(*args, **kwargs):
            _RESET()
            return _COMPILE(fn, fullgraph=True, backend="eager")(*args, **kwargs)
        return compiled
    if mode == "opcheck":
        def checked(*args, **kwargs) -> dict:
            report = _OPCHECK(fn, tuple(_leaf(a) for a in args), {k: _leaf(v) for k, v in kwargs.items()},
                              raise_exception=False)
            return {test: str(result) for test, result in report.items()}
        return checked
    if mode == "fake":
        def faked(*args, **kwargs) -> list:
            with FakeTensorMode() as fake:
                def convert(v):
                    return fake.from_tensor(v) if isinstance(v, torch.Tensor) else v
                out = fn(*(convert(a) for a in args), **{k: convert(v) for k, v in kwargs.items()})
                outs = out if isinstance(out, (tuple, list)) else (out,)
                return [_describe(o) for o in outs]
        return faked
    if mode == "grad":
        def gradients(*args) -> list:
            if len(args) < 2 or not isinstance(args[-1], torch.Tensor):
                raise TypeError("a 'grad' call takes the function's arguments and then the output's gradient")
            inputs = [_leaf(a) for a in args[:-1]]
            leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
            return list(_GRAD(fn(*inputs), leaves, args[-1]))
        return gradients
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
