"""Benchmarks of chapter ``mqa-gqa-mla``: MLA decode three ways, and the variants' quality.

``mla.decode`` times one decode step's attention for a layer of DeepSeek-V3's shape
(128 heads, latent 512, rotary key 64, nope 128, values 128, bf16), and for the 16 heads
one GPU holds when the model is split 8 ways by heads (tensor parallelism), by batch and
context:

- **absorbed**: :func:`labkit.mla.kernels.mla_decode_absorbed` over the compressed cache
  ``[batch, context, 576]``, queries already absorbed (``W_UK`` folded in);
- **naive**: the cache decompressed once into per-head keys ``[batch, heads, context,
  192]`` and values (what caching the same model's K and V would store), read by
  labkit.kvcache's split-KV kernel, the book's GQA/MHA decode kernel. That kernel takes
  one head width for keys and values, so the 128-wide values are zero-padded to 192, as
  serving stacks pad them for FlashAttention; its bytes are what it reads. Beside it,
  PyTorch's SDPA over the unpadded values (``naive_sdpa``), what a practitioner would call;
- **GQA at equal bytes**: the same kernel over a GQA cache with exactly the latent cache's
  bytes per token (4 KV heads of 72: 4 x 2 x 72 = 576), the same number of query heads.

Absorbed and naive outputs are checked against each other (and once against the float64
reference) before anything is timed. Bytes are those each kernel must move (cache, query,
output); FLOPs those of its two matmuls. The roofline time is the larger of bytes over the
measured read bandwidth and FLOPs over the measured bf16 matmul rate: at 128 heads the
absorbed kernel does 128 x 2 x (576 + 512) FLOPs per 1152 cached bytes, past the H200's
ridge, so there the tensor cores, not HBM, set the floor.

``mla.variants`` trains the book's small model with MHA, GQA, MQA and MLA attention
(:mod:`labkit.mla.variants`) and records their held-out losses.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..kvcache import decode_attention_reference
from ..kvcache import kernels as kv_kernels
from ..results import Goal
from . import kernels, variants
from .module import DEEPSEEK_V3
from .reference import absorb_query, decompress, mla_decode_absorbed_reference, unabsorb_output

CHAPTER = "mqa-gqa-mla"

# The layer's widths: DeepSeek-V3's on a GPU, small ones under the interpreter.
MLA = backend.pick(cpu=dataclasses.replace(DEEPSEEK_V3, kv_lora_rank=32, qk_nope_head_dim=16,
                                           qk_rope_head_dim=8, v_head_dim=16), gpu=DEEPSEEK_V3)
HEAD_COUNTS = backend.pick(cpu=(12, 4), gpu=(128, 16))  # multiples of GQA_KV_HEADS
BATCHES = backend.pick(cpu=(1, 2), gpu=(16, 64))
CONTEXTS = backend.pick(cpu=(33, 70), gpu=(1024, 16384))
# GQA with the latent cache's bytes per token: 4 KV heads of (latent + rope) / 8 (72 at DeepSeek's widths).
GQA_KV_HEADS = 4
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
REPS = backend.pick(cpu=1, gpu=None)
# Each timing fills about this many ms of GPU time (at least 10 calls): the sweep's four
# timings and an autotuned tile per row fit in a minute of GPU time.
TARGET_MS = 50.0
# The decompressed cache (values padded) is heads x 384 / 576 times larger than the latent
# one (85x at 128 heads): past this many bytes the naive case is skipped.
NAIVE_MAX_BYTES = backend.pick(cpu=2**30, gpu=40 * 2**30)
# The batches and contexts the bandwidth goals are held at (DeepSeek-V3's 128 heads).
GOAL_BATCH = backend.pick(cpu=2, gpu=16)


def _inputs(batch: int, heads: int, context: int, device) -> dict[str, torch.Tensor]:
    r, e, dn, dv = MLA.kv_lora_rank, MLA.qk_rope_head_dim, MLA.qk_nope_head_dim, MLA.v_head_dim
    return {
        "q_nope": check.randn(batch, heads, dn, dtype=DTYPE, device=device, seed=1),
        "q_rope": check.randn(batch, heads, e, dtype=DTYPE, device=device, seed=2),
        # The latent is RMS-normed in the model: unit scale, as randn's.
        "cache": check.randn(batch, context, r + e, dtype=DTYPE, device=device, seed=3),
        # Scaled so that decompressed keys and values have unit scale too.
        "w_uk": check.randn(heads, dn, r, dtype=DTYPE, device=device, seed=4, scale=r**-0.5),
        "w_uv": check.randn(heads, dv, r, dtype=DTYPE, device=device, seed=5, scale=r**-0.5),
    }


def _decompressed(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head K ``[B, H, L, nope + rope]`` and V zero-padded to the same width, built one
    sequence at a time so the temporaries stay small."""
    (batch, context, _), (heads, _, _) = x["cache"].shape, x["w_uk"].shape
    width, v_dim = MLA.qk_nope_head_dim + MLA.qk_rope_head_dim, MLA.v_head_dim
    k = x["cache"].new_empty(batch, heads, context, width)
    v = x["cache"].new_zeros(batch, heads, context, width)
    for b in range(batch):
        k[b:b + 1], v[b:b + 1, ..., :v_dim] = decompress(x["cache"][b:b + 1], x["w_uk"], x["w_uv"])
    return k, v


