"""What serving an MoE layer costs each GPU under expert, tensor and data parallelism.

One MoE layer's forward over a batch of ``N`` tokens on ``G`` GPUs, with routing assumed
uniform (every expert gets ``N*k/E`` rows; ``imbalance`` scales the busiest GPU's load):

- **EP** (expert parallel; attention runs data-parallel): each GPU holds ``E/G`` whole
  experts and ``N/G`` tokens. Dispatch sends each token once to every *other GPU* that
  owns one of its ``k`` experts, however many of that GPU's experts it chose (as DeepEP
  does: the receiver fans the row out to its experts); combine sends each GPU's sum of
  its experts' outputs for the token back, one row per GPU. With the ``k`` experts drawn
  uniformly without replacement, a token reaches ``(G-1) * (1 - C(E - E/G, k) / C(E, k))``
  other GPUs on average, at most ``min(k, G-1)``. Sending every (token, choice) pair
  separately instead costs ``k * (G-1)/G`` rows per token.
- **TP** (tensor parallel): each GPU holds ``1/G`` of every expert (a slice of the
  intermediate dimension) and sees all ``N`` tokens; the partial outputs are summed with
  an all-reduce of ``[N, H]``, which a ring does by sending ``2 * (G-1)/G * N * H * b``.
- **DP** (replicated experts): each GPU holds every expert and ``N/G`` tokens: no
  communication in the layer, ``G`` times the weight memory, and each expert sees only
  ``N*k/(E*G)`` rows, so its weights are read for a small GEMM.

Per pair, EP would send ``k/G`` of TP's bytes; deduplicated, less. The FLOPs per GPU are
the same in all three; what differs is bytes on the links, weight memory, and how many
rows each expert GEMM gets.

Link time is ``latency + bytes / bandwidth``. The latency term counts the collective calls
on the layer's critical path and the sequential steps inside them: EP makes two
all-to-alls (dispatch, combine), each one step since every GPU sends to all others at
once; TP's ring all-reduce takes ``2(G-1)`` steps; DP makes no call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..collectives.cost import steps_and_bytes
from ..validate import check_choice, check_positive_int

STRATEGIES = ("EP", "TP", "DP")


@dataclass(frozen=True)
class LayerTraffic:
    """Per GPU, for one MoE layer's forward."""

    strategy: str
    bytes_sent: float          # over the GPU-to-GPU links
    bytes_per_pair: float      # what EP would send with one row per (token, choice); = bytes_sent otherwise
    latency_us: float          # calls and sequential steps on the critical path, at the given latencies
    link_time_us: float        # latency_us + bytes_sent at the link's one-way bandwidth
    weight_bytes: float        # expert weights resident on this GPU
    weight_read_time_us: float  # reading them once from HBM (decode is bound by this)
    rows_per_expert_gemm: float
    flops: float


def remote_gpus_per_token(experts: int, top_k: int, gpus: int) -> float:
    """Expected number of *other* GPUs a token's ``top_k`` experts live on, experts spread
    ``experts / gpus`` per GPU and chosen uniformly without replacement."""
    for value, name in ((experts, "experts"), (top_k, "top_k"), (gpus, "gpus")):
        check_positive_int(value, name)
    if top_k > experts or experts % gpus:
        raise ValueError(f"need top_k <= experts and experts divisible by gpus, got {top_k}, {experts}, {gpus}")
    none_on_a_gpu = math.comb(experts - experts // gpus, top_k) / math.comb(experts, top_k)
    return (gpus - 1) * (1 - none_on_a_gpu)


def layer_traffic(
    strategy: str, *, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int,
    gpus: int, hbm_tbps: float, bytes_per_element: int = 2, link_gbps: float = 450.0,
    imbalance: float = 1.0, call_latency_us: float = 0.0, step_latency_us: float = 0.0,
) -> LayerTraffic:
    """The cost of one MoE layer per GPU under ``strategy`` (``"EP"``, ``"TP"`` or ``"DP"``).

    ``link_gbps``: one-way GPU-to-GPU bandwidth in GB/s (NVLink 4 on an H200: 900 GB/s
    both ways, so 450 one way, from the datasheet); ``hbm_tbps``: the HBM rate weights are
read at, which the chapter takes from a measured copy bandwidth.
    ``imbalance`` (>= 1): the busiest expert's load over the mean; under EP its GPU receives
    and computes that much more (TP and DP split tokens evenly and do not feel it).
    ``call_latency_us`` and ``step_latency_us``: the fixed cost of a collective call and of
    each sequential step inside it (0 by default: bandwidth only).
    """
    check_choice(strategy, "strategy", STRATEGIES)
    for value, name in ((tokens, "tokens"), (hidden, "hidden"), (intermediate, "intermediate"),
                        (experts, "experts"), (top_k, "top_k"), (gpus, "gpus"),
                        (bytes_per_element, "bytes_per_element")):
        check_positive_int(value, name)
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) cannot exceed experts ({experts})")
    for value, name in ((call_latency_us, "call_latency_us"), (step_latency_us, "step_latency_us")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    for value, name in ((link_gbps, "link_gbps"), (hbm_tbps, "hbm_tbps")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or imbalance < 1:
        raise ValueError(f"imbalance must be a number >= 1, got {imbalance!r}")
    if strategy == "EP" and experts % gpus:
        raise ValueError(f"EP needs the {experts} experts to divide among {gpus} GPUs")

    b, n, h, k, g = bytes_per_element, tokens, hidden, top_k, gpus
    expert_bytes = 3 * h * intermediate * b  # gate, up, down
    # Only EP ties a GPU's work to its experts' popularity; TP and DP split tokens evenly.
    load = imbalance if strategy == "EP" else 1.0
    flops = 6.0 * n * k * h * intermediate / g * load
    row_bytes = h * b
    if strategy == "EP":
        sent = 2 * (n / g) * row_bytes * remote_gpus_per_token(experts, k, g) * imbalance
        per_pair = 2 * (n / g) * row_bytes * k * (g - 1) / g * imbalance
        latency = 2 * (call_latency_us + step_latency_us) if g > 1 else 0.0
        weights = experts / g * expert_bytes
        rows = n * k / experts * imbalance
    elif strategy == "TP":
        steps, per_byte = steps_and_bytes("ring_all_reduce", g)
        sent = per_pair = per_byte * n * row_bytes
        latency = call_latency_us + steps * step_latency_us if g > 1 else 0.0
        weights = experts * expert_bytes / g
        rows = n * k / experts
    else:
        sent = per_pair = latency = 0.0
        weights = experts * expert_bytes
        rows = n * k / (experts * g)
    return LayerTraffic(
        strategy=strategy,
        bytes_sent=sent,
        bytes_per_pair=per_pair,
        latency_us=latency,
        link_time_us=latency + sent / (link_gbps * 1e9) * 1e6,
        weight_bytes=weights,
        weight_read_time_us=weights / (hbm_tbps * 1e12) * 1e6,
        rows_per_expert_gemm=rows,
        flops=flops,
    )
