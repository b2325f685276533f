"""The Results appendix: every recorded goal, per chapter, with its provenance.

Reads every record under ``book/results/`` and turns the goals into a table and a figure.
A goal's *margin* is how far its value sits from its threshold, as a ratio oriented so that
1.0 is the line and above it is met (value/threshold for ``>=`` goals, threshold/value for
``<=``), which lets goals of different units share one axis.
"""

from __future__ import annotations

import plotly.graph_objects as go

from . import book, plots, results
from .results import Record


def recorded() -> list[Record]:
    """Every committed record, in the book's chapter order."""
    order = {c.id: i for i, c in enumerate(book.chapters())}
    recs = [Record.from_dict(d) for _, d in results.all_records()]
    return sorted(recs, key=lambda r: (order.get(r.chapter, len(order)), r.benchmark))


def margin(goal: results.Goal) -> float:
    if goal.op == ">=":
        return goal.value / goal.threshold if goal.threshold else float("inf")
    return goal.threshold / goal.value if goal.value else float("inf")


def goals_frame(records: list[Record]):
    import pandas as pd

    rows = []
    for rec in records:
        p = rec.provenance
        for g in rec.goals:
            rows.append({
                "chapter": rec.chapter, "benchmark": rec.benchmark, "goal": g.name,
                "value": round(g.value, 4), "target": f"{g.op} {g.threshold:g}",
                "status": "met" if g.met else "MISSED",
                "device": p.get("device"), "date": str(p.get("date", ""))[:10],
                "commit": p.get("git_commit"), "torch": p.get("torch"), "triton": p.get("triton"),
            })
    return pd.DataFrame(rows)


def goals_figure(records: list[Record]) -> go.Figure:
    """One bar per goal, its margin against the 1.0 line; a dropdown picks the chapter."""
    by_chapter: dict[str, list[tuple[str, float, bool]]] = {}
    for rec in records:
        for g in rec.goals:
            by_chapter.setdefault(rec.chapter, []).append((g.name, margin(g), g.met))
    if not by_chapter:
        raise ValueError("no recorded goals to plot")
    options = {}
    for chapter, goals in by_chapter.items():
        names, margins, met = zip(*goals)
        options[chapter] = [go.Bar(
            x=list(margins), y=list(names), orientation="h", name=chapter,
            marker_color=[plots.PALETTE[2] if m else plots.PALETTE[1] for m in met],
            text=[f"{m:.2f}" for m in margins], textposition="outside",
        )]
    fig = plots.dropdown_figure(options, title="Recorded goals: margin against each goal (1.0 = the goal)",
                                layout=dict(height=max(360, 40 * max(len(g) for g in by_chapter.values()))))
    fig.add_vline(x=1.0, line_color="#222", line_dash="dash")
    fig.update_xaxes(title="margin (value / goal; > 1 met)")
    fig.update_yaxes(automargin=True)
    return fig