def _tile_chosen() -> str:
    """The tile the autotuner chose for the call just made (the only one under the interpreter)."""
    best = getattr(kernels._mla_decode_autotuned, "best_config", None)
    if best is None:
        return "BLOCK_H={} BLOCK_N={} warps={} stages={}".format(*kernels.CPU_TILE)
    return (f"BLOCK_H={best.kwargs['BLOCK_H']} BLOCK_N={best.kwargs['BLOCK_N']} "
            f"warps={best.num_warps} stages={best.num_stages}")


def _fit_wide_heads(config: kv_kernels.DecodeConfig, head_dim: int) -> kv_kernels.DecodeConfig:
    """labkit.kvcache's tiles were chosen for heads of 128. Its deepest one (128 positions x 3
    stages) needs 274 KB of shared memory for 192-wide heads (256 padded), more than an SM
    has (compiled for sm_90 without a GPU); such launches take the 64-position, 3-stage tile
    that kvcache uses when a few programs share an SM (141 KB here)."""
    if head_dim > 128 and config.block_n > 64:
        return dataclasses.replace(config, block_n=64, num_warps=4, num_stages=3)
    return config


@benchmark("mla.decode", chapter=CHAPTER,
           title="MLA decode attention (DeepSeek-V3 layer, bf16): absorbed over the latent cache, naive over "
                 "the decompressed cache, and GQA at equal cache bytes, by heads, batch and context")
