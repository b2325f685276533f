"""The economics of serving: rooflines of an engine step, Little's law, cost per token, TCO.

An engine step runs ``batch`` sequences, each ``new_tokens`` tokens past ``context`` cached
ones: a prefill is one sequence with many new tokens, a decode step many sequences with
one each. :func:`step_flops_bytes` counts what such a step must do (every matmul's FLOPs,
attention's over the visible keys) and the bytes it cannot avoid moving (every weight
once, the KV cache it reads, the KV it writes), so that their ratio, the arithmetic
intensity, says which roof bounds it: a prefill's intensity grows with its tokens and
passes the GPU's ridge point (compute-bound); a decode step's grows with the batch and,
for small batches, sits far below it (bandwidth-bound).

The cost side is arithmetic on top: a GPU hour costs what it costs, and the tokens it
yields per hour are throughput times utilization. :data:`GPUS` carries datasheet figures
(cited in the chapter); every price is an argument, never a constant here, because prices
are assumptions that change by the month.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.roofline import Work
from ..models.config import DecoderConfig
from ..validate import check_positive_int

HOURS_PER_MONTH = 730  # 8760 / 12


def _check_number(value: object, name: str, *, positive: bool = True, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if (positive and value <= 0) or (not positive and value < 0) or (at_most is not None and value > at_most):
        bound = f"in (0, {at_most}]" if at_most is not None else ("> 0" if positive else ">= 0")
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def floor_s(work: Work, tflops: float, tbps: float) -> float:
    """The roofline's lower bound on the time of ``work`` at ``tflops`` and ``tbps``."""
    return max(work.flops / (_check_number(tflops, "tflops") * 1e12), work.bytes / (_check_number(tbps, "tbps") * 1e12))


