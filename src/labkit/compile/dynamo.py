"""What Dynamo captured: graphs, graph breaks and their reasons, guards.

Dynamo runs inside CPython's frame evaluation (PEP 523): before a frame of a compiled
function runs, Dynamo reads its bytecode symbolically, records every torch operation into
an FX graph, and emits new bytecode that calls the compiled graph. What it cannot put in a
graph (a ``print``, a branch on a tensor's *value*, ``.item()`` or ``.tolist()`` without
``capture_scalar_outputs``, an unsupported builtin) ends the graph there: a *graph break*.
The code before runs as one graph, the offending instruction runs in plain Python, and
Dynamo starts over on a *resume function* for the rest. Every graph comes with *guards*:
checks on the inputs (types, shapes, dtypes, ids, constants) under which it may be reused;
a call that fails them is traced again (a recompile).

:func:`graph_breaks` wraps ``torch._dynamo.explain``. Note that explain's
``graph_break_count`` counts the graphs a break leaves behind: a break followed by no tensor
operation leaves none and is not counted, while ``break_reasons`` lists it; trust the reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo


@dataclass(frozen=True)
class GraphBreak:
    reason: str    # Dynamo's reason, first line
    location: str  # file:line of the user code where the graph ended
    code: str      # that line's source


@dataclass(frozen=True)
class Capture:
    """``torch._dynamo.explain`` of one call, flattened to what a reader needs."""

    graph_count: int
    breaks: tuple[GraphBreak, ...]
    ops_per_graph: tuple[int, ...]
    guards: tuple[str, ...]
    graphs: tuple[torch.fx.GraphModule, ...]

    @property
    def break_count(self) -> int:
        """Every break Dynamo met (its ``break_reasons``), whether or not it left a graph."""
        return len(self.breaks)


def _location(reason) -> tuple[str, str]:
    if not reason.user_stack:
        return "?", ""
    frame = reason.user_stack[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}", (frame.line or "").strip()


def graph_breaks(fn: Callable, *args, **kwargs) -> Capture:
    """Trace ``fn(*args, **kwargs)`` with Dynamo afresh; its graphs, breaks and guards."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    torch._dynamo.reset()  # a fresh trace: nothing cached from an earlier call hides a break
    report = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = tuple(GraphBreak(str(r.reason).strip().splitlines()[0], *_location(r)) for r in report.break_reasons)
    guards = tuple(sorted({f"{g.name or '(global state)'}: {g.create_fn_name()}" for g in report.out_guards}))
    return Capture(int(report.graph_count), breaks, tuple(len(ops) for ops in report.ops_per_graph), guards,
                   tuple(report.graphs))
