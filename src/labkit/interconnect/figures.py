"""The interconnects chapter's figures: each works on the static site (no kernel needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from .. import plots
from ..collectives.cost import AlphaBetaFit

MEASURED, MODELLED = "#1f77b4", "#bbbbbb"


def ladder(entries: Sequence[Mapping]) -> go.Figure:
    """One bar per link, one-way GB/s on a log axis: measured bars in colour, datasheet ones grey.

    ``entries``: dicts with ``name``, ``gbps`` and ``measured`` (bool) and ``note``.
    """
    entries = sorted(entries, key=lambda e: e["gbps"])
    fig = go.Figure(go.Bar(
        x=[e["gbps"] for e in entries], y=[e["name"] for e in entries], orientation="h",
        marker_color=[MEASURED if e["measured"] else MODELLED for e in entries],
        text=[f"{e['gbps']:,.0f} GB/s ({'measured' if e['measured'] else 'datasheet'})" for e in entries],
        textposition="outside", hovertext=[e.get("note", "") for e in entries], hoverinfo="text+x"))
    fig.update_xaxes(type="log", title="GB/s, one direction, per GPU")
    fig.update_layout(title="The link ladder: HBM, NVLink, PCIe, the network",
                      height=max(420, 34 * len(entries) + 160), margin=dict(l=170, r=140))
    return fig


def fit_traces(rows: Sequence[Mapping], fit: AlphaBetaFit, label: str, us_key: str) -> list[go.Scatter]:
    """Measured copy times against sizes, and the fitted line, for one sweep."""
    sizes = [r["bytes"] for r in rows]
    return [
        go.Scatter(x=sizes, y=[r[us_key] for r in rows], mode="markers", name=f"{label}: measured"),
        go.Scatter(x=sizes, y=[fit.predict(s) * 1e6 for s in sizes], mode="lines",
                   name=(f"{label}: alpha {fit.fixed_s * 1e6:.1f} us + bytes / "
                         f"{fit.bandwidth_gbps:.1f} GB/s" if fit.bandwidth_gbps else f"{label}: fit")),
    ]


def strategy_frames(frames: Mapping[str, Sequence[Mapping]], fast: str, slow: str) -> go.Figure:
    """A slider over network bandwidths; each step two bars per strategy: link time / compute time."""
    traces = {}
    for label, rows in frames.items():
        names = [f"{r['strategy']} ({r['degree']})" for r in rows]
        traces[label] = [
            go.Bar(x=names, y=[r[f"{fast}/compute"] for r in rows], name=f"on {fast}", marker_color="#2ca02c"),
            go.Bar(x=names, y=[r[f"{slow}/compute"] for r in rows], name=f"on {slow}", marker_color="#d62728",
                   text=[f"{r['slow/fast']:.1f}x" for r in rows], textposition="outside"),
        ]
    fig = plots.slider_figure(
        traces, title="Each strategy's traffic per step, as a fraction of its compute",
        slider_label="network per GPU, one way",
        layout=dict(barmode="group", yaxis=dict(type="log", title="link time / compute time"), height=520))
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="as long as the compute")
    return fig


PARTS = (("compute_s", "compute"), ("bubble_s", "pipeline bubble"), ("tp_s", "TP traffic"), ("cp_s", "CP traffic"),
         ("pp_s", "PP traffic"), ("dp_exposed_s", "DP traffic not hidden"))


def plan_figure(options: Mapping[str, Sequence[Mapping]]) -> go.Figure:
    """A dropdown over models; for each, the planner's best plan and its step, by bandwidth ratio."""
    traces = {}
    for label, rows in options.items():
        ok = [r for r in rows if "step_s" in r]
        xs = [f"{r['ratio']:.0f}x" for r in ok]
        traces[label] = [go.Bar(x=xs, y=[r[key] for r in ok], name=name,
                                text=[r["plan"] for r in ok] if key == "dp_exposed_s" else None,
                                textposition="outside") for key, name in PARTS]
    return plots.dropdown_figure(
        traces, title="The planner's best configuration as the network falls behind NVLink",
        layout=dict(barmode="stack", xaxis=dict(title="NVLink / network bandwidth per GPU"),
                    yaxis=dict(title="estimated seconds per step")))
