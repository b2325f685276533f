"""The FlashAttention chapter's benchmarks: our kernels beside every SDPA backend.

Shapes follow FlashAttention-2's benchmarks: 16k tokens per call (batch = 16384 / seq) and
a model width of 2048 (heads = 2048 / head_dim), bf16, so every point does comparable work
and the sweep over sequence length shows where each kernel runs out of parallelism or
bandwidth. Rates are matmul TFLOP/s by :func:`labkit.attention.cost.attention_flops`.

The references are ``torch.nn.functional.scaled_dot_product_attention`` pinned to one
backend at a time with ``torch.nn.attention.sdpa_kernel``: FlashAttention-2 (the flash
backend), cuDNN's fused attention, and the memory-efficient (xFormers-derived) kernel. A
backend that refuses a shape or a device raises; the row then records ``None`` and the
record's config says why.

``attention.variants`` measures what a caller gets beyond bf16 self-attention, at one
length and the models' head dimension 128: fp32 inputs (multiplied in TF32), forward and
backward, against SDPA's memory-efficient backend on the same inputs (the bf16 rate at
the same shape is in ``attention.forward`` / ``attention.backward``); and the forward of a
chunk of queries attending to a longer prefix of keys with the causal mask aligned to the
bottom right (chunked prefill, an inference step), against the flash backend given the
same mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import FP32_INPUT_TOLERANCE, flash_attention, kernels
from .cost import attention_flops

CHAPTER = "flash-attention"
DTYPE = torch.bfloat16
TOKENS = backend.pick(cpu=32, gpu=16384)
MODEL_WIDTH = backend.pick(cpu=32, gpu=2048)
SEQS = backend.pick(cpu=(16, 32), gpu=(1024, 2048, 4096, 8192, 16384))
HEAD_DIMS = backend.pick(cpu=(16,), gpu=(64, 128))
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
GOAL_MIN_SEQ = backend.pick(cpu=0, gpu=2048)  # the goals speak of long sequences


def shape_for(seq: int, head_dim: int) -> tuple[int, int, int, int]:
    return (TOKENS // seq, MODEL_WIDTH // head_dim, seq, head_dim)


def _inputs(shape, *, grad: bool, dtype: torch.dtype = DTYPE, n_keys: int | None = None):
    """q of ``shape`` (batch, heads, n_queries, head_dim); k, v with ``n_keys`` keys."""
    dev = backend.device()
    kv_shape = (*shape[:2], n_keys or shape[2], shape[3])
    qkv = [check.randn(*s, dtype=dtype, device=dev, seed=seed)
           for s, seed in ((shape, 1), (kv_shape, 2), (kv_shape, 3))]
    return [t.requires_grad_(grad) for t in qkv]


def _sdpa_mask(causal: bool, n_queries: int, n_keys: int) -> dict:
    """SDPA's arguments for our causal convention: bottom-right aligned when lengths differ."""
    if causal and n_keys != n_queries:
        return {"attn_mask": causal_lower_right(n_queries, n_keys)}
    return {"is_causal": causal}


def _check_against_sdpa(causal: bool, head_dim: int, dtype: torch.dtype = DTYPE, prefix: int = 0) -> None:
    """Before timing anything: ours agrees with SDPA (math backend, fp32) at an odd length."""
    n = backend.pick(cpu=37, gpu=1000)
    q, k, v = _inputs((1, 2, n, head_dim), grad=False, dtype=dtype, n_keys=n + prefix)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **_sdpa_mask(causal, n, n + prefix))
    tol = FP32_INPUT_TOLERANCE if dtype == torch.float32 else check.tolerance(dtype)  # fp32: TF32 matmuls
    check.assert_close(flash_attention(q, k, v, causal=causal), ref, tol=tol,
                       name=f"flash_attention(causal={causal}, d={head_dim}, {dtype}, {prefix} extra keys)")


def _sdpa_call(which: SDPBackend, q, k, v, causal: bool):
    mask = _sdpa_mask(causal, q.shape[2], k.shape[2])

    def call():
        with sdpa_kernel([which]):
            return F.scaled_dot_product_attention(q, k, v, **mask)
    return call


