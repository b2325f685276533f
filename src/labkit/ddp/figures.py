"""The chapter's figures and its overlap model, computed from labkit.ddp's buckets and traces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from ..plots import PALETTE
from .buckets import MIB, assign_buckets, bucket_limits


def reverse_order_buckets(tensors: Sequence, bucket_cap_mb: float | None) -> list[list[int]]:
    """The buckets DDP's rebuild cuts when gradients arrive in reverse parameter order."""
    order = list(reversed(range(len(tensors))))
    return assign_buckets([tensors[i] for i in order], list(bucket_limits(bucket_cap_mb)), order=order)


def bucket_bars(names: Sequence[str], tensors: Sequence, buckets: list[list[int]]) -> list[go.Bar]:
    """One stacked bar per bucket (MiB), one segment per parameter, in all-reduce order."""
    bars = []
    for b, members in enumerate(buckets):
        for i in members:
            bars.append(go.Bar(x=[f"bucket {b}"], y=[tensors[i].numel() * tensors[i].element_size() / MIB],
                               name=names[i], marker_color=PALETTE[i % len(PALETTE)], showlegend=False,
                               hovertemplate=f"{names[i]}<br>%{{y:.3f}} MiB<extra>bucket {b}</extra>"))
    return bars


def timeline_traces(trace: dict, label: str) -> list[go.BaseTraceType]:
    """Backward compute (one bar per bucket's filling) and each bucket's all-reduce, as bars on a time axis (ms)."""
    out = []
    previous = 0.0
    for b, (filled, launched, reduced) in enumerate(zip(trace["filled"], trace["launched"], trace["reduced"])):
        out.append(go.Bar(y=[f"{label}: backward"], x=[1e3 * (filled - previous)], base=[1e3 * previous],
                          orientation="h", marker_color=PALETTE[b % len(PALETTE)], showlegend=False,
                          hovertemplate=f"gradients of bucket {b}: %{{x:.1f}} ms<extra></extra>"))
        out.append(go.Bar(y=[f"{label}: all-reduce"], x=[1e3 * (reduced - launched)], base=[1e3 * launched],
                          orientation="h", marker_color=PALETTE[b % len(PALETTE)], showlegend=False,
                          marker_line=dict(color="black", width=1),
                          hovertemplate=f"all-reduce of bucket {b}: %{{x:.1f}} ms<extra></extra>"))
        previous = filled
    out.append(go.Scatter(x=[1e3 * trace["synced"]] * 2, y=[f"{label}: backward", f"{label}: all-reduce"],
                          mode="lines+markers", line=dict(color="black", dash="dot"), showlegend=False,
                          hovertemplate=f"{label}: gradients synced at %{{x:.1f}} ms<extra></extra>"))
    return out


@dataclass(frozen=True)
class LinkFit:
    """One bucket's all-reduce time: ``fixed_s + per_byte_s * bytes`` (fitted, never negative)."""

    fixed_s: float
    per_byte_s: float

    def seconds(self, n_bytes: float) -> float:
        return self.fixed_s + self.per_byte_s * n_bytes


def fit_link(trace: dict, bucket_bytes: Sequence[int]) -> LinkFit:
    """Fit :class:`LinkFit` to a trace whose all-reduces ran back to back (overlap off).

    Each bucket's own time is from the later of its launch and the previous bucket's end
    to its end: on one process group the all-reduces run one after another.
    """
    durations, previous_end = [], 0.0
    for launched, reduced in zip(trace["launched"], trace["reduced"]):
        durations.append(reduced - max(launched, previous_end))
        previous_end = reduced
    if len(durations) < 2:
        return LinkFit(0.0, max(durations[0], 0.0) / max(bucket_bytes[0], 1))
    slope, intercept = np.polyfit(np.asarray(bucket_bytes, float), np.asarray(durations, float), 1)
    if slope <= 0:
        return LinkFit(0.0, sum(durations) / sum(bucket_bytes))
    return LinkFit(max(float(intercept), 0.0), float(slope))


def simulate_step(bucket_bytes: Sequence[int], backward_s: float, link: LinkFit, overlap: bool) -> dict:
    """When backward's gradients are synced, if gradients arrive evenly in bytes over ``backward_s``.

    With ``overlap`` a bucket's all-reduce starts when it fills and the previous one is done;
    without, they all start when backward ends. Returns the sync time and the exposed
    communication (the part not hidden behind backward), in seconds.
    """
    total, filled_bytes, end = sum(bucket_bytes), 0, 0.0
    for n_bytes in bucket_bytes:
        filled_bytes += n_bytes
        ready = backward_s * filled_bytes / total if overlap else backward_s
        end = max(end, ready) + link.seconds(n_bytes)
    return {"synced_s": end, "exposed_s": end - backward_s, "buckets": len(bucket_bytes)}
