"""The chapter's figures: pipeline timelines (Gantt charts) and the planner's step-time breakdowns."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from ..plots import PALETTE
from .planner import Candidate
from .schedules import Timeline

FORWARD_COLOR, BACKWARD_COLOR = PALETTE[0], PALETTE[1]


def gantt_traces(events: Sequence[Sequence[tuple[str, int, int, float, float]]], row_prefix: str = "",
                 time_unit: str = "") -> list[go.Bar]:
    """Two horizontal bar traces (forwards, backwards) of ``events[rank] = [(kind, mb, chunk, start, end)]``.

    Rank 0 is drawn on top; a bar's label is its micro-batch, and its chunk when there are
    several (lighter for later chunks).
    """
    traces = []
    for kind, color, name in (("F", FORWARD_COLOR, "forward"), ("B", BACKWARD_COLOR, "backward")):
        ys, xs, bases, labels, opacity = [], [], [], [], []
        for rank, rank_events in enumerate(events):
            for k, mb, chunk, start, end in rank_events:
                if k != kind:
                    continue
                ys.append(f"{row_prefix}rank {rank}")
                xs.append(end - start)
                bases.append(start)
                labels.append(f"{mb}" if chunk == 0 else f"{mb}.{chunk}")
                opacity.append(1.0 if chunk == 0 else 0.6)
        traces.append(go.Bar(y=ys, x=xs, base=bases, customdata=bases, orientation="h", name=name, text=labels,
                             textposition="inside", insidetextanchor="middle",
                             marker=dict(color=color, opacity=opacity, line=dict(color="white", width=1)),
                             hovertemplate=f"{name} of micro-batch %{{text}}: starts at %{{customdata:.3g}}{time_unit}, "
                                           f"lasts %{{x:.3g}}{time_unit}<extra>%{{y}}</extra>"))
    return traces


def timeline_events(timeline: Timeline) -> list[list[tuple[str, int, int, float, float]]]:
    """A simulated :class:`~labkit.parallel.schedules.Timeline` in :func:`gantt_traces`' form."""
    return [[(a.kind, a.microbatch, a.chunk, start, end) for a, start, end in rank] for rank in timeline.events]


def gantt_layout(rows: int, x_title: str) -> dict:
    return dict(barmode="overlay", height=max(320, 60 + 28 * rows), xaxis_title=x_title,
                yaxis=dict(autorange="reversed"), legend=dict(orientation="h", y=1.08))


def breakdown_traces(candidates: Sequence[Candidate]) -> list[go.Bar]:
    """Stacked bars of each candidate's estimated step: compute, bubble, TP, CP and PP traffic, exposed DP traffic."""
    labels = [c.label for c in candidates]
    parts = (("compute", "compute_s"), ("pipeline bubble", "bubble_s"), ("TP traffic", "tp_s"), ("CP traffic", "cp_s"),
             ("PP traffic", "pp_s"), ("DP traffic not hidden", "dp_exposed_s"))
    return [go.Bar(x=labels, y=[getattr(c, field) for c in candidates], name=name, marker_color=PALETTE[i],
                   hovertemplate=f"{name}: %{{y:.2f}} s<extra>%{{x}}</extra>")
            for i, (name, field) in enumerate(parts)]
