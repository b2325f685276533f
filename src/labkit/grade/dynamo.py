"""A submission's function run through Dynamo, for exercises about graph capture.

``through(fn, "explain")`` answers what ``torch._dynamo.explain`` reports for a call (graph
count, graph-break count, each break's reason); ``through(fn, "fullgraph")`` calls ``fn``
compiled with ``fullgraph=True`` (Dynamo's graph run by the ``eager`` backend, so no
Inductor compile), which raises at the first graph break. The torch functions are taken
when this module is imported, which the grader's worker does before it loads a
submission: a submission that replaces ``torch._dynamo.explain`` or ``torch.compile`` does
not change what is measured here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

MODES = ("explain", "fullgraph")
_EXPLAIN = torch._dynamo.explain
_COMPILE = torch.compile
_RESET = torch._dynamo.reset


def through(fn: Callable, mode: str) -> Callable:
    """``fn`` wrapped to run through Dynamo in ``mode`` (one of :data:`MODES`)."""
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
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