def _rate(fn, flops: float, **kw) -> float:
    return timing.tflops(flops, timing.measure(fn, **kw))


def _grad_call(forward, q, k, v):
    """A backward-only call: the forward runs once, then its graph is differentiated again."""
    o = forward()
    do = torch.randn_like(o)
    return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


def _sweep(mode: str) -> tuple[list[dict], dict[str, str]]:
    rows, skipped = [], {}
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            _check_against_sdpa(causal, head_dim)
            for seq in SEQS:
                shape = shape_for(seq, head_dim)
                flops = attention_flops(*shape, causal=causal, backward=mode == "backward")
                q, k, v = _inputs(shape, grad=mode == "backward")
                row = {"head_dim": head_dim, "causal": causal, "seq": seq,
                       "batch": shape[0], "heads": shape[1]}

                def ours():
                    return flash_attention(q, k, v, causal=causal)

                if mode == "forward":
                    row["ours_tflops"] = _rate(ours, flops)
                    # The FA1-ordered kernel is a teaching step: a few repetitions suffice.
                    row["fa1_order_tflops"] = _rate(
                        lambda: kernels.forward_fa1(q, k, v, causal, head_dim**-0.5), flops,
                        warmup=1, reps=5)
                else:
                    row["ours_tflops"] = _rate(_grad_call(ours, q, k, v), flops)
                for name, which in SDPA_BACKENDS.items():
                    try:
                        call = _sdpa_call(which, q, k, v, causal)
                        if mode == "backward":
                            call = _grad_call(call, q, k, v)
                        row[f"{name}_tflops"] = _rate(call, flops)
                    except RuntimeError as e:  # the backend refused this shape or device
                        row[f"{name}_tflops"] = None
                        skipped.setdefault(name, str(e).splitlines()[0][:200])
                rows.append(row)
                del q, k, v
    return rows, skipped


def _add_ratios(rows: list[dict], matmul_tflops: float) -> None:
    for r in rows:
        for name in SDPA_BACKENDS:
            theirs = r[f"{name}_tflops"]
            r[f"ours/{name}"] = r["ours_tflops"] / theirs if theirs else None
        r["ours/limit"] = r["ours_tflops"] / matmul_tflops


def _min_ratio_goal(rows: list[dict], column: str, threshold: float, what: str) -> list[Goal]:
    values = [r[column] for r in rows if r["seq"] >= GOAL_MIN_SEQ and r[column] is not None]
    if not values:  # the reference backend ran nowhere (CPU): no goal to hold
        return []
    return [Goal(f"{what}: min {column}, seq >= {GOAL_MIN_SEQ}", min(values), ">=", threshold)]


def _measure(mode: str, goals: dict[str, float]) -> Measurement:
    lim = ceilings.limits()
    rows, skipped = _sweep(mode)
    _add_ratios(rows, lim["matmul_bf16_tflops"])
    return Measurement(
        rows=rows,
        metric="TFLOP/s (matmul FLOPs: 4 B H N^2 d forward, half if causal, x2.5 backward)",
        limits=lim,
        goals=[g for column, threshold in goals.items()
               for g in _min_ratio_goal(rows, column, threshold, mode)],
        config={"dtype": "bfloat16", "tokens_per_call": TOKENS, "model_width": MODEL_WIDTH,
                "seqs": list(SEQS), "head_dims": list(HEAD_DIMS), "sdpa_skipped": skipped,
                "reference_check": "torch SDPA (math, fp32) at an odd length, before timing",
                "autotuned": kernels.autotuned_choices()},
    )


@benchmark("attention.forward", chapter=CHAPTER,
           title="FlashAttention forward: ours (FA2 and FA1 order) vs SDPA backends")
def forward_benchmark() -> Measurement:
    return _measure("forward", {"ours/sdpa_flash": 1.1, "ours/sdpa_cudnn": 0.8})


@benchmark("attention.backward", chapter=CHAPTER,
           title="FlashAttention backward: ours vs SDPA backends")
def backward_benchmark() -> Measurement:
    return _measure("backward", {"ours/sdpa_flash": 1.0})


