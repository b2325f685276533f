"""The traces behind the chapter's figures, precomputed so that they work with no kernel.

- :func:`ring_event_frames`: the one-sided ring all-reduce run on the simulated heap, one frame
  per event of the network (a put or a signal landing, a wait satisfied), drawn from snapshots
  of every PE's heap taken by the world's ``watch`` hook;
- :func:`latency_frames`: the latency model of :mod:`labkit.shmem.cost` over message sizes,
  one frame per world size.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from .. import plots
from . import cost, programs
from .heap import World

EMPTY = -(2**30)


def _bits(value: int, n: int) -> str:
    if value == EMPTY:
        return ""
    ranks = [str(r) for r in range(n) if value >> r & 1]
    return "all" if len(ranks) == n else "+".join(ranks)


def ring_event_frames(n: int = 4) -> tuple[dict[str, list[go.BaseTraceType]], int]:
    """Frames of the one-sided ring on ``n`` PEs; returns ``(frames, columns)``.

    Each PE's input is ``1 << pe`` in every element, so a sum is the set of PEs it contains.
    A row is a PE's heap: its ``n`` data chunks, then its ``2(n-1)`` landing slots and flags.
    """
    numel = n  # one element a chunk
    world = World(n, 4096)
    data = world.alloc(numel, torch.int64, "data")
    slots = world.alloc((2 * (n - 1), 1), torch.int64, "slots")
    flags = world.alloc(2 * (n - 1), torch.int64, "flags")
    for p in range(n):
        data.on(p).fill_(1 << p)
        slots.on(p).fill_(EMPTY)
    snaps = [("start: every PE holds its own data; slots empty, flags down", None,
              [(data.on(p).tolist(), slots.on(p).view(-1).tolist(), flags.on(p).tolist()) for p in range(n)])]

    def watch(event: str, src: int, dst: int, kind: str) -> None:
        what = (f"PE {src}'s {'data' if kind == 'put' else 'signal'} lands on PE {dst}" if event == "deliver"
                else f"PE {src}'s flag is up: it takes the slot into its chunk (reduce-scatter adds, all-gather copies)")
        snaps.append((what, (src, dst, kind) if event == "deliver" else None,
                      [(data.on(p).tolist(), slots.on(p).view(-1).tolist(), flags.on(p).tolist()) for p in range(n)]))

    world.watch = watch
    world.run(programs.ring_all_reduce, data, slots, flags)
    snaps.append(("end: every PE holds the sum of all PEs' data in every chunk", None,
                  [(data.on(p).tolist(), slots.on(p).view(-1).tolist(), flags.on(p).tolist()) for p in range(n)]))
    steps = 2 * (n - 1)
    columns = n + 2 * steps
    frames = {}
    for i, (what, move, heaps) in enumerate(snaps):
        xs, ys, text, color = [], [], [], []
        for p, (chunks, slot_vals, flag_vals) in enumerate(heaps):
            for c, v in enumerate(chunks):
                xs.append(c), ys.append(p), text.append(_bits(v, n)), color.append(bin(v).count("1"))
            for s, v in enumerate(slot_vals):
                xs.append(n + s), ys.append(p), text.append(_bits(v, n)), color.append(0 if v == EMPTY else bin(v).count("1"))
            for s, v in enumerate(flag_vals):
                xs.append(n + steps + s), ys.append(p), text.append(str(v)), color.append(n if v else 0)
        cells = go.Scatter(x=xs, y=ys, mode="markers+text", text=text, showlegend=False,
                           marker=dict(symbol="square", size=34, color=color, cmin=0, cmax=n, colorscale="Blues",
                                       line=dict(color="#444", width=1)),
                           textfont=dict(size=9), hoverinfo="skip")
        ax, ay = [None], [None]
        if move is not None:
            src, dst, kind = move
            x = -0.8 if kind == "put" else columns - 0.2
            ax, ay = [x, x], [src, dst]
        arrow = go.Scatter(x=ax, y=ay, mode="lines+markers", showlegend=False, hoverinfo="skip",
                           line=dict(color=plots.PALETTE[1], width=3),
                           marker=dict(symbol="arrow", angleref="previous", size=[0, 14][: len(ax)],
                                       color=plots.PALETTE[1]))
        caption = go.Scatter(x=[(columns - 1) / 2], y=[n - 0.3], mode="text", text=[what], showlegend=False,
                             hoverinfo="skip")
        frames[str(i)] = [cells, arrow, caption]
    return frames, columns


def ring_event_layout(n: int, columns: int) -> dict:
    steps = 2 * (n - 1)
    ticks = [f"chunk {c}" for c in range(n)] + [f"slot {s}" for s in range(steps)] + [f"flag {s}" for s in range(steps)]
    return dict(xaxis=dict(tickvals=list(range(columns)), ticktext=ticks, range=[-1.2, columns + 0.2], showgrid=False,
                           tickangle=-60),
                yaxis=dict(title="PE", tickvals=list(range(n)), autorange="reversed", range=[n, -1], showgrid=False),
                height=420)


def latency_frames(world_sizes: list[int], sizes: list[int], *, host_alpha_us: float, device_alpha_us: float,
                   bandwidth_gbps: float) -> dict[str, list[go.BaseTraceType]]:
    """Modelled all-reduce time against size, one frame per world size, one line per model."""
    frames = {}
    for n in world_sizes:
        frames[f"{n} GPUs"] = [
            go.Scatter(x=sizes, y=[cost.all_reduce_time_us(m, s, n, host_alpha_us=host_alpha_us,
                                                           device_alpha_us=device_alpha_us,
                                                           bandwidth_gbps=bandwidth_gbps) for s in sizes],
                       mode="lines+markers", name=m, line=dict(color=plots.PALETTE[i]))
            for i, m in enumerate(cost.MODELS)]
    return frames