@torch.no_grad()
def bench_decode() -> Measurement:
    limits = ceilings.limits()
    device = backend.device()
    r, e, dn, dv = MLA.kv_lora_rank, MLA.qk_rope_head_dim, MLA.qk_nope_head_dim, MLA.v_head_dim
    gqa_dim = (r + e) // (2 * GQA_KV_HEADS)
    esize = torch.finfo(DTYPE).bits // 8
    rows = []
    for heads in HEAD_COUNTS:
        for batch in BATCHES:
            for context in CONTEXTS:
                x = _inputs(batch, heads, context, device)
                q_latent = absorb_query(x["q_nope"].float(), x["w_uk"].float()).to(DTYPE)
                lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
                config = kernels.default_config(batch, heads, context)

                def absorbed(q_latent=q_latent, x=x, lengths=lengths, config=config):
                    return kernels.mla_decode_absorbed(q_latent, x["q_rope"], x["cache"], lengths, MLA.scale, config)

                o_latent = absorbed()  # on a GPU, the autotuner picks the tile for this shape here
                if batch == min(BATCHES) and context == min(CONTEXTS):
                    ref = mla_decode_absorbed_reference(q_latent, x["q_rope"], x["cache"], lengths, MLA.scale)
                    check.assert_close(o_latent, ref, dtype=DTYPE, name=f"absorbed vs float64, H={heads}")
                abs_bytes = (x["cache"].numel() + q_latent.numel() + x["q_rope"].numel() + o_latent.numel()) * esize
                abs_flops = 2 * batch * heads * context * (2 * r + e)
                t_abs = timing.measure(absorbed, reps=REPS, target_ms=TARGET_MS)
                row = {"heads": heads, "batch": batch, "context": context, "num_splits": config.num_splits,
                       "tile": _tile_chosen(),
                       "absorbed_ms": t_abs.median_ms, "absorbed_bytes": abs_bytes, "absorbed_flops": abs_flops}

                naive_cache_bytes = batch * heads * context * 2 * (dn + e) * esize  # values padded
                if naive_cache_bytes <= NAIVE_MAX_BYTES:
                    k, v = _decompressed(x)
                    q = torch.cat([x["q_nope"], x["q_rope"]], dim=-1)
                    naive_config = _fit_wide_heads(kv_kernels.default_config(batch, heads, context), dn + e)

                    def naive(q=q, k=k, v=v, lengths=lengths, naive_config=naive_config):
                        return kv_kernels.split_kv_decode(q, k, v, lengths, MLA.scale, naive_config)[..., :dv]

                    def naive_sdpa(q=q, k=k, v=v):
                        return F.scaled_dot_product_attention(q[:, :, None], k, v[..., :dv], scale=MLA.scale)[:, :, 0]

                    want = unabsorb_output(o_latent.float(), x["w_uv"].float())
                    check.assert_close(naive().float(), want, dtype=DTYPE,
                                       name=f"naive vs absorbed, H={heads} B={batch} L={context}")
                    check.assert_close(naive_sdpa().float(), want, dtype=DTYPE,
                                       name=f"naive SDPA vs absorbed, H={heads} B={batch} L={context}")
                    t_naive = timing.measure(naive, reps=REPS, target_ms=TARGET_MS)
                    t_sdpa = timing.measure(naive_sdpa, reps=REPS, target_ms=TARGET_MS)
                    io_bytes = (q.numel() + batch * heads * dv) * esize
                    naive_bytes = naive_cache_bytes + io_bytes
                    sdpa_bytes = batch * heads * context * (dn + e + dv) * esize + io_bytes
                    row.update({"naive_ms": t_naive.median_ms, "naive_bytes": naive_bytes,
                                "naive_tile": f"splits={naive_config.num_splits} BLOCK_N={naive_config.block_n} "
                                              f"warps={naive_config.num_warps} stages={naive_config.num_stages}",
                                "naive_tbps": timing.bandwidth_tbps(naive_bytes, t_naive),
                                "naive_sdpa_ms": t_sdpa.median_ms, "naive_sdpa_bytes": sdpa_bytes,
                                "naive_sdpa_tbps": timing.bandwidth_tbps(sdpa_bytes, t_sdpa),
                                "bytes_ratio": naive_bytes / abs_bytes,
                                "ours/naive": t_naive.median_ms / t_abs.median_ms,
                                "ours/naive_sdpa": t_sdpa.median_ms / t_abs.median_ms})
                    row["speedup/bytes_ratio"] = row["ours/naive"] / row["bytes_ratio"]
                    del k, v

                q_gqa = check.randn(batch, heads, gqa_dim, dtype=DTYPE, device=device, seed=6)
                k_gqa = check.randn(batch, GQA_KV_HEADS, context, gqa_dim, dtype=DTYPE, device=device, seed=7)
                v_gqa = check.randn(batch, GQA_KV_HEADS, context, gqa_dim, dtype=DTYPE, device=device, seed=8)
                gqa_config = kv_kernels.default_config(batch, GQA_KV_HEADS, context)

                def gqa(q=q_gqa, k=k_gqa, v=v_gqa, lengths=lengths, gqa_config=gqa_config):
                    return kv_kernels.split_kv_decode(q, k, v, lengths, gqa_dim**-0.5, gqa_config)

                if batch == min(BATCHES) and context == min(CONTEXTS):
                    check.assert_close(gqa(), decode_attention_reference(q_gqa, k_gqa, v_gqa, lengths, gqa_dim**-0.5),
                                       dtype=DTYPE, name=f"GQA vs float64, H={heads}")
                t_gqa = timing.measure(gqa, reps=REPS, target_ms=TARGET_MS)
                gqa_bytes = (k_gqa.numel() + v_gqa.numel() + 2 * q_gqa.numel()) * esize
                tbps = timing.bandwidth_tbps(abs_bytes, t_abs)
                # A call this short pays a launch's fixed costs over few bytes: a bare read of
                # the same bytes, timed the same way, is the fair bound for it.
                same_size_read = ceilings.read_bandwidth_at_tbps(abs_bytes)
                roofline_ms = max(abs_bytes / (limits["read_tbps"] * 1e9),
                                  abs_flops / (limits["matmul_bf16_tflops"] * 1e9))
                row.update({
                    "absorbed_tbps": tbps, "absorbed_tflops": timing.tflops(abs_flops, t_abs),
                    "ours/limit": tbps / limits["read_tbps"],
                    "same_size_read_tbps": same_size_read, "ours/same-size read": tbps / same_size_read,
                    "bound": "compute" if abs_flops / limits["matmul_bf16_tflops"] > abs_bytes / limits["read_tbps"]
                             else "memory",
                    "roofline_ms": roofline_ms, "ours/roofline": roofline_ms / t_abs.median_ms,
                    "gqa_ms": t_gqa.median_ms, "gqa_bytes": gqa_bytes,
                    "gqa_tbps": timing.bandwidth_tbps(gqa_bytes, t_gqa),
                    "ours/gqa": t_gqa.median_ms / t_abs.median_ms,
                })
                rows.append(row)
                del x
    goals = []
    for heads in HEAD_COUNTS:
        big = [r for r in rows if r["heads"] == heads and r["batch"] >= GOAL_BATCH]
        goals.append(Goal(f"ours/limit, {heads} heads (min over batch >= {GOAL_BATCH})",
                          min(r["ours/limit"] for r in big), ">=", 0.75))
        with_naive = [r for r in big if "ours/naive" in r]
        if with_naive:
            goals.append(Goal(f"speedup over naive / byte ratio, {heads} heads (min over batch >= {GOAL_BATCH})",
                              min(r["speedup/bytes_ratio"] for r in with_naive), ">=", 0.8))
    return Measurement(
        rows=rows, limits=limits, goals=goals,
        metric="ms per decode attention call; TB/s of cache + queries + output; ours/limit against the read "
               "bandwidth; ours/same-size read against one pass of labkit.memory.read_sum over the same bytes; "
               "ours/roofline against max(bytes / read bandwidth, FLOPs / bf16 matmul rate)",
        config={
            "mla": dataclasses.asdict(MLA), "dtype": str(DTYPE).replace("torch.", ""), "goal_batch": GOAL_BATCH,
            "lengths": "all equal to context", "softmax_scale": MLA.scale,
            "gqa": f"{GQA_KV_HEADS} KV heads of {gqa_dim} (the latent cache's bytes per token), "
                   f"same query heads, labkit.kvcache split-KV kernel",
            "naive": "cache decompressed once into per-head K [.., nope+rope] and V zero-padded to the same width, "
                     "labkit.kvcache split-KV kernel; skipped past "
                     f"{NAIVE_MAX_BYTES} bytes of decompressed cache",
            "naive_sdpa": f"torch.nn.functional.scaled_dot_product_attention over the same K and unpadded V "
                          f"[.., v_head_dim], torch {torch.__version__}",
            "tile": "(BLOCK_H, BLOCK_N, warps, stages) chosen by triton.autotune among "
                    f"{list(kernels.GPU_TILES)} on a GPU",
            # Records before this key planned their split counts for 64-head blocks.
            "split_plan": f"labkit.mla.kernels.default_config: {kernels.PROGRAMS_PER_SM} programs per SM of "
                          f"{kernels.PLAN_BLOCK_H} heads, at least {kernels.MIN_TILES_PER_SPLIT} tiles of "
                          f"{kernels.PLAN_BLOCK_N} rows a split, at most {kernels.MAX_SPLITS} splits",
        })


@benchmark("mla.variants", chapter=CHAPTER,
           title="The book's small model trained with MHA, GQA, MQA and MLA attention on the same bytes: "
                 "held-out loss against KV cache per token")
def bench_variants() -> Measurement:
    s = variants.setup()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 tensor cores: the runs fit in a couple of minutes
    try:
        rows = variants.train_variants(s)
    finally:
        torch.set_float32_matmul_precision(previous)
    return Measurement(
        rows=rows, metric="held-out next-byte loss (nats and bits per byte) after the same training",
        config={**dataclasses.asdict(s), "mla": dataclasses.asdict(variants.mla_config(s)),
                "optimizer": "AdamW (0.9, 0.95), warmup 10%, cosine to 0.1 lr, clip 1.0 (labkit.models.train_lm)",
                "precision": "fp32 weights, TF32 matmuls" if backend.on_gpu() else "fp32",
                "data": "labkit.models.stdlib_corpus (Python standard library source, bytes), held out by file"})
