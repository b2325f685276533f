"""The decision calculator: from a model, a batch and a cluster to a TP/SP/CP/PP/DP configuration.

Two halves. The **formulas** say what each strategy moves per training step and what
each GPU must hold; the chapter checks the communication formulas against the bytes the
CPU runs of :mod:`labkit.parallel` counted (:class:`~labkit.parallel.comm.CommLog`). The
**planner** enumerates every ``tp * cp * pp * dp = GPUs`` that divides the model, keeps the
ones whose memory fits, estimates a step's time for each (compute, pipeline bubble, and
each strategy's traffic on the link it crosses: NVLink inside a node, the network between
nodes), and returns the fastest with the reasoning that led there. Sequence parallelism
comes with every ``tp > 1``; context parallelism is tried only where nothing fits without
it. Step times are estimates (an assumed fraction of peak, traffic not overlapped unless
said), for ranking configurations, not for predicting a run.

Bytes are per rank, on its links, for ring collectives (``2(n-1)/n`` of the tensor per
all-reduce, ``(n-1)/n`` per all-gather or reduce-scatter); a step is one optimizer step
over ``microbatches`` micro-batches of ``micro_batch x seq`` tokens per data-parallel rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..validate import check_positive_int

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need of a decoder (the book's :class:`~labkit.models.DecoderConfig` has it all)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True

    @classmethod
    def of(cls, config) -> ModelShape:
        return cls(config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.intermediate_size, config.vocab_size, config.tie_word_embeddings)

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 2 * self.head_dim
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embeddings + self.hidden


def ring_all_reduce_factor(n: int) -> float:
    return 2 * (n - 1) / n


# --- communication per step, per rank ------------------------------------------------------


def tensor_parallel_bytes(shape: ModelShape, tokens: int, tp: int, act_bytes: int, layers: int | None = None) -> float:
    """Activation traffic of TP (or TP+SP) for ``tokens`` tokens through ``layers`` blocks, forward and backward.

    Four collectives of the ``[tokens, hidden]`` activation per block: an all-reduce after
    attention and after the MLP in forward, one before each in backward (or, with sequence
    parallelism, a reduce-scatter plus an all-gather for each: the same bytes).
    """
    layers = shape.layers if layers is None else layers
    return 4 * layers * tokens * shape.hidden * act_bytes * ring_all_reduce_factor(tp)


def tensor_parallel_partial_grad_bytes(shape: ModelShape, tp: int, sequence_parallel: bool, grad_bytes: int,
                                       layers: int | None = None) -> float:
    """The all-reduce of replicated parameters whose gradient each rank holds a part of.

    Always the per-head q/k norms (each rank normalises its own heads); with sequence
    parallelism also every norm and the embedding, since each rank saw its own tokens.
    """
    layers = shape.layers if layers is None else layers
    params = layers * 2 * shape.head_dim
    if sequence_parallel:
        params += layers * 2 * shape.hidden + shape.hidden + shape.vocab * shape.hidden * (1 if shape.tied else 2)
    return params * grad_bytes * ring_all_reduce_factor(tp)


def pipeline_bytes(shape: ModelShape, tokens_per_microbatch: int, microbatches: int, pp: int, chunks: int,
                   act_bytes: int) -> float:
    """Point-to-point traffic of a pipeline, *summed over its ranks*: each of the ``pp * v - 1``
    boundaries carries every micro-batch's activation forward and its gradient back."""
    return (pp * chunks - 1) * 2 * microbatches * tokens_per_microbatch * shape.hidden * act_bytes


