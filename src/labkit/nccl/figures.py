"""The traces behind the chapter's figures, precomputed from the models so that the
figures work with no kernel (assembled with :func:`labkit.plots.slider_figure`)."""

from __future__ import annotations

import plotly.graph_objects as go

from . import protocols, ring

PHASE_COLOURS = {"reduce-scatter": "#4c78a8", "all-gather": "#f58518"}
PROTOCOL_COLOURS = {"LL": "#54a24b", "LL128": "#e45756", "Simple": "#4c78a8"}


def protocol_frames(world_sizes: list[int], sizes: list[int], *, channels: int, channel_gbps: float,
                    link: str = "NVLink") -> dict[str, list[go.BaseTraceType]]:
    """Per world size: NCCL's modelled all-reduce time against bytes, one line per protocol."""
    frames = {}
    for n in world_sizes:
        frames[f"{n} ranks"] = [
            go.Scatter(x=sizes, y=[protocols.ring_all_reduce_time_us(p, s, n, channels, channel_gbps, link)
                                   for s in sizes],
                       mode="lines+markers", name=p, line=dict(color=PROTOCOL_COLOURS[p]),
                       hovertemplate=f"{p}: %{{x:.3s}} B in %{{y:.1f}} us<extra></extra>")
            for p in protocols.PROTOCOLS]
    return frames


def protocol_layout() -> dict:
    return dict(xaxis=dict(title="all-reduce size (bytes)", type="log"),
                yaxis=dict(title="modelled time (us)", type="log"))


def timeline_traces(timeline: ring.Timeline, world_size: int) -> list[go.BaseTraceType]:
    """A Gantt chart of a timeline's sends on channel 0: one row per rank's outgoing link, by phase."""
    traces = []
    for phase, colour in PHASE_COLOURS.items():
        mine = [t for t in timeline.sends if t.send.channel == 0
                and (t.send.step < world_size - 1) == (phase == "reduce-scatter")]
        traces.append(go.Bar(
            y=[f"link {t.send.src}->{t.send.dst}" for t in mine], x=[t.end_us - t.start_us for t in mine],
            base=[t.start_us for t in mine], orientation="h", name=phase, marker=dict(color=colour),
            customdata=[[t.send.round, t.send.step, t.send.slice, t.send.nbytes] for t in mine],
            hovertemplate=("round %{customdata[0]}, step %{customdata[1]}, slice %{customdata[2]}: "
                           "%{customdata[3]} B, %{base:.1f}-%{x:.1f} us<extra></extra>")))
    return traces


def timeline_layout(finish_us: float) -> dict:
    return dict(barmode="overlay", xaxis=dict(title="time (us)", range=[0, finish_us * 1.02]),
                yaxis=dict(autorange="reversed"))


def schedule_frames(world_size: int, nbytes: int, link: ring.LinkModel, *, chunk_bytes: int,
                    slice_counts: list[int], step_overhead_us: float,
                    reduce_gbps: float) -> tuple[dict[str, list[go.BaseTraceType]], float]:
    """The naive ring, then the pipelined one at each slice count, on one channel; and the longest finish."""
    timelines = {"naive: whole chunks, a launch per step": ring.naive_ring(
        world_size, nbytes, link, step_overhead_us=step_overhead_us, reduce_gbps=reduce_gbps)}
    for m in slice_counts:
        timelines[f"pipelined: {m} slice{'s' if m > 1 else ''} per chunk"] = ring.pipelined_ring(
            world_size, nbytes, link, channels=1, chunk_bytes=chunk_bytes, slices_per_chunk=m,
            fifo_depth=max(ring.FIFO_SLICES, 2 * m))
    frames = {}
    for label, t in timelines.items():
        frames[f"{label} ({t.finish_us:.0f} us)"] = timeline_traces(t, world_size)
    return frames, max(t.finish_us for t in timelines.values())


def ring_time_frames(world_sizes: list[int], sizes: list[int], link: ring.LinkModel, *, channels: int,
                     chunk_bytes: int, step_overhead_us: float,
                     reduce_gbps: float) -> dict[str, list[go.BaseTraceType]]:
    """Per world size: the naive and the pipelined ring's modelled time against bytes, and the wire's bound."""
    frames = {}
    for n in world_sizes:
        naive = [ring.naive_ring(n, s, link, step_overhead_us=step_overhead_us, reduce_gbps=reduce_gbps).finish_us
                 for s in sizes]
        piped = [ring.pipelined_ring(n, s, link, channels=channels, chunk_bytes=chunk_bytes).finish_us for s in sizes]
        wire = [2 * (n - 1) / n * s / (link.bandwidth_gbps * 1e3) for s in sizes]
        frames[f"{n} ranks"] = [
            go.Scatter(x=sizes, y=naive, mode="lines+markers", name="naive ring", line=dict(color="#999")),
            go.Scatter(x=sizes, y=piped, mode="lines+markers", name=f"pipelined, {channels} channels",
                       line=dict(color="#4c78a8")),
            go.Scatter(x=sizes, y=wire, mode="lines", name="link bound 2(n-1)/n N / B",
                       line=dict(color="#e45756", dash="dot")),
        ]
    return frames