VARIANT_SEQ = backend.pick(cpu=32, gpu=4096)
VARIANT_HEAD_DIM = backend.pick(cpu=16, gpu=128)
PREFIX_QUERIES = backend.pick(cpu=9, gpu=512)  # a chunk of new queries after VARIANT_SEQ - this keys


def _timed_pair(row: dict, q, k, v, causal: bool, flops: float, mode: str, reference: str,
                skipped: dict[str, str]) -> dict:
    """Ours and one SDPA backend on the same inputs: TFLOP/s of each and ``ours/<reference>``."""
    def prepare(call):
        return _grad_call(call, q, k, v) if mode == "backward" else call

    row = {**row, "mode": mode, "ours_tflops": _rate(prepare(lambda: flash_attention(q, k, v, causal=causal)), flops)}
    try:
        row[f"{reference}_tflops"] = _rate(prepare(_sdpa_call(SDPA_BACKENDS[reference], q, k, v, causal)), flops)
    except RuntimeError as e:  # the backend refused this shape, dtype or mask
        row[f"{reference}_tflops"] = None
        skipped.setdefault(reference, str(e).splitlines()[0][:200])
    theirs = row[f"{reference}_tflops"]
    row[f"ours/{reference}"] = row["ours_tflops"] / theirs if theirs else None
    return row


@benchmark("attention.variants", chapter=CHAPTER,
           title="FlashAttention variants: fp32 inputs (TF32), and queries after a prefix of keys")
def variants_benchmark() -> Measurement:
    lim = ceilings.limits()
    rows, skipped = [], {}
    head_dim = VARIANT_HEAD_DIM
    batch, heads, seq, _ = shape_for(VARIANT_SEQ, head_dim)
    _check_against_sdpa(False, head_dim, torch.float32)
    for mode in ("forward", "backward"):
        q, k, v = _inputs((batch, heads, seq, head_dim), grad=mode == "backward", dtype=torch.float32)
        flops = attention_flops(batch, heads, seq, head_dim, backward=mode == "backward")
        rows.append(_timed_pair({"variant": "self", "dtype": "float32", "head_dim": head_dim,
                                 "n_queries": seq, "n_keys": seq, "causal": False},
                                q, k, v, False, flops, mode, "sdpa_efficient", skipped))
    # Chunked prefill: PREFIX_QUERIES new queries, causal over every earlier key; forward only.
    _check_against_sdpa(True, head_dim, DTYPE, prefix=VARIANT_SEQ - PREFIX_QUERIES)
    q, k, v = _inputs((batch, heads, PREFIX_QUERIES, head_dim), grad=False, n_keys=seq)
    flops = attention_flops(batch, heads, PREFIX_QUERIES, head_dim, causal=True, seq_k=seq)
    rows.append(_timed_pair({"variant": "prefix", "dtype": "bfloat16", "head_dim": head_dim,
                             "n_queries": PREFIX_QUERIES, "n_keys": seq, "causal": True},
                            q, k, v, True, flops, "forward", "sdpa_flash", skipped))
    for r in rows:
        r["ours/limit"] = r["ours_tflops"] / lim["matmul_bf16_tflops"]
    return Measurement(
        rows=rows,
        metric="TFLOP/s (matmul FLOPs; causal counts the visible pairs, bottom-right aligned)",
        limits=lim,
        config={"tokens_per_call": TOKENS, "model_width": MODEL_WIDTH, "seq": VARIANT_SEQ,
                "prefix_queries": PREFIX_QUERIES, "head_dim": VARIANT_HEAD_DIM,
                "fp32": "ours multiplies fp32 inputs in TF32 (Triton's default input precision); "
                        "SDPA memory-efficient runs its own fp32 path on the same inputs",
                "prefix_reference": "SDPA flash backend with attn_mask=causal_lower_right(n_queries, n_keys)",
                "limit": "ours/limit is against the bf16 matmul rate, for every dtype",
                "reference_check": "torch SDPA (math, fp32) at an odd length, before timing",
                "autotuned": kernels.autotuned_choices()},
    )
