"""The traces behind the chapter's figures: the ring all-reduce step by step, measured time
against size with the fitted model, and the cost calculator. The chapter assembles them
with :func:`labkit.plots.slider_figure` and :func:`labkit.plots.dropdown_figure`, so every
state is precomputed and the figures work with no kernel."""

from __future__ import annotations

import plotly.graph_objects as go

from .. import plots
from . import cost, schedule

KB, MB, GB = 2**10, 2**20, 2**30


def _contents_label(ranks: frozenset[int], n: int) -> str:
    return "all" if len(ranks) == n else "+".join(str(r) for r in sorted(ranks))


def ring_all_reduce_frames(n: int = 4) -> dict[str, list[go.BaseTraceType]]:
    """The ring all-reduce on ``n`` ranks, one frame per step for :func:`labkit.plots.slider_figure`:
    who holds what of each chunk, and which chunk moves where (drawn from
    :func:`schedule.simulate_ring_all_reduce`, the same formulas the processes run)."""
    states = schedule.simulate_ring_all_reduce(n)
    transfers = schedule.ring_all_reduce_transfers(n)
    frames = {}
    for t, held in enumerate(states):
        xs = [c for r in range(n) for c in range(n)]
        ys = [r for r in range(n) for c in range(n)]
        counts = [len(held[r][c]) for r in range(n) for c in range(n)]
        cells = go.Scatter(
            x=xs, y=ys, mode="markers+text", text=[_contents_label(held[r][c], n) for r in range(n) for c in range(n)],
            marker=dict(symbol="square", size=58, color=counts, cmin=1, cmax=n, colorscale="Blues",
                        line=dict(color="#444", width=1), colorbar=dict(title="ranks summed", dtick=1)),
            textfont=dict(color=["white" if k > n / 2 else "#222" for k in counts]),
            hovertemplate="rank %{y}, chunk %{x}: %{text}<extra></extra>", showlegend=False)
        ax, ay, sizes = [], [], []
        if t > 0:
            for move in transfers[t - 1]:
                x = move.chunk + 0.38  # beside the cells, so the arrow does not hide their text
                ax += [x, x, None]
                ay += [move.src, move.dst, None]
                sizes += [0, 14, 0]
        phase = "start: each rank holds its own data" if t == 0 else (
            f"{transfers[t - 1][0].phase} step {transfers[t - 1][0].step + 1} of {n - 1}: "
            + ("the receiver adds its own copy" if transfers[t - 1][0].phase == "reduce-scatter"
               else "the receiver overwrites its copy"))
        arrows = go.Scatter(x=ax or [None], y=ay or [None], mode="lines+markers", showlegend=False,
                            line=dict(color=plots.PALETTE[1], width=3), hoverinfo="skip",
                            marker=dict(symbol="arrow", angleref="previous", size=sizes or [0], color=plots.PALETTE[1]))
        caption = go.Scatter(x=[(n - 1) / 2], y=[n - 0.35], mode="text", text=[phase], showlegend=False,
                             hoverinfo="skip", textfont=dict(size=14))
        label = "start" if t == 0 else f"{'RS' if t <= n - 1 else 'AG'} {transfers[t - 1][0].step + 1}"
        frames[label] = [cells, arrows, caption]
    return frames


def ring_layout(n: int) -> dict:
    """Axes for :func:`ring_all_reduce_frames`: chunks across, ranks down."""
    return dict(xaxis=dict(title="chunk", tickvals=list(range(n)), range=[-0.6, n - 0.2], showgrid=False),
                yaxis=dict(title="rank (sends to the rank below; the last wraps to 0)", tickvals=list(range(n)),
                           range=[n - 0.1, -0.6], showgrid=False),
                height=520)


def _fit_traces(rows: list[dict], collective: str, y: str, impls: list[str]) -> list[go.BaseTraceType]:
    traces = []
    for i, impl in enumerate(impls):
        mine = [r for r in rows if r["collective"] == collective and r["impl"] == impl]
        color = plots.PALETTE[i % len(plots.PALETTE)]
        xs = [r["bytes"] for r in mine]
        if y == "time":
            traces.append(go.Scatter(x=xs, y=[r["time_ms"] * 1e3 for r in mine], mode="markers", name=f"{impl}: measured",
                                     marker=dict(size=9, color=color), hovertemplate="%{x} B: %{y:.4g} us"))
            traces.append(go.Scatter(x=xs, y=[r["model_ms"] * 1e3 for r in mine], mode="lines", name=f"{impl}: alpha-beta fit",
                                     line=dict(color=color, dash="dash"), hovertemplate="model %{y:.4g} us"))
        else:
            traces.append(go.Scatter(x=xs, y=[r[f"{y}_gbps"] for r in mine], mode="lines+markers", name=impl,
                                     line=dict(color=color, width=3 if i == 0 else 2), hovertemplate="%{x} B: %{y:.4g} GB/s"))
    return traces


