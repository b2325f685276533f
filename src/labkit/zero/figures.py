"""The chapter's figures: bytes per rank by stage, traffic by stage, who owns which element, loss curves."""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from .layout import FlatLayout, PerParameterLayout
from .memory import KINDS, MIXED_ADAMW, STAGE_NAMES, STAGES, Precision, state_bytes_per_rank, traffic_per_rank

KIND_COLORS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b"}


def memory_bars(num_params: int, world_size: int, precision: Precision = MIXED_ADAMW) -> list[go.Bar]:
    """Stacked bars of GB per rank for each stage (the formula): params, grads, optimizer."""
    names = [STAGE_NAMES[s] for s in STAGES]
    held = [state_bytes_per_rank(num_params, world_size, s, precision) for s in STAGES]
    return [go.Bar(name=kind, x=names, y=[h[kind] / 1e9 for h in held], marker_color=KIND_COLORS[kind],
                   hovertemplate="%{x}: %{y:.2f} GB<extra>" + kind + "</extra>")
            for kind in KINDS]


def traffic_bars(num_params: int, world_sizes: list[int], bytes_per_element: int = 2) -> list[go.Bar]:
    """Bytes each rank sends per step, by stage, as multiples of the model's bytes."""
    model = num_params * bytes_per_element
    return [go.Bar(name=f"N = {n}", x=[STAGE_NAMES[s] for s in STAGES],
                   y=[traffic_per_rank(num_params, n, s, bytes_per_element)["total"] / model for s in STAGES])
            for n in world_sizes]


def ownership_heatmaps(shapes: list[tuple[int, int]], world_size: int) -> dict[str, list[go.Heatmap]]:
    """For each layout, which rank owns each element of each 2-D tensor (the tensors stacked, a gap between)."""
    width = max(s[1] for s in shapes)
    out = {}
    for name, layout_class in (("FSDP1: flat", FlatLayout), ("FSDP2: per-parameter", PerParameterLayout)):
        layout = layout_class(shapes, world_size)
        # every element of the gathered buffer labelled with the rank it came from, then unpacked
        owner = torch.arange(world_size, dtype=torch.float32).repeat_interleave(layout.shard_numel)
        rows, labels = [], []
        for k, tensor in enumerate(layout.unpack(owner)):
            if k:
                rows.append([None] * width)
                labels.append(" " * k)
            for r, row in enumerate(tensor.tolist()):
                rows.append(row + [None] * (width - len(row)))
                labels.append(f"tensor {k}, row {r}")
        out[name] = [go.Heatmap(z=rows, y=labels, colorscale="Viridis", zmin=0, zmax=world_size - 1,
                                colorbar=dict(title="rank"),
                                hovertemplate="%{y}, column %{x}: rank %{z}<extra></extra>")]
    return out


def loss_curves(reports: dict[str, dict]) -> dict[str, list[go.Scatter]]:
    """Per wrapper: our loss and the peer's, step by step (identical curves overlap)."""
    out = {}
    for label, rep in reports.items():
        steps = list(range(1, len(rep["our_loss"]) + 1))
        out[label] = [go.Scatter(x=steps, y=rep["their_loss"], name=f"torch: {rep['peer']}", mode="lines",
                                 line=dict(width=6, color="#bbbbbb")),
                      go.Scatter(x=steps, y=rep["our_loss"], name="ours", mode="lines+markers",
                                 line=dict(width=2, color="#e45756"))]
    return out
