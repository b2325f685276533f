"""Measured links as alpha-beta lines, and what the NVLink-to-network gap does to each parallelism.

Two halves.

**Fits.** A host-device copy sweep (rows of ``bytes`` and microseconds, as
``streams.copy_bandwidth`` and ``interconnect.host_link`` record them) becomes a line
``t = alpha + bytes / bandwidth`` through :func:`labkit.collectives.cost.fit_alpha_beta`
(one message over one link: ``point_to_point``), the same relative-residual least squares
the collectives chapter fits its rings with.

**Placement.** :func:`strategy_costs` puts each parallelism's per-step traffic on a link
and prices it with the alpha-beta model: the bytes from :mod:`labkit.parallel.planner`'s
formulas (TP, CP, PP, DP) and :func:`labkit.moe.traffic.layer_traffic` (EP), the latency
terms from :func:`labkit.collectives.cost.steps_and_bytes`. It prints nothing of its own:
every number comes from those models and from the link it is given, measured or cited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..collectives.cost import AlphaBetaFit, fit_alpha_beta, steps_and_bytes
from ..moe.traffic import layer_traffic
from ..parallel import planner
from ..validate import check_choice, check_positive_int

STRATEGIES = ("TP", "CP", "PP", "DP", "EP")
# Where each strategy's traffic sits against compute (Megatron-style training).
OVERLAP = {
    "TP": "on the critical path: each layer waits for its all-reduce",
    "CP": "partly hidden: the next K/V block travels while attention runs on this one",
    "PP": "on the critical path at stage boundaries, small",
    "DP": "hidden behind backward, bucket by bucket, while it fits",
    "EP": "on the critical path unless dispatch/combine overlap other micro-batches",
}


def copy_fit(rows: Sequence[Mapping], direction: str, *, kind: str = "pinned",
             fit_from_bytes: float = 0.0) -> AlphaBetaFit:
    """The alpha-beta line through one direction of a copy sweep.

    ``rows``: records' rows with ``direction``, ``bytes`` and ``<kind>_us`` (``kind`` is
    ``'pinned'`` or ``'pageable'``). Returns the fit for one message over one link: its
    ``alpha_s`` is the fixed cost of a copy, its ``bandwidth_gbps`` the slope's rate.
    """
    check_choice(kind, "kind", ("pinned", "pageable"))
    picked = sorted((r["bytes"], r[f"{kind}_us"] * 1e-6) for r in rows
                    if r.get("direction") == direction and f"{kind}_us" in r)
    if len(picked) < 2:
        directions = sorted({str(r.get("direction")) for r in rows})
        raise ValueError(f"need at least two {kind} rows for direction {direction!r}; the rows have {directions}")
    sizes, seconds = zip(*picked)
    return fit_alpha_beta("point_to_point", 2, sizes, seconds, fit_from_bytes=fit_from_bytes)


# A copy this small is all fixed cost at PCIe's rate (16 KiB take 0.3 us at 55 GB/s), so
# among copies up to this size a jump in time between neighbouring sizes is a change of
# mechanism, not of bytes.
STEP_SEARCH_BYTES = 16 * 1024
# The jump between neighbouring sizes that counts as a step: more than any run-to-run
# spread of a few microseconds' copy, which stays within a few percent.
STEP_RATIO = 1.5
# A line needs points to be fitted through: a step is taken only if this many sizes lie
# at or above it.
STEP_MIN_POINTS_ABOVE = 3


@dataclass(frozen=True)
class CopyStep:
    """Two levels in a sweep's small copies: up to ``below_bytes`` copies cost about
    ``below_us`` (the largest of them), from ``above_bytes`` on the line takes over, and the
    time jumps ``ratio`` times between the two sizes."""

    below_bytes: int
    above_bytes: int
    below_us: float
    above_us: float
    ratio: float


def copy_step(rows: Sequence[Mapping], direction: str, *, kind: str = "pinned") -> CopyStep | None:
    """The step in one direction's small copies, or ``None`` if they rise smoothly.

    Among the sizes up to :data:`STEP_SEARCH_BYTES`, the largest jump in time between
    neighbouring sizes; it is a step if it is at least :data:`STEP_RATIO` and leaves
    :data:`STEP_MIN_POINTS_ABOVE` sizes at or above it for a line. One alpha-beta line
    cannot go through a step (it falls between the levels); the line belongs above it, and
    the copies below it have a level of their own.
    """
    check_choice(kind, "kind", ("pinned", "pageable"))
    sweep = sorted((r["bytes"], r[f"{kind}_us"]) for r in rows
                   if r.get("direction") == direction and f"{kind}_us" in r)
    pairs = [(b_us / a_us, a, b) for (a, a_us), (b, b_us) in zip(sweep, sweep[1:])
             if b <= STEP_SEARCH_BYTES and a_us > 0
             and sum(n >= b for n, _ in sweep) >= STEP_MIN_POINTS_ABOVE]
    if not pairs:
        return None
    ratio, below, above = max(pairs)
    if ratio < STEP_RATIO:
        return None
    times = dict(sweep)
    return CopyStep(below_bytes=below, above_bytes=above, below_us=times[below], above_us=times[above], ratio=ratio)


def half_bandwidth_bytes(fit: AlphaBetaFit) -> float:
    """The message size at which a link delivers half its bandwidth: ``alpha * bandwidth``.

    Below it a transfer costs mostly latency; above it, mostly bytes (Hockney's n_1/2).
    """
    if fit.per_byte_s <= 0:
        raise ValueError("the fit has no positive slope, so no bandwidth to reach half of")
    return fit.fixed_s / fit.per_byte_s


@dataclass(frozen=True)
class LinkModel:
    """One link as the calculator prices it: one-way GB/s per GPU and seconds per latency term."""

    name: str
    gbps: float
    alpha_s: float
    source: str  # how the numbers were obtained: "measured ...", "datasheet ...", "NCCL's model ..."

    def __post_init__(self) -> None:
        if isinstance(self.gbps, bool) or not isinstance(self.gbps, (int, float)) or self.gbps <= 0:
            raise ValueError(f"gbps must be a positive number, got {self.gbps!r}")
        if isinstance(self.alpha_s, bool) or not isinstance(self.alpha_s, (int, float)) or self.alpha_s < 0:
            raise ValueError(f"alpha_s must be a number >= 0, got {self.alpha_s!r}")

    def seconds(self, n_bytes: float, latency_terms: float) -> float:
        return latency_terms * self.alpha_s + n_bytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class MoeSpec:
    """The MoE layers of a model, for EP's traffic: every layer's MLP is one (``moe_layers = layers``)."""

    experts: int = 64
    top_k: int = 8
    intermediate: int = 2048

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "intermediate"):
            check_positive_int(getattr(self, name), name)
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed experts ({self.experts})")


def strategy_traffic(strategy: str, shape: planner.ModelShape, work: planner.Workload, degree: int,
                     microbatches: int, moe: MoeSpec | None = None) -> dict:
    """One rank's traffic per optimizer step in a group of ``degree`` ranks doing ``strategy``.

    Returns ``bytes`` (on its links, ring algorithms), ``latency_terms`` (sequential
    alpha-sized steps on its critical path) and ``compute_flops`` (this rank's share of
    the model FLOPs of the step, 6 per parameter per token for dense layers) for the
    group's ``microbatches`` micro-batches of ``micro_batch x seq`` tokens.
    """
    check_choice(strategy, "strategy", STRATEGIES)
    check_positive_int(degree, "degree")
    check_positive_int(microbatches, "microbatches")
    if not isinstance(shape, planner.ModelShape):
        raise TypeError(f"shape must be a planner.ModelShape, got {type(shape).__name__}")
    if not isinstance(work, planner.Workload):
        raise TypeError(f"work must be a planner.Workload, got {type(work).__name__}")
    tokens_mb = work.micro_batch * work.seq
    tokens = tokens_mb * microbatches
    layers, m, d = shape.layers, microbatches, degree
    flops = 6.0 * shape.params * tokens / d  # the group shares one replica's tokens
    if strategy == "TP":
        steps, _ = steps_and_bytes("ring_all_reduce", d)
        n_bytes = planner.tensor_parallel_bytes(shape, tokens, d, work.act_bytes)
        terms = 4 * layers * m * steps
    elif strategy == "CP":
        if work.seq % (2 * d):
            raise ValueError(f"context parallelism splits the sequence into 2 x degree chunks: "
                             f"{work.seq} is not a multiple of {2 * d}")
        n_bytes = 3 * m * planner.ring_attention_forward_bytes(shape, tokens_mb, d, work.act_bytes, layers)
        terms = 3 * layers * (d - 1) * m
    elif strategy == "PP":
        if layers % d:
            raise ValueError(f"pipeline parallelism of {d} needs the {layers} layers to divide")
        n_bytes = planner.pipeline_bytes(shape, tokens_mb, m, d, 1, work.act_bytes) / d
        terms = 2 * m if d > 1 else 0
    elif strategy == "DP":
        steps, _ = steps_and_bytes("ring_all_reduce", d)
        n_bytes = planner.data_parallel_bytes(shape.params, d, work.grad_bytes)
        terms = steps
        flops = 6.0 * shape.params * tokens  # each DP rank runs its own micro-batches
    else:
        moe = moe or MoeSpec()
        if moe.experts % d:
            raise ValueError(f"expert parallelism of {d} needs the {moe.experts} experts to divide")
        # Each rank holds tokens / d of the group's tokens; forward and backward each make a
        # dispatch and a combine (the backward's carry gradients of the same size).
        per_layer = layer_traffic("EP", tokens=tokens, hidden=shape.hidden, intermediate=moe.intermediate,
                                  experts=moe.experts, top_k=moe.top_k, gpus=d, hbm_tbps=1.0)
        n_bytes = 2 * layers * per_layer.bytes_sent
        terms = 4 * layers * m if d > 1 else 0
        flops = 3 * layers * per_layer.flops + 6.0 * (shape.params - layers * 3 * shape.hidden
                                                      * shape.intermediate) * tokens / d
    if d == 1:
        n_bytes, terms = 0.0, 0
    return {"strategy": strategy, "degree": d, "bytes": float(n_bytes), "latency_terms": int(terms),
            "compute_flops": float(flops)}


def strategy_costs(shape: planner.ModelShape, work: planner.Workload, degree: int, microbatches: int, *,
                   fast: LinkModel, slow: LinkModel, tflops: float, mfu: float = 0.5,
                   moe: MoeSpec | None = None, strategies: Sequence[str] = STRATEGIES) -> list[dict]:
    """Each strategy's step traffic priced on a ``fast`` link (NVLink) and a ``slow`` one (the network).

    One row per strategy: bytes, latency terms, the seconds on each link, this rank's
    compute seconds at ``tflops * mfu``, and each link's time as a fraction of that compute
    (``> 1``: the link, not the GPU, sets the step's pace unless the traffic is hidden).
    """
    for name, value in (("fast", fast), ("slow", slow)):
        if not isinstance(value, LinkModel):
            raise TypeError(f"{name} must be a LinkModel, got {type(value).__name__}")
    if isinstance(tflops, bool) or not isinstance(tflops, (int, float)) or tflops <= 0:
        raise ValueError(f"tflops must be a positive number, got {tflops!r}")
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of the peak, in (0, 1]; got {mfu!r}")
    rows = []
    for s in strategies:
        t = strategy_traffic(s, shape, work, degree, microbatches, moe)
        compute_s = t["compute_flops"] / (tflops * 1e12 * mfu)
        on_fast = fast.seconds(t["bytes"], t["latency_terms"])
        on_slow = slow.seconds(t["bytes"], t["latency_terms"])
        rows.append({**t, f"{fast.name}_s": on_fast, f"{slow.name}_s": on_slow, "compute_s": compute_s,
                     f"{fast.name}/compute": on_fast / compute_s, f"{slow.name}/compute": on_slow / compute_s,
                     "slow/fast": on_slow / on_fast if on_fast else float("nan"), "overlap": OVERLAP[s]})
    return rows


def best_plans(shape: planner.ModelShape, work: planner.Workload, *, nodes: int, gpus_per_node: int,
               memory_gb: float, nvlink_gbps: float, network_gbps: Sequence[float], tflops: float) -> list[dict]:
    """:func:`labkit.parallel.planner.plan`'s best configuration at each network bandwidth.

    The cluster is the same but for its network; each row has the bandwidth ratio, the best
    plan's label and its step time in parts. Shows where the planner moves TP, PP and DP
    as the network gets slower relative to NVLink.
    """
    rows = []
    for net in network_gbps:
        cluster = planner.Cluster(f"{nodes}x{gpus_per_node}", nodes, gpus_per_node, memory_gb, nvlink_gbps,
                                  float(net), tflops)
        best = planner.plan(shape, cluster, work).best
        row = {"network_gbps": float(net), "ratio": cluster.bandwidth_ratio,
               "plan": best.label if best else "nothing fits"}
        if best is not None:
            row.update(step_s=best.step_s, compute_s=best.compute_s, bubble_s=best.bubble_s, tp_s=best.tp_s,
                       cp_s=best.cp_s, pp_s=best.pp_s, dp_exposed_s=best.dp_exposed_s, tp=best.tp, cp=best.cp,
                       pp=best.pp, dp=best.dp, tp_link=best.tp_link)
        rows.append(row)
    return rows