def measured_options(rows: list[dict], y: str = "time") -> dict[str, list[go.BaseTraceType]]:
    """One dropdown option per collective for :func:`labkit.plots.dropdown_figure`, from a
    sweep's annotated rows (a record's, or :func:`labkit.collectives.bench.measure`'s):
    measured time with each implementation's fitted alpha-beta line (``y="time"``), or bus
    or algorithm bandwidth (``"busbw"``, ``"algbw"``; on one rank bus bandwidth is zero by
    definition)."""
    if y not in ("time", "busbw", "algbw"):
        raise ValueError(f"y must be 'time', 'busbw' or 'algbw', got {y!r}")
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    impls = {c: list(dict.fromkeys(r["impl"] for r in rows if r["collective"] == c)) for c in collectives}
    width = max(len(v) for v in impls.values()) * (2 if y == "time" else 1)
    options = {}
    for c in collectives:
        traces = _fit_traces(rows, c, y, impls[c])
        # every option draws the same number of traces; pad with empty ones
        options[c.replace("_", "-")] = traces + [go.Scatter(x=[None], y=[None], showlegend=False)
                                                  for _ in range(width - len(traces))]
    return options


def measured_layout(y: str = "time") -> dict:
    return dict(xaxis=dict(type="log", title="tensor size (bytes)"),
                yaxis=dict(type="log" if y == "time" else "linear", title="time (us)" if y == "time" else f"{y} (GB/s)"))


CALCULATOR_ALGORITHMS = {
    "ring": "ring_all_reduce",
    "double binary tree": "tree_all_reduce",
    "recursive doubling": "recursive_doubling_all_reduce",
}
# Per-GPU, per-direction bandwidths from datasheets (cited in the chapter); the per-step
# latencies are round assumptions of the order NCCL's tuner uses, not measurements. NVLink
# through NVSwitch joins the 8 GPUs of one HGX board, so its curves stop at 8 GPUs; and
# inside a node NCCL's tree is a chain through the GPUs (the two binary trees span nodes),
# so the tree's logarithmic latency is drawn only for the network.
LINKS = {
    "NVLink 4 via NVSwitch (450 GB/s each way)": dict(
        bandwidth_gbps=450.0, alpha_s=2e-6, max_gpus=8, algorithms=("ring", "recursive doubling")),
    "InfiniBand NDR, one 400 Gb/s NIC per GPU (50 GB/s)": dict(
        bandwidth_gbps=50.0, alpha_s=5e-6, max_gpus=None, algorithms=tuple(CALCULATOR_ALGORITHMS)),
}


GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CALCULATOR_LAYOUT = dict(xaxis=dict(type="log", title="tensor size (bytes)"),
                         yaxis=dict(type="log", title="predicted time (us)"), height=520)


def cost_calculator_frames(gpu_counts: tuple[int, ...] = GPU_COUNTS) -> dict[int, list[go.BaseTraceType]]:
    """Predicted all-reduce time against message size, one frame per GPU count: three
    algorithms on two kinds of link, where the latency term hands over to the bandwidth term."""
    sizes = [2**k for k in range(10, 34)]
    frames = {}
    for n in gpu_counts:
        traces = []
        for j, (link, params) in enumerate(LINKS.items()):
            # Past what the link can join, its curves stay in the figure empty: every slider
            # frame must hold the same traces.
            beyond = params["max_gpus"] is not None and n > params["max_gpus"]
            for i, (name, algorithm) in enumerate(CALCULATOR_ALGORITHMS.items()):
                if name not in params["algorithms"]:
                    continue
                xs = [] if beyond else sizes
                ts = [cost.predicted_seconds(algorithm, s, n, alpha_s=params["alpha_s"],
                                             bandwidth_gbps=params["bandwidth_gbps"]) * 1e6 for s in xs]
                traces.append(go.Scatter(x=xs, y=ts, mode="lines", name=f"{name}, {link.split(' (')[0].split(',')[0]}",
                                         line=dict(color=plots.PALETTE[i], dash="solid" if j == 0 else "dot", width=2.5),
                                         hovertemplate=f"{name}<br>%{{x}} B: %{{y:.4g}} us<extra>{link}</extra>"))
        frames[n] = traces
    return frames


def cost_table(n: int, bandwidth_gbps: float, alpha_us: float, n_bytes: float) -> list[dict]:
    """Predicted time and bus bandwidth of each all-reduce algorithm (the explorer's table)."""
    rows = []
    for name, algorithm in CALCULATOR_ALGORITHMS.items():
        t = cost.predicted_seconds(algorithm, n_bytes, n, alpha_s=alpha_us * 1e-6, bandwidth_gbps=bandwidth_gbps)
        steps, per_byte = cost.steps_and_bytes(algorithm, n)
        rows.append({"algorithm": name, "steps": steps, "bytes sent per rank": per_byte * n_bytes,
                     "time_us": t * 1e6, "busbw_gbps": cost.busbw_gbps("all_reduce", n_bytes, t, n) if t else 0.0})
    return rows


def cost_table_html(rows: list[dict]) -> str:
    """The explorer's table, the fastest algorithm in bold."""
    best = min(rows, key=lambda r: r["time_us"])["algorithm"]
    cells = "".join(
        f"<tr><td>{'<b>' + r['algorithm'] + '</b>' if r['algorithm'] == best else r['algorithm']}</td>"
        f"<td>{r['steps']:.0f}</td><td>{r['bytes sent per rank'] / MB:.4g} MiB</td>"
        f"<td>{r['time_us']:.4g} us</td><td>{r['busbw_gbps']:.4g} GB/s</td></tr>" for r in rows)
    return ("<table><tr><th>algorithm</th><th>steps</th><th>sent per rank</th><th>time</th>"
            f"<th>busbw</th></tr>{cells}</table>")
