"""One plotly look for the whole book, and the figures chapters share.

Every figure here is self-contained: sliders, dropdowns and animation frames are
precomputed into the figure, so they work on the static website with no kernel behind
it. Figures of recorded numbers carry a caption that says where they were measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from .results import Record

PALETTE = ["#2f6fde", "#e4572e", "#17a398", "#f3a712", "#7b5ea7", "#4d4d4d", "#c03a76", "#76b041"]
OURS_COLOR = PALETTE[0]

pio.templates["labkit"] = go.layout.Template(
    layout=go.Layout(
        font=dict(family="Inter, Helvetica, Arial, sans-serif", size=13, color="#222"),
        colorway=PALETTE,
        paper_bgcolor="white",
        plot_bgcolor="white",
        margin=dict(l=60, r=20, t=60, b=80),
        xaxis=dict(showgrid=True, gridcolor="#e6e6e6", zeroline=False, linecolor="#888", ticks="outside"),
        yaxis=dict(showgrid=True, gridcolor="#e6e6e6", zeroline=False, linecolor="#888", ticks="outside"),
        legend=dict(bgcolor="rgba(255,255,255,0.8)", borderwidth=0),
        hoverlabel=dict(namelength=-1),
    )
)
pio.templates.default = "labkit"


def caption(fig: go.Figure, text: str) -> go.Figure:
    """A small line under the plot: where the numbers come from."""
    fig.add_annotation(
        text=text, xref="paper", yref="paper", x=0, y=-0.2, xanchor="left", yanchor="top",
        showarrow=False, font=dict(size=10, color="#666"),
    )
    return fig


def provenance_caption(fig: go.Figure, record: Record) -> go.Figure:
    return caption(fig, record.label())


def sweep(
    rows: Sequence[Mapping[str, Any]],
    *,
    x: str,
    series: Mapping[str, str],
    title: str,
    x_title: str,
    y_title: str,
    log_x: bool = True,
    log_y: bool = False,
    hlines: Mapping[str, float] | None = None,
) -> go.Figure:
    """Lines of ``rows[*][column]`` against ``rows[*][x]``, one per ``series`` {label: column}."""
    fig = go.Figure()
    xs = [r[x] for r in rows]
    for i, (label, column) in enumerate(series.items()):
        ys = [r.get(column) for r in rows]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name=label,
            line=dict(width=3 if i == 0 else 2, color=PALETTE[i % len(PALETTE)]),
        ))
    for label, value in (hlines or {}).items():
        fig.add_hline(y=value, line_dash="dash", line_color="#888",
                      annotation_text=f"{label}: {value:.3g}", annotation_position="top left")
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title)
    fig.update_xaxes(type="log" if log_x else "linear")
    fig.update_yaxes(type="log" if log_y else "linear")
    return fig


def ratio_bars(
    labels: Sequence[str],
    ratios: Mapping[str, Sequence[float]],
    *,
    title: str,
    goal: float | None = None,
    y_title: str = "ours / reference",
) -> go.Figure:
    """Grouped bars of ratios (1.0 = parity), one group per label, one bar per reference."""
    fig = go.Figure()
    for i, (name, values) in enumerate(ratios.items()):
        fig.add_trace(go.Bar(x=list(labels), y=list(values), name=name,
                             marker_color=PALETTE[(i + 1) % len(PALETTE)],
                             text=[f"{v:.2f}x" for v in values], textposition="outside"))
    fig.add_hline(y=1.0, line_color="#444", line_width=1)
    if goal is not None:
        fig.add_hline(y=goal, line_dash="dash", line_color=PALETTE[1],
                      annotation_text=f"goal {goal:g}x", annotation_position="top left")
    fig.update_layout(title=title, yaxis_title=y_title, barmode="group")
    return fig


def roofline(
    *,
    peak_tflops: float,
    peak_tbps: float,
    points: Sequence[Mapping[str, Any]] = (),
    title: str = "Roofline",
    intensity_range: tuple[float, float] = (0.05, 4096.0),
) -> go.Figure:
    """Attainable TFLOP/s = min(peak, intensity x bandwidth), with operations placed on it.

    ``points``: dicts with ``name``, ``intensity`` (FLOP/byte) and ``tflops`` (achieved).
    """
    import numpy as np

    xs = np.geomspace(*intensity_range, 200)
    roof = np.minimum(peak_tflops, xs * peak_tbps)
    ridge = peak_tflops / peak_tbps
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=roof, mode="lines", name="roof (measured ceilings)",
                             line=dict(color="#222", width=3)))
    fig.add_vline(x=ridge, line_dash="dot", line_color="#888",
                  annotation_text=f"ridge {ridge:.0f} FLOP/B", annotation_position="bottom right")
    for i, p in enumerate(points):
        fig.add_trace(go.Scatter(
            x=[p["intensity"]], y=[p["tflops"]], mode="markers+text", name=p["name"],
            text=[p["name"]], textposition="top center",
            marker=dict(size=12, color=PALETTE[(i + 1) % len(PALETTE)]),
        ))
    fig.update_layout(title=title, xaxis_title="arithmetic intensity (FLOP / byte)",
                      yaxis_title="TFLOP/s", showlegend=True)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig


def slider_figure(
    frames: Mapping[str, Sequence[go.BaseTraceType]],
    *,
    title: str,
    slider_label: str,
    layout: Mapping[str, Any] | None = None,
) -> go.Figure:
    """A figure whose slider steps through precomputed states: works with no kernel.

    ``frames`` maps each step's label to the traces drawn at that step; every step must
    draw the same number of traces. The slider toggles trace visibility, so the page
    holds all the data and needs no Python to move.
    """
    if not frames:
        raise ValueError("slider_figure needs at least one frame")
    counts = {len(traces) for traces in frames.values()}
    if len(counts) != 1:
        raise ValueError(f"every frame must draw the same number of traces, got counts {sorted(counts)}")
    per_frame = counts.pop()
    fig = go.Figure()
    labels = list(frames)
    for i, label in enumerate(labels):
        for trace in frames[label]:
            trace.visible = i == 0
            fig.add_trace(trace)
    steps = []
    for i, label in enumerate(labels):
        visible = [j // per_frame == i for j in range(per_frame * len(labels))]
        steps.append(dict(method="update", label=str(label), args=[{"visible": visible}]))
    fig.update_layout(
        title=title,
        sliders=[dict(active=0, steps=steps, currentvalue=dict(prefix=f"{slider_label}: "), pad=dict(t=50))],
        **(layout or {}),
    )
    return fig


def dropdown_figure(
    options: Mapping[str, Sequence[go.BaseTraceType]],
    *,
    title: str,
    layout: Mapping[str, Any] | None = None,
) -> go.Figure:
    """Like :func:`slider_figure`, with a dropdown menu: for choices that have no order.

    The menu sits above the plot's right corner, clear of the title, and the figure is
    made tall enough that the open list stays inside it: a list that spills below the
    figure lies under the page's next element, which then takes the reader's clicks.
    """
    fig = slider_figure(options, title=title, slider_label="", layout=layout)
    steps = fig.layout.sliders[0].steps
    fig.layout.sliders = ()
    fig.update_layout(
        updatemenus=[dict(buttons=[dict(method="update", label=s.label, args=s.args) for s in steps],
                          direction="down", x=1.0, xanchor="right", y=1.02, yanchor="bottom")],
        margin=dict(t=110),
    )
    if fig.layout.height is None:
        fig.update_layout(height=max(450, 220 + 36 * len(steps)))
    return fig


def gantt_traces(
    spans: Sequence[Mapping[str, Any]],
    *,
    kinds: Sequence[str],
    time_scale: float = 1e-3,
) -> list[go.Bar]:
    """One horizontal bar trace per kind: each span a bar on its track, from start to end.

    ``spans``: dicts with ``track``, ``kind``, ``name``, ``start_us`` and ``dur_us`` (what
    :func:`labkit.streams.trace.spans_from_chrome_trace` returns). Times are multiplied by
    ``time_scale`` (the default shows milliseconds). Every kind in ``kinds`` gets a trace,
    empty if no span has it, so that figures built from several timelines (a slider, a
    dropdown) draw the same number of traces in each.
    """
    unknown = sorted({s["kind"] for s in spans} - set(kinds))
    if unknown:
        raise ValueError(f"spans have kinds {unknown} that are not in kinds={list(kinds)}")
    traces = []
    for i, kind in enumerate(kinds):
        mine = [s for s in spans if s["kind"] == kind]
        traces.append(go.Bar(
            y=[s["track"] for s in mine], x=[s["dur_us"] * time_scale for s in mine],
            base=[s["start_us"] * time_scale for s in mine], orientation="h", name=kind,
            marker_color=PALETTE[i % len(PALETTE)], marker_line_width=0.5, marker_line_color="white",
            hovertext=[f"{s['name']}<br>{s['start_us'] * time_scale:.4g} + {s['dur_us'] * time_scale:.4g}"
                       for s in mine],
            hoverinfo="text",
        ))
    return traces


def gantt(spans: Sequence[Mapping[str, Any]], *, title: str, kinds: Sequence[str] | None = None,
          x_title: str = "time (ms)", time_scale: float = 1e-3) -> go.Figure:
    """A timeline of ``spans`` (see :func:`gantt_traces`): one row per track, bars colored by kind."""
    if kinds is None:
        kinds = list(dict.fromkeys(s["kind"] for s in spans))
    fig = go.Figure(gantt_traces(spans, kinds=kinds, time_scale=time_scale))
    fig.update_layout(title=title, xaxis_title=x_title, barmode="overlay")
    fig.update_yaxes(autorange="reversed")
    return fig