def ring_attention_forward_bytes(shape: ModelShape, tokens: int, cp: int, act_bytes: int, layers: int = 1) -> float:
    """K and V of ``tokens / cp`` tokens, passed ``cp - 1`` times per layer's forward."""
    return layers * (cp - 1) * 2 * (tokens // cp) * shape.kv_heads * shape.head_dim * act_bytes


def data_parallel_bytes(params_per_rank: int, dp: int, grad_bytes: int) -> float:
    """One all-reduce of the gradients per step (DDP; ZeRO's reduce-scatter + all-gather move the same)."""
    return params_per_rank * grad_bytes * ring_all_reduce_factor(dp)


# --- memory per GPU -------------------------------------------------------------------------


def activation_bytes_per_layer(shape: ModelShape, micro_batch: int, seq: int, tp: int, sequence_parallel: bool,
                               recompute_attention: bool = True) -> float:
    """Korthikanti et al.'s activations of one transformer layer in 16-bit, in bytes.

    ``s b h (34 + 5 a s / h)`` without parallelism; tensor parallelism divides the 24 bytes
    inside the parallel regions by ``t`` (the 10 outside stay whole unless SP splits them
    too); selective recomputation drops the ``5 a s / h`` attention-score term
    {cite}`korthikanti2022reducing`.
    """
    sbh = seq * micro_batch * shape.hidden
    scores = 0.0 if recompute_attention else 5 * shape.heads * seq / shape.hidden / tp
    outside = 10 / tp if sequence_parallel else 10
    return sbh * (outside + 24 / tp + scores)


def stashed_microbatches(pp: int, microbatches: int, chunks: int = 1) -> int:
    """Micro-batch chunks whose activations the first pipeline rank holds at once under 1F1B
    (``chunks > 1``: interleaved): its warm-up forwards plus the one before its first backward."""
    if chunks == 1:
        return min(microbatches, pp)
    return min(microbatches * chunks, pp * chunks + pp - 1)


def model_state_bytes(params_per_rank: int, dp: int, zero1: bool) -> float:
    """Mixed-precision AdamW: 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, m, v) bytes per parameter;
    ZeRO-1 shards the 12 over the data-parallel ranks."""
    return params_per_rank * (4 + (12 / dp if zero1 else 12))


# --- hardware -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes: per-GPU link bandwidth (one direction) inside a node and across nodes."""

    name: str
    nodes: int
    gpus_per_node: int
    memory_gb: float
    nvlink_gbps: float
    network_gbps: float
    bf16_tflops: float

    def __post_init__(self) -> None:
        check_positive_int(self.nodes, "nodes")
        check_positive_int(self.gpus_per_node, "gpus_per_node")
        for name in ("memory_gb", "nvlink_gbps", "network_gbps", "bf16_tflops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def bandwidth_ratio(self) -> float:
        """NVLink over network bandwidth per GPU: how much dearer a byte is between nodes."""
        return self.nvlink_gbps / self.network_gbps


def hgx_h200(nodes: int) -> Cluster:
    """HGX H200 nodes: 8 GPUs of 141 GB, NVLink 900 GB/s per GPU both ways together (450 one way)
    {cite}`h200datasheet,nvidianvlinkswitch`, one 400 Gb/s ConnectX-7 per GPU (50 GB/s)
    {cite}`dgxh100userguide,nvidiaconnectx7`, 989 dense bf16 TFLOP/s (the datasheet's 1,979 is
    with 2:4 sparsity)."""
    return Cluster("HGX H200", check_positive_int(nodes, "nodes"), 8, 141.0, 450.0, 50.0, 989.0)


# --- the planner ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    seq: int
    micro_batch: int
    global_batch: int  # sequences per optimizer step
    act_bytes: int = 2
    grad_bytes: int = 2
    mfu: float = 0.5   # the fraction of peak the matmuls reach (an assumption, shown as such)
    zero1: bool = True

    def __post_init__(self) -> None:
        for name in ("seq", "micro_batch", "global_batch", "act_bytes", "grad_bytes"):
            check_positive_int(getattr(self, name), name)
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu is a fraction of the peak, in (0, 1]; got {self.mfu!r}")


@dataclass(frozen=True)
class Candidate:
    """One configuration: its degrees, memory per GPU (GB), and its estimated step in parts (s)."""

    tp: int
    pp: int
    dp: int
    chunks: int
    microbatches: int
    memory_gb: float
    fits: bool
    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    dp_exposed_s: float
    tp_link: str
    cp: int = 1
    cp_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.cp_s + self.pp_s + self.dp_exposed_s

    @property
    def label(self) -> str:
        return (f"TP{self.tp}" + (f" CP{self.cp}" if self.cp > 1 else "") + f" PP{self.pp}"
                + (f"x{self.chunks}" if self.chunks > 1 else "") + f" DP{self.dp}")


@dataclass(frozen=True)
class Plan:
    best: Candidate | None
    candidates: list[Candidate]
    reasons: list[str] = field(default_factory=list)


def _powers_of_two_dividing(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(n)) + 1) if n % 2**i == 0]


