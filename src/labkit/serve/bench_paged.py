"""Benchmarks of chapter ``paged-attention``: the paged decode kernel against the contiguous
split-KV kernel over the same cache contents and against the read limit, by batch, context
and block size; and the paged prefill against SDPA.

The paged and the contiguous kernel are one Triton kernel compiled two ways (see
:mod:`labkit.kvcache.kernels`), launched with the same splits and tile
(:func:`~labkit.kvcache.kernels.paged_config` adds pipeline stages for the table load and
caps the warps), so the ratio between them is the price of reading K and V through a block table: one
table load per tile, and rows of one head that are ``kv_heads x head_dim`` elements apart
in a block instead of adjacent. The pool's blocks are handed out in a random order, as a
block manager's free list leaves them after some churn. Every paged output is checked
against the contiguous kernel and SDPA before anything is timed.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, models, timing
from ..benchmarks import Measurement, benchmark
from ..kvcache import kernels
from ..results import Goal
from .attention import paged_prefill_attention
from .paged_cache import paged_copy

CHAPTER = "paged-attention"

# Attention shapes (q_heads, kv_heads, head_dim) from the book's configs: the engine's
# Qwen3-0.6B (group 2) and the book's GPU model (Qwen3-4B layers, group 4).
_SHAPE_CONFIGS = backend.pick(cpu={"TINY": models.TINY},
                              gpu={"Qwen3-0.6B": models.QWEN3_SIZES["Qwen3-0.6B"], "BOOK_GPU": models.BOOK_GPU})
SHAPES = {name: (c.num_heads, c.num_kv_heads, c.head_dim) for name, c in _SHAPE_CONFIGS.items()}
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
REPS = backend.pick(cpu=1, gpu=None)
# vLLM's default block size on GPUs; the interpreter's 16-position tile then spans two blocks of 8.
BLOCK_SIZE = backend.pick(cpu=8, gpu=16)


# The goals hold from this batch up: enough sequences to fill the GPU without splits.
GOAL_MIN_BATCH = backend.pick(cpu=2, gpu=16)


@benchmark("serve.paged_decode", chapter=CHAPTER,
           title="Paged decode attention (block size 16, bf16) against the contiguous split-KV kernel over "
                 "the same cache contents and against the read limit, by batch, context and block size")
def bench_paged_decode() -> Measurement:
    limits = ceilings.limits()
    batches = backend.pick(cpu=[1, 2], gpu=[1, 4, 16, 64])
    contexts = backend.pick(cpu=[40, 96], gpu=[1024, 4096, 16384])
    # A second sweep: one shape, block sizes from 8 to 256 positions.
    sweep_at = backend.pick(cpu=(2, 96), gpu=(16, 4096))
    block_sizes = backend.pick(cpu=[4, 8, 16, 32], gpu=[8, 16, 32, 64, 128, 256])
    cases = [(shape, batch, context, BLOCK_SIZE) for shape in SHAPES for batch in batches for context in contexts]
    cases += [(shape, *sweep_at, bs) for shape in SHAPES for bs in block_sizes if bs != BLOCK_SIZE]
    rows = []
    for shape, batch, context, block_size in cases:
        q_heads, kv_heads, head_dim = SHAPES[shape]
        dev = backend.device()
        q = check.randn(batch, q_heads, head_dim, dtype=DTYPE, device=dev, seed=1)
        k = check.randn(batch, kv_heads, context, head_dim, dtype=DTYPE, device=dev, seed=2)
        v = check.randn(batch, kv_heads, context, head_dim, dtype=DTYPE, device=dev, seed=3)
        k_pool, tables = paged_copy(k, block_size, seed=4)
        v_pool, _ = paged_copy(v, block_size, seed=4)  # the same seed: the same block order as K
        lengths = torch.full((batch,), context, dtype=torch.int32, device=dev)
        config = kernels.default_config(batch, kv_heads, context)
        paged_config = kernels.paged_config(batch, kv_heads, context, head_dim=head_dim,
                                            element_size=k_pool.element_size())
        scale = head_dim**-0.5

        def paged(q=q, k_pool=k_pool, v_pool=v_pool, tables=tables, lengths=lengths, config=paged_config):
            return kernels.paged_split_kv_decode(q, k_pool, v_pool, tables, lengths, scale, config)

        def contiguous(q=q, k=k, v=v, lengths=lengths, config=config):
            return kernels.split_kv_decode(q, k, v, lengths, scale, config)

        name = f"{shape} B={batch} L={context} block {block_size}"
        sdpa = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
        check.assert_close(paged(), sdpa.float(), dtype=DTYPE, name=f"paged vs SDPA, {name}")
        check.assert_close(paged(), contiguous().float(), dtype=DTYPE, name=f"paged vs contiguous, {name}")
        moved = (k.numel() + v.numel() + 2 * q.numel()) * q.element_size()
        t_paged, t_contiguous = timing.measure(paged, reps=REPS), timing.measure(contiguous, reps=REPS)
        tbps = timing.bandwidth_tbps(moved, t_paged)
        same_size_read = ceilings.read_bandwidth_at_tbps(moved)
        rows.append({
            "shape": shape, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "batch": batch, "context": context, "block_size": block_size,
            "num_splits": config.num_splits, "block_n": config.block_n, "num_warps": config.num_warps,
            "paged_warps": paged_config.num_warps,
            "contiguous_stages": config.num_stages, "paged_stages": paged_config.num_stages, "bytes": moved,
            "paged_ms": t_paged.median_ms, "contiguous_ms": t_contiguous.median_ms,
            "paged_tbps": tbps, "contiguous_tbps": timing.bandwidth_tbps(moved, t_contiguous),
            "ours/contiguous": t_contiguous.median_ms / t_paged.median_ms,
            "ours/limit": tbps / limits["read_tbps"],
            "same_size_read_tbps": same_size_read, "ours/same-size read": tbps / same_size_read,
        })
        del k, v, k_pool, v_pool
    main = [r for r in rows if r["block_size"] == BLOCK_SIZE and r["batch"] >= GOAL_MIN_BATCH]
    goals = [
        Goal(f"ours/contiguous (min over batch >= {GOAL_MIN_BATCH}, block size {BLOCK_SIZE})",
             min(r["ours/contiguous"] for r in main), ">=", 0.95),
        Goal(f"ours/limit (min over batch >= {GOAL_MIN_BATCH}, block size {BLOCK_SIZE})",
             min(r["ours/limit"] for r in main), ">=", 0.75),
    ]
    return Measurement(
        rows=rows, metric="TB/s of cache + query + output; ours/limit against the read-only bandwidth, "
                          "ours/contiguous = contiguous time / paged time, ours/same-size read against one "
                          "read_sum pass over as many bytes (ceilings.read_bandwidth_at_tbps)",
        limits=limits, goals=goals,
        config={"dtype": str(DTYPE).replace("torch.", ""), "block_size": BLOCK_SIZE, "goal_min_batch": GOAL_MIN_BATCH,
                "shapes": {name: list(s) for name, s in SHAPES.items()}, "lengths": "all equal to context",
                "block_size_sweep": {"batch": sweep_at[0], "context": sweep_at[1], "block_sizes": block_sizes},
                "pool": "the contiguous cache's contents, blocks in a random order (a shuffled free list)",
                "launch": "contiguous: labkit.kvcache.kernels.default_config(batch, kv_heads, context); paged: "
                          f"paged_config (the same splits and tile, {kernels.PAGED_EXTRA_STAGES} more "
                          f"pipeline stage(s), at most {kernels.PAGED_MAX_WARPS} warps)"},
    )


@benchmark("serve.paged_prefill", chapter=CHAPTER,
           title="Paged prefill (packed causal queries through block tables, bf16) against SDPA on "
                 "contiguous copies, with and without a cached prefix")
def bench_paged_prefill() -> Measurement:
    limits = ceilings.limits()
    # (sequences, new tokens each, cached prefix each)
    cases = backend.pick(cpu=[(2, 24, 0), (2, 9, 30)], gpu=[(8, 1024, 0), (4, 4096, 0), (8, 512, 3584)])
    rows = []
    for shape, (q_heads, kv_heads, head_dim) in SHAPES.items():
        for seqs, new, prefix in cases:
            dev = backend.device()
            length = prefix + new
            capacity = -(-length // BLOCK_SIZE) * BLOCK_SIZE
            q = check.randn(seqs, q_heads, new, head_dim, dtype=DTYPE, device=dev, seed=5)
            k = check.randn(seqs, kv_heads, capacity, head_dim, dtype=DTYPE, device=dev, seed=6)
            v = check.randn(seqs, kv_heads, capacity, head_dim, dtype=DTYPE, device=dev, seed=7)
            k_pool, tables = paged_copy(k, BLOCK_SIZE, seed=8)
            v_pool, _ = paged_copy(v, BLOCK_SIZE, seed=8)
            packed = q.transpose(1, 2).reshape(seqs * new, q_heads, head_dim).contiguous()
            cu = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=dev)
            lengths = torch.full((seqs,), length, dtype=torch.int32, device=dev)
            k_seq, v_seq = k[:, :, :length], v[:, :, :length]
            # SDPA's flash kernel takes is_causal only for square attention; a cached prefix needs a mask.
            mask = (None if prefix == 0 else
                    torch.arange(length, device=dev)[None, :] <= torch.arange(prefix, length, device=dev)[:, None])

            def ours(packed=packed, k_pool=k_pool, v_pool=v_pool, tables=tables, cu=cu, lengths=lengths, new=new):
                return kernels.paged_prefill(packed, k_pool, v_pool, tables, cu, lengths, new, head_dim**-0.5)

            def sdpa(q=q, k_seq=k_seq, v_seq=v_seq, mask=mask):
                return F.scaled_dot_product_attention(q, k_seq, v_seq, attn_mask=mask, is_causal=mask is None,
                                                      enable_gqa=True)

            # The public function (which checks its arguments) once; the kernel's launcher is timed.
            check.assert_close(paged_prefill_attention(packed, k_pool, v_pool, tables, cu, lengths), ours().float(),
                               dtype=DTYPE, name="public function and launcher")
            want = sdpa().transpose(1, 2).reshape(seqs * new, q_heads, head_dim)
            check.assert_close(ours(), want.float(), dtype=DTYPE, name=f"paged prefill {shape} {seqs}x{new}+{prefix}")
            t_ours, t_sdpa = timing.measure(ours, reps=REPS), timing.measure(sdpa, reps=REPS)
            # Causal FLOPs: each query scores and mixes the keys up to its own position.
            pairs = seqs * sum(prefix + i + 1 for i in range(new))
            flops = 4 * pairs * q_heads * head_dim
            rows.append({
                "shape": shape, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "sequences": seqs, "new_tokens": new, "cached_prefix": prefix, "block_size": BLOCK_SIZE,
                "ours_ms": t_ours.median_ms, "sdpa_ms": t_sdpa.median_ms,
                "ours_tflops": timing.tflops(flops, t_ours), "sdpa_tflops": timing.tflops(flops, t_sdpa),
                "ours/sdpa": t_sdpa.median_ms / t_ours.median_ms,
                "ours/limit": timing.tflops(flops, t_ours) / limits["matmul_bf16_tflops"],
            })
    return Measurement(
        rows=rows, metric="TFLOP/s of causal attention (4 x query-key pairs x q_heads x head_dim); "
                          "ours/sdpa = SDPA time / ours",
        limits=limits,
        config={"dtype": str(DTYPE).replace("torch.", ""), "block_size": BLOCK_SIZE,
                "shapes": {name: list(s) for name, s in SHAPES.items()},
                "ours": "labkit.kvcache.kernels.paged_prefill (the launcher behind paged_prefill_attention, "
                        "without its argument checks)",
                "reference": f"torch SDPA (enable_gqa) on contiguous [seqs, heads, len, d] copies; is_causal without "
                             f"a prefix, a boolean mask with one; torch {torch.__version__}"},
    )


@benchmark("serve.paged_decode_stages", chapter=CHAPTER,
           title="Paged decode attention by pipeline depth (the contiguous kernel's stage count, one more, two "
                 "more) and warps (the contiguous kernel's, and paged_config's cap) against the contiguous "
                 "kernel, at the batches the goals hold for")
def bench_paged_decode_stages() -> Measurement:
    from triton.runtime.errors import OutOfResources

    limits = ceilings.limits()
    batches = backend.pick(cpu=[2], gpu=[16, 64])
    contexts = backend.pick(cpu=[96], gpu=[4096, 16384])
    rows, refused = [], []
    for shape, (q_heads, kv_heads, head_dim) in SHAPES.items():
        for batch in batches:
            for context in contexts:
                dev = backend.device()
                q = check.randn(batch, q_heads, head_dim, dtype=DTYPE, device=dev, seed=1)
                k = check.randn(batch, kv_heads, context, head_dim, dtype=DTYPE, device=dev, seed=2)
                v = check.randn(batch, kv_heads, context, head_dim, dtype=DTYPE, device=dev, seed=3)
                k_pool, tables = paged_copy(k, BLOCK_SIZE, seed=4)
                v_pool, _ = paged_copy(v, BLOCK_SIZE, seed=4)
                lengths = torch.full((batch,), context, dtype=torch.int32, device=dev)
                base = kernels.default_config(batch, kv_heads, context)
                scale = head_dim**-0.5
                want = kernels.split_kv_decode(q, k, v, lengths, scale, base)
                t_contiguous = timing.measure(lambda: kernels.split_kv_decode(q, k, v, lengths, scale, base), reps=REPS)
                moved = (k.numel() + v.numel() + 2 * q.numel()) * q.element_size()
                warp_counts = sorted({base.num_warps, min(base.num_warps, kernels.PAGED_MAX_WARPS)})
                for warps, extra in itertools.product(warp_counts, (0, 1, 2)):
                    config = dataclasses.replace(base, num_stages=base.num_stages + extra, num_warps=warps)

                    def paged(config=config):
                        return kernels.paged_split_kv_decode(q, k_pool, v_pool, tables, lengths, scale, config)

                    try:
                        check.assert_close(paged(), want.float(), dtype=DTYPE, name=f"paged, {config}")
                    except OutOfResources as e:  # deeper pipelines may not fit one SM's shared memory
                        refused.append(f"{shape} B={batch} L={context} stages {config.num_stages}: {e}")
                        continue
                    t_paged = timing.measure(paged, reps=REPS)
                    rows.append({
                        "shape": shape, "batch": batch, "context": context, "block_size": BLOCK_SIZE,
                        "block_n": base.block_n, "num_warps": warps, "contiguous_warps": base.num_warps,
                        "contiguous_stages": base.num_stages,
                        "extra_stages": extra, "paged_stages": config.num_stages,
                        "paged_ms": t_paged.median_ms, "contiguous_ms": t_contiguous.median_ms,
                        "ours/contiguous": t_contiguous.median_ms / t_paged.median_ms,
                        "ours/limit": timing.bandwidth_tbps(moved, t_paged) / limits["read_tbps"],
                    })
                del k, v, k_pool, v_pool
    return Measurement(
        rows=rows, metric="paged time against the contiguous kernel's (same splits and tile) by pipeline "
                          "stages and warps; ours/limit against the read-only bandwidth",
        limits=limits,
        config={"dtype": str(DTYPE).replace("torch.", ""), "block_size": BLOCK_SIZE,
                "shapes": {name: list(s) for name, s in SHAPES.items()},
                "default_extra_stages": kernels.PAGED_EXTRA_STAGES, "paged_max_warps": kernels.PAGED_MAX_WARPS,
                "refused": refused},
    )
