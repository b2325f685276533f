"""Traces of a replayed trace's figures: a request timeline (Gantt) per batching, and TTFT,
TPOT and throughput over the trace per metric, as the options of a menu
(:func:`labkit.plots.dropdown_figure` draws them). They take the rows of
:meth:`labkit.serve.metrics.RequestTimeline.row` with a ``batching`` column (a
``serve.batching`` record's rows), so a CPU build draws them from the recorded H200 run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from .. import plots
from .metrics import windowed_rate

WAIT_COLOR, RUN_COLOR, ABORT_COLOR = "#c9c9c9", plots.OURS_COLOR, plots.PALETTE[1]


def _by_batching(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["batching"], []).append(row)
    if not groups:
        raise ValueError("no rows to draw")
    return groups


# The timeline's axes: requests down the page in arrival order, bars overlaid on one row each.
TIMELINE_LAYOUT = dict(barmode="overlay", xaxis_title="seconds on the replay's clock",
                       yaxis=dict(title="request (by arrival)", autorange="reversed", showticklabels=False))


def request_timeline(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[go.Bar]]:
    """Per batching, one bar per request: grey from arrival to its first token (queued, then
    prefilled), coloured from the first token to the last (decoding; red when cancelled)."""
    options = {}
    for name, group in _by_batching(rows).items():
        group = sorted(group, key=lambda r: r["arrival_s"])
        labels = [f"#{r['request']}" for r in group]
        first = [r["first_token_s"] if r["first_token_s"] is not None else r["finish_s"] for r in group]
        waiting = go.Bar(y=labels, x=[f - r["arrival_s"] for f, r in zip(first, group)], base=[r["arrival_s"] for r in group],
                         orientation="h", marker_color=WAIT_COLOR, name="waiting + prefill",
                         hovertemplate="request %{y}: arrived %{base:.3f} s, first token after %{x:.3f} s<extra></extra>")
        running = go.Bar(y=labels, x=[r["finish_s"] - f for f, r in zip(first, group)], base=first, orientation="h",
                         marker_color=[ABORT_COLOR if r["finish_reason"] == "abort" else RUN_COLOR for r in group],
                         name="decoding (red: cancelled)",
                         customdata=[[r["output_len"], r["prompt_len"]] for r in group],
                         hovertemplate="request %{y}: %{customdata[1]} prompt tokens, %{customdata[0]} output tokens "
                                       "in %{x:.3f} s<extra></extra>")
        options[name] = [waiting, running]
    return options


def metrics_over_trace(rows: Sequence[Mapping[str, Any]], steps: Mapping[str, Mapping[str, list]], *,
                       windows: int = 40) -> dict[str, list[go.Scatter]]:
    """Per metric, one series per batching: TTFT and TPOT of each request against its arrival,
    and output tokens per second over time (from ``steps``: per batching, each step's ``end_s``
    and ``output_tokens``)."""
    groups = _by_batching(rows)
    end = max(r["finish_s"] for r in rows)
    window = end / windows
    options: dict[str, list[go.Scatter]] = {"TTFT (s) by arrival": [], "TPOT (ms) by arrival": [],
                                            f"throughput (tokens/s, {window:.3g} s windows)": []}
    for i, (name, group) in enumerate(groups.items()):
        color = plots.PALETTE[i % len(plots.PALETTE)]
        served = sorted((r for r in group if r["ttft_s"] is not None), key=lambda r: r["arrival_s"])
        options["TTFT (s) by arrival"].append(go.Scatter(
            x=[r["arrival_s"] for r in served], y=[r["ttft_s"] for r in served], mode="markers", name=name,
            marker=dict(color=color, size=6)))
        paced = [r for r in served if r["tpot_s"] is not None]
        options["TPOT (ms) by arrival"].append(go.Scatter(
            x=[r["arrival_s"] for r in paced], y=[r["tpot_s"] * 1e3 for r in paced], mode="markers", name=name,
            marker=dict(color=color, size=6)))
        centres, rates = windowed_rate(steps[name]["end_s"], steps[name]["output_tokens"], window)
        options[f"throughput (tokens/s, {window:.3g} s windows)"].append(go.Scatter(
            x=centres, y=rates, mode="lines", name=name, line=dict(color=color, width=2), line_shape="hvh"))
    return options