def evaluate(shape: ModelShape, cluster: Cluster, work: Workload, tp: int, pp: int, chunks: int = 1,
             cp: int = 1) -> Candidate | None:
    """One configuration's memory and step-time estimate, or ``None`` if it does not divide.

    TP needs the query heads to divide (Megatron replicates K/V heads when ``tp`` exceeds
    their count), CP the sequence into ``2 cp`` chunks (the zigzag layout), PP the layers,
    DP the global batch into micro-batches. Groups nest from the inside out as TP, CP, PP,
    DP, so each crosses the network once the groups inside it fill a node. CP's ring
    traffic is counted as three forward rings per layer (backward passes K/V and their
    gradients) and not hidden behind attention: a conservative estimate.
    """
    if (cluster.gpus % (tp * cp * pp) or shape.layers % (pp * chunks) or shape.heads % tp
            or work.seq % (2 * cp)):
        return None
    dp = cluster.gpus // (tp * cp * pp)
    if work.global_batch % (dp * work.micro_batch):
        return None
    m = work.global_batch // (dp * work.micro_batch)
    if chunks > 1 and m % pp:
        return None
    tokens_mb = work.micro_batch * work.seq
    params_per_rank = shape.params // (tp * pp)
    layers_per_rank = shape.layers // pp
    act = (activation_bytes_per_layer(shape, work.micro_batch, work.seq // cp, tp, tp > 1) * layers_per_rank / chunks
           * stashed_microbatches(pp, m, chunks))
    memory = (model_state_bytes(params_per_rank, dp, work.zero1) + act) / GB
    flops = 6 * shape.params * work.global_batch * work.seq
    compute = flops / (cluster.gpus * cluster.bf16_tflops * 1e12 * work.mfu)
    bubble = compute * (pp - 1) / (chunks * m)
    tp_link = "NVLink" if tp <= cluster.gpus_per_node else "network"
    tp_bw = (cluster.nvlink_gbps if tp_link == "NVLink" else cluster.network_gbps) * GB
    tp_time = tensor_parallel_bytes(shape, tokens_mb * m // cp, tp, work.act_bytes, layers_per_rank) / tp_bw
    cp_bw = (cluster.network_gbps if tp * cp > cluster.gpus_per_node else cluster.nvlink_gbps) * GB
    cp_time = 3 * m * ring_attention_forward_bytes(shape, tokens_mb, cp, work.act_bytes, layers_per_rank) / tp / cp_bw
    pp_bw = (cluster.network_gbps if tp * cp * pp > cluster.gpus_per_node else cluster.nvlink_gbps) * GB
    pp_time = pipeline_bytes(shape, tokens_mb // cp, m, pp, chunks, work.act_bytes) / pp / pp_bw if pp > 1 else 0.0
    dp_bw = (cluster.network_gbps if cluster.gpus > cluster.gpus_per_node else cluster.nvlink_gbps) * GB
    dp_time = data_parallel_bytes(params_per_rank, dp, work.grad_bytes) / dp_bw if dp > 1 else 0.0
    # Gradient buckets overlap backward (two thirds of compute); only the excess is exposed.
    dp_exposed = max(0.0, dp_time - 2 / 3 * compute)
    return Candidate(tp, pp, dp, chunks, m, memory, memory <= 0.9 * cluster.memory_gb, compute, bubble,
                     tp_time, pp_time, dp_exposed, tp_link, cp, cp_time)


def plan(shape: ModelShape, cluster: Cluster, work: Workload) -> Plan:
    """Every configuration that divides, ranked, and the fastest that fits in 90% of a GPU's memory
    (with context parallelism only if nothing without it fits with TP inside a node)."""
    for value, name, kind in ((shape, "shape", ModelShape), (cluster, "cluster", Cluster), (work, "work", Workload)):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    candidates = []
    for tp in _powers_of_two_dividing(cluster.gpus):
        for cp in _powers_of_two_dividing(cluster.gpus // tp):
            for pp in range(1, shape.layers + 1):
                for chunks in (1, 2, 4) if pp > 1 else (1,):
                    c = evaluate(shape, cluster, work, tp, pp, chunks, cp)
                    if c is not None:
                        candidates.append(c)
    # The decision tree's order: context parallelism only when nothing without it fits with
    # tensor parallelism inside a node.
    cp_needed = not any(c.fits and c.cp == 1 and c.tp <= cluster.gpus_per_node for c in candidates)
    ranked = sorted(candidates, key=lambda c: (not c.fits, c.cp > 1 and not cp_needed, c.step_s))
    best = ranked[0] if ranked and ranked[0].fits else None
    return Plan(best, ranked, _explain(shape, cluster, work, best, candidates))


def _explain(shape: ModelShape, cluster: Cluster, work: Workload, best: Candidate | None,
             candidates: list[Candidate]) -> list[str]:
    states = model_state_bytes(shape.params, 1, False) / GB
    reasons = [f"{shape.params / 1e9:.2f} B parameters: {states:.0f} GB of weights, gradients and Adam states "
               f"against {cluster.memory_gb:.0f} GB per GPU."]
    if best is None:
        reasons.append("No configuration fits: more GPUs, activation recomputation of whole layers, "
                       "or ZeRO-3/FSDP are needed.")
        return reasons
    pure_dp = next((c for c in candidates if c.tp == c.pp == 1), None)
    if pure_dp is not None and pure_dp.fits:
        reasons.append("Data parallelism alone fits: it moves only gradients, once per step, overlapped with backward.")
    else:
        reasons.append("Data parallelism alone does not fit: the model must be split (TP and/or PP).")
    if best.tp > 1:
        where = (f"inside a node, on NVLink ({cluster.bandwidth_ratio:.0f}x the network's bandwidth per GPU)"
                 if best.tp_link == "NVLink" else "across nodes, on the network")
        reasons.append(f"Tensor parallelism of {best.tp}, {where}: its {4 * shape.layers // best.pp} activation "
                       f"collectives per micro-batch sit on the critical path. Sequence parallelism comes with it: "
                       f"the same bytes, and the activations outside the matmuls split too.")
    else:
        reasons.append("No tensor parallelism: what it would save in memory is not needed, and its collectives "
                       "cannot hide behind compute.")
    if best.cp > 1:
        reasons.append(f"Context parallelism of {best.cp}: at {work.seq} tokens per sequence nothing without it "
                       f"fits with TP inside a node, so the activations are split along the sequence too; its K/V "
                       f"ring runs on "
                       f"{'NVLink' if best.tp * best.cp <= cluster.gpus_per_node else 'the network'}.")
    if best.pp > 1:
        reasons.append(f"Pipeline parallelism of {best.pp} (x{best.chunks} chunks) across the remaining split: "
                       f"only activations at {best.pp * best.chunks - 1} boundaries cross, bubble "
                       f"{best.bubble_s / best.compute_s:.1%} of compute with {best.microbatches} micro-batches.")
    reasons.append(f"Data parallelism of {best.dp} for the rest: estimated step {best.step_s:.2f} s "
                   f"({best.compute_s:.2f} s of it compute at {work.mfu:.0%} MFU).")
    return reasons

