"""What serving an MoE layer costs each GPU under expert, tensor and data parallelism.

One MoE layer's forward over a batch of ``N`` tokens on ``G`` GPUs, with routing assumed
uniform (every expert gets ``N*k/E`` rows; ``imbalance`` scales the busiest GPU's load):

- **EP** (expert parallel; attention runs data-parallel): each GPU holds ``E/G`` whole
  experts and ``N/G`` tokens. Dispatch sends each of its ``N/G * k`` rows to the owner of
  the chosen expert, a fraction ``(G-1)/G`` of them to another GPU; combine sends as many
  back. Bytes sent per GPU: ``2 * (N/G) * k * H * b * (G-1)/G``.
- **TP** (tensor parallel): each GPU holds ``1/G`` of every expert (a slice of the
  intermediate dimension) and sees all ``N`` tokens; the partial outputs are summed with
  an all-reduce of ``[N, H]``, which a ring does by sending ``2 * (G-1)/G * N * H * b``.
- **DP** (replicated experts): each GPU holds every expert and ``N/G`` tokens: no
  communication in the layer, ``G`` times the weight memory, and each expert sees only
  ``N*k/(E*G)`` rows, so its weights are read for a small GEMM.

So EP over TP sends ``k/G`` as many bytes: EP wins whenever a token visits fewer experts
than there are GPUs. The FLOPs per GPU are the same in all three; what differs is bytes on
the links, weight memory, and how many rows each expert GEMM gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_positive_int

STRATEGIES = ("EP", "TP", "DP")


@dataclass(frozen=True)
class LayerTraffic:
    """Per GPU, for one MoE layer's forward."""

    strategy: str
    bytes_sent: float          # over the GPU-to-GPU links
    link_time_us: float        # bytes_sent at the link's one-way bandwidth
    weight_bytes: float        # expert weights resident on this GPU
    weight_read_time_us: float  # reading them once from HBM (decode is bound by this)
    rows_per_expert_gemm: float
    flops: float


def layer_traffic(
    strategy: str, *, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int,
    gpus: int, hbm_tbps: float, bytes_per_element: int = 2, link_gbps: float = 450.0,
    imbalance: float = 1.0,
) -> LayerTraffic:
    """The cost of one MoE layer per GPU under ``strategy`` (``"EP"``, ``"TP"`` or ``"DP"``).

    ``link_gbps``: one-way GPU-to-GPU bandwidth in GB/s (NVLink 4 on an H200: 900 GB/s
    both ways, so 450 one way, from the datasheet); ``hbm_tbps``: the HBM rate weights are
read at, which the chapter takes from a measured copy bandwidth.
    ``imbalance`` (>= 1): the busiest expert's load over the mean; under EP its GPU receives
    and computes that much more (TP and DP split tokens evenly and do not feel it).
    """
    check_choice(strategy, "strategy", STRATEGIES)
    for value, name in ((tokens, "tokens"), (hidden, "hidden"), (intermediate, "intermediate"),
                        (experts, "experts"), (top_k, "top_k"), (gpus, "gpus"),
                        (bytes_per_element, "bytes_per_element")):
        check_positive_int(value, name)
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) cannot exceed experts ({experts})")
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
    if strategy == "EP":
        sent = 2 * (n / g) * k * h * b * (g - 1) / g * imbalance
        weights = experts / g * expert_bytes
        rows = n * k / experts * imbalance
    elif strategy == "TP":
        sent = 2 * (g - 1) / g * n * h * b
        weights = experts * expert_bytes / g
        rows = n * k / experts
    else:
        sent = 0.0
        weights = experts * expert_bytes
        rows = n * k / (experts * g)
    return LayerTraffic(
        strategy=strategy,
        bytes_sent=sent,
        link_time_us=sent / (link_gbps * 1e9) * 1e6,
        weight_bytes=weights,
        weight_read_time_us=weights / (hbm_tbps * 1e12) * 1e6,
        rows_per_expert_gemm=rows,
        flops=flops,
    )