def step_flops_bytes(config: DecoderConfig, *, batch: int, new_tokens: int, context: int = 0,
                     bytes_per_element: int = 2) -> Work:
    """FLOPs and bytes of one step over ``batch`` sequences of ``new_tokens`` new tokens after
    ``context`` cached ones each, logits for each sequence's last token only (as the engine runs).

    FLOPs: ``2 x params`` per token for the layers' matmuls, the LM head once per sequence,
    and attention's ``QK^T`` and ``PV`` (``4 x heads x head_dim`` per query-key pair, each new
    token seeing the cached ones and the new ones before it). Bytes: every weight once (the
    LM head included, tied or not), the cached K and V read, the new K and V written.
    Activations are left out: at these shapes they are a small share of either count.
    """
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    check_positive_int(batch, "batch")
    check_positive_int(new_tokens, "new_tokens")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    check_positive_int(bytes_per_element, "bytes_per_element")
    h, d, i, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    hq, hk, layers = config.num_heads, config.num_kv_heads, config.num_layers
    layer_params = h * d * (2 * hq + 2 * hk) + 3 * h * i
    tokens = batch * new_tokens
    pairs = batch * (new_tokens * context + new_tokens * (new_tokens + 1) // 2)
    flops = 2 * layers * layer_params * tokens + 2 * v * h * batch + 4 * layers * hq * d * pairs
    kv_per_token = config.kv_bytes_per_token(bytes_per_element)
    weights = (layers * layer_params + v * h) * bytes_per_element
    bytes_moved = weights + kv_per_token * batch * context + kv_per_token * tokens
    return Work(float(flops), float(bytes_moved))


def ridge_point(tflops: float, tbps: float) -> float:
    """FLOP per byte at which a kernel stops being bandwidth-bound: the compute rate over the bandwidth."""
    return _check_number(tflops, "tflops") / _check_number(tbps, "tbps")


def littles_law_concurrency(arrival_rate_per_s: float, latency_s: float) -> float:
    """Little's law, ``L = lambda W``: requests in the system on average, for a stable server."""
    return _check_number(arrival_rate_per_s, "arrival_rate_per_s") * _check_number(latency_s, "latency_s")


def cost_per_million_tokens(gpu_dollars_per_hour: float, tokens_per_s: float, utilization: float = 1.0) -> float:
    """Dollars per million output tokens of one GPU that serves ``tokens_per_s`` while busy and is
    busy ``utilization`` of the hours it is paid for."""
    price = _check_number(gpu_dollars_per_hour, "gpu_dollars_per_hour")
    rate = _check_number(tokens_per_s, "tokens_per_s")
    busy = _check_number(utilization, "utilization", at_most=1.0)
    return price / (rate * 3600 * busy) * 1e6


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one data-centre GPU in its 8-GPU server (the chapter cites each)."""

    name: str
    memory_gb: float          # HBM capacity per GPU
    bandwidth_tbps: float     # HBM bandwidth per GPU
    bf16_dense_tflops: float  # dense BF16 tensor-core peak (datasheets quote twice this "with sparsity")
    gpu_power_w: float        # the GPU's maximum board power
    server_power_kw: float    # the 8-GPU server's maximum input power
    server_rack_units: int


GPUS: dict[str, GPUSpec] = {
    "H100 SXM": GPUSpec("H100 SXM", 80, 3.35, 989, 700, 10.2, 8),
    "H200 SXM": GPUSpec("H200 SXM", 141, 4.8, 989, 700, 10.2, 8),
    "B200 (HGX)": GPUSpec("B200 (HGX)", 180, 8.0, 2250, 1000, 14.3, 10),
}


def max_batch(config: DecoderConfig, gpu: GPUSpec, context: int, *, bytes_per_element: int = 2,
              memory_fraction: float = 0.9) -> int:
    """How many sequences of ``context`` tokens fit beside the weights in ``memory_fraction`` of
    ``gpu``'s memory (the rest is the activations' and the runtime's, as vLLM's
    ``gpu_memory_utilization`` leaves it); 0 when the weights alone do not fit."""
    check_positive_int(context, "context")
    usable = gpu.memory_gb * 1e9 * _check_number(memory_fraction, "memory_fraction", at_most=1.0)
    free = usable - config.num_parameters() * bytes_per_element
    return max(0, int(free // (config.kv_bytes_per_token(bytes_per_element) * context)))


@dataclass(frozen=True)
class ServingPoint:
    """One decode operating point: a batch on a GPU, its step time, throughput and cost."""

    batch: int
    step_s: float
    tokens_per_s: float
    dollars_per_million: float


def decode_operating_point(config: DecoderConfig, gpu: GPUSpec, *, batch: int, context: int,
                           dollars_per_hour: float, utilization: float = 1.0,
                           roofline_efficiency: float = 1.0) -> ServingPoint:
    """Decode at ``batch`` sequences of ``context`` tokens on ``gpu``: the step time is the
    roofline floor of :func:`step_flops_bytes` at the datasheet rates, divided by
    ``roofline_efficiency`` (the fraction of the floor an engine reaches; the chapter
    measures ours on the H200)."""
    efficiency = _check_number(roofline_efficiency, "roofline_efficiency", at_most=1.0)
    step = step_flops_bytes(config, batch=batch, new_tokens=1, context=context)
    step_s = floor_s(step, gpu.bf16_dense_tflops, gpu.bandwidth_tbps) / efficiency
    tokens_per_s = batch / step_s
    return ServingPoint(batch, step_s, tokens_per_s, cost_per_million_tokens(dollars_per_hour, tokens_per_s, utilization))


def best_batch_under_slo(config: DecoderConfig, gpu: GPUSpec, *, context: int, tpot_slo_s: float,
                         dollars_per_hour: float, utilization: float = 1.0,
                         roofline_efficiency: float = 1.0) -> ServingPoint | None:
    """The largest batch that fits ``gpu``'s memory and keeps the step time (the TPOT) within
    ``tpot_slo_s``: the cheapest tokens the SLO allows. ``None`` when not even one fits."""
    slo = _check_number(tpot_slo_s, "tpot_slo_s")
    best = None
    for batch in range(1, max_batch(config, gpu, context) + 1):
        point = decode_operating_point(config, gpu, batch=batch, context=context, dollars_per_hour=dollars_per_hour,
                                       utilization=utilization, roofline_efficiency=roofline_efficiency)
        if point.step_s > slo:
            break  # step time only grows with the batch
        best = point
    return best


def tco_dollars_per_gpu_hour(gpu: GPUSpec, *, gpu_price: float, server_overhead: float, years: float,
                             dollars_per_kwh: float, pue: float, power_draw_fraction: float,
                             dollars_per_kw_month: float) -> dict[str, float]:
    """An owned GPU's hourly cost, by part: the purchase (GPU price times ``1 + server_overhead``
    for the server, network and install, spread over ``years``), the energy (its share of the
    server's maximum power, times ``power_draw_fraction`` for the average draw, times the data
    centre's ``pue``), and the rack space, power and cooling a colocation provider charges per
    kW of the server's maximum power per month. Every argument is an assumption; none is a quote."""
    price = _check_number(gpu_price, "gpu_price")
    overhead = _check_number(server_overhead, "server_overhead", positive=False)
    hours = _check_number(years, "years") * 8760
    kw = gpu.server_power_kw / 8
    draw = _check_number(power_draw_fraction, "power_draw_fraction", at_most=1.0)
    energy = kw * draw * _check_number(pue, "pue") * _check_number(dollars_per_kwh, "dollars_per_kwh")
    parts = {"capital": price * (1 + overhead) / hours, "energy": energy,
             "rack, power and cooling": kw * _check_number(dollars_per_kw_month, "dollars_per_kw_month",
                                                           positive=False) / HOURS_PER_MONTH}
    parts["total"] = sum(parts.values())
    return parts
