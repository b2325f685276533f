"""Benchmarks of chapter ``kv-cache``: the decode kernel at the bandwidth limit, what a
cache buys over recomputation (run eagerly, and the way an engine runs it, from a CUDA
graph), and what a growing cache costs over a preallocated one.

Decode attention reads the cache and does little else with it (about ``group`` FLOPs per
byte), so its measure is bandwidth: bytes of cache, query and output over the median
time, against the read-only bandwidth measured in the same run, and against torch's
``scaled_dot_product_attention`` over the very same contiguous cache. Every output is
checked against SDPA before it is timed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, models, profiling, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import kernels

CHAPTER = "kv-cache"

# Llama-3-8B's attention shapes (32 query heads, 8 KV heads of 128): group size 4.
Q_HEADS, KV_HEADS, HEAD_DIM = backend.pick(cpu=(4, 2, 16), gpu=(32, 8, 128))
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
# Under the interpreter one timed call is plenty: its wall-clock is not performance.
REPS = backend.pick(cpu=1, gpu=None)
# The book's model at this machine's size: Qwen3-4B layer shapes with 8 layers on a GPU.
BOOK_MODEL = models.book_config()


def _sdpa_decode(q, k, v):
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def _is_large(batch: int, context: int) -> bool:
    """The sizes the bandwidth goal holds for: enough bytes in flight to fill the GPU."""
    return batch >= backend.pick(cpu=2, gpu=16) or context >= backend.pick(cpu=160, gpu=8192)


@benchmark("kvcache.decode_attention", chapter=CHAPTER,
           title="Split-KV decode attention (GQA 32/8 x 128, bf16): bandwidth against the read "
                 "limit and SDPA over the same cache, by batch and context")
def bench_decode_attention() -> Measurement:
    limits = ceilings.limits()
    # What any kernel pays before it moves a byte: a launch of a one-element fill, timed alike.
    one = torch.zeros(1, device=backend.device())
    launch_ms = timing.measure(lambda: one.fill_(1.0), reps=REPS).median_ms
    batches = backend.pick(cpu=[1, 2], gpu=[1, 4, 16, 64])
    contexts = backend.pick(cpu=[64, 160], gpu=[1024, 4096, 16384])
    rows = []
    for batch in batches:
        for context in contexts:
            q = check.randn(batch, Q_HEADS, HEAD_DIM, dtype=DTYPE, device=backend.device(), seed=1)
            k = check.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device=backend.device(), seed=2)
            v = check.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device=backend.device(), seed=3)
            lengths = torch.full((batch,), context, dtype=torch.int32, device=backend.device())
            config = kernels.default_config(batch, KV_HEADS, context)
            scale = HEAD_DIM**-0.5

            def ours(q=q, k=k, v=v, lengths=lengths, config=config):
                return kernels.split_kv_decode(q, k, v, lengths, scale, config)

            def sdpa(q=q, k=k, v=v):
                return _sdpa_decode(q, k, v)

            check.assert_close(ours(), sdpa().float(), dtype=DTYPE, name=f"decode B={batch} L={context}")
            moved = (k.numel() + v.numel() + 2 * q.numel()) * q.element_size()
            t_ours, t_sdpa = timing.measure(ours, reps=REPS), timing.measure(sdpa, reps=REPS)
            tbps = timing.bandwidth_tbps(moved, t_ours)
            same_size_read = ceilings.read_bandwidth_at_tbps(moved)
            merged = {}
            if config.num_splits > 1:
                # The same launch with the splits merged in the split kernel: one launch, not two.
                merge_here = dataclasses.replace(config, merge_here=True)

                def ours_merged(q=q, k=k, v=v, lengths=lengths, config=merge_here):
                    return kernels.split_kv_decode(q, k, v, lengths, scale, config)

                check.assert_close(ours_merged(), sdpa().float(), dtype=DTYPE, name=f"merged B={batch} L={context}")
                t_merged = timing.measure(ours_merged, reps=REPS)
                merged = {"merged_ms": t_merged.median_ms, "two_kernels/merged": t_ours.median_ms / t_merged.median_ms}
            rows.append({
                "batch": batch, "context": context, "num_splits": config.num_splits, "block_n": config.block_n,
                "num_warps": config.num_warps, "num_stages": config.num_stages, "bytes": moved,
                "ours_ms": t_ours.median_ms, "sdpa_ms": t_sdpa.median_ms,
                "ours_tbps": tbps, "sdpa_tbps": timing.bandwidth_tbps(moved, t_sdpa),
                "ours/sdpa": t_sdpa.median_ms / t_ours.median_ms,
                # Decode attention reads the cache and writes almost nothing: its ceiling is
                # the read-only bandwidth, which a copy (half its bytes written) falls short of.
                "ours/limit": tbps / limits["read_tbps"],
                "ours/copy": tbps / limits["copy_tbps"],
                # The bytes alone at the read bandwidth, plus one launch: an estimate of the floor.
                "floor_ms": moved / (limits["read_tbps"] * 1e9) + launch_ms,
                # A bare read of as many bytes, timed alike: what a call of this size can reach
                # when it does nothing but read (the 2 GiB stream of read_tbps hides a launch's
                # start and its last wave; a call of a few tens of MB does not).
                "same_size_read_tbps": same_size_read, "ours/same-size read": tbps / same_size_read,
                **merged,
            })
    # Which kernels SDPA chose for the largest case: the comparison depends on it.
    sdpa_kernels = sorted({k.name for k in profiling.kernels_run(sdpa)})
    large = [r for r in rows if _is_large(r["batch"], r["context"])]
    goals = [
        Goal("ours/limit (min over batch >= 16 or context >= 8192)",
             min(r["ours/limit"] for r in large), ">=", 0.75),
        Goal("ours/sdpa (min over batch >= 16 or context >= 8192)",
             min(r["ours/sdpa"] for r in large), ">=", 1.0),
    ]
    return Measurement(rows=rows, metric="TB/s of cache + query + output (read + write); ours/limit against the "
                                         "read-only bandwidth; ours/same-size read against one read_sum pass over "
                                         "as many bytes (ceilings.read_bandwidth_at_tbps)", limits=limits,
                       goals=goals, config={
                           "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                           "dtype": str(DTYPE).replace("torch.", ""), "lengths": "all equal to context",
                           "launch_ms": launch_ms,
                           "floor": "bytes at the read bandwidth + launch_ms (a one-element fill, timed the same way)",
                           "merged": "where there are splits, the same launch with merge_here=True: the last split "
                                     "of each (sequence, KV head) merges them, no combine kernel",
                           "reference": f"torch.nn.functional.scaled_dot_product_attention(enable_gqa=True), "
                                        f"torch {torch.__version__}",
                           "sdpa_kernels": sdpa_kernels,
                       })


@benchmark("kvcache.decode_step", chapter=CHAPTER,
           title="Time per decoded token of the book's model: a KV cache (eager, and replayed from a "
                 "CUDA graph) against recomputing the whole sequence, by context")
@torch.no_grad()
def bench_decode_step() -> Measurement:
    batch, contexts = backend.pick(cpu=(2, [16, 48]), gpu=(4, [512, 1024, 2048, 4096]))
    model = models.Decoder(BOOK_MODEL, dtype=DTYPE, device=backend.device())
    gen = torch.Generator(device=backend.device()).manual_seed(0)
    ids = torch.randint(0, BOOK_MODEL.vocab_size, (batch, max(contexts) + 1), generator=gen, device=backend.device())
    tol = backend.pick(cpu=1e-5, gpu=5e-2)
    rows = []
    for context in contexts:
        prompt, token = ids[:, :context], ids[:, context:context + 1]
        cache = model.new_cache(batch, context + 1)
        model(prompt, cache)  # prefill, untimed
        runner = models.GraphedDecoder(model, batch, context + 1)
        runner.prefill(prompt)

        def cached_step(cache=cache, context=context):
            logits = model(token, cache, last_only=True)
            cache.truncate(context)  # so every repetition times the same step
            return logits

        def graphed_step(runner=runner, context=context):
            logits = runner.step(token)
            runner.cache.truncate(context)
            return logits

        def recompute_step(context=context):
            return model(ids[:, :context + 1], last_only=True)

        full = recompute_step()
        check.assert_close(cached_step(), full, dtype=DTYPE, tol=tol, name=f"cached vs recomputed, context {context}")
        check.assert_close(graphed_step()[:, None], full, dtype=DTYPE, tol=tol,
                           name=f"graphed vs recomputed, context {context}")
        t_cached, t_graphed = timing.measure(cached_step, reps=REPS), timing.measure(graphed_step, reps=REPS)
        t_full = timing.measure(recompute_step, reps=REPS)
        rows.append({
            "context": context, "batch": batch,
            "graphed_ms_per_token": t_graphed.median_ms / batch,
            "cached_ms_per_token": t_cached.median_ms / batch,
            "recompute_ms_per_token": t_full.median_ms / batch,
            "ours/recompute": t_full.median_ms / t_graphed.median_ms,
            "eager/recompute": t_full.median_ms / t_cached.median_ms,
        })
        del cache, runner
    at_goal = max(contexts)
    return Measurement(
        rows=rows, metric="ms per decoded token (per step / batch); ours/recompute is the speedup of the graphed step",
        limits=ceilings.limits(),
        goals=[Goal(f"ours/recompute at context {at_goal}",
                    next(r["ours/recompute"] for r in rows if r["context"] == at_goal), ">=", 10.0)],
        config={"model": repr(BOOK_MODEL), "batch": batch, "dtype": str(DTYPE).replace("torch.", ""),
                "graphed": "labkit.models.GraphedDecoder: a StaticKVCache, the split-KV decode kernel, and the "
                           "whole step replayed from one CUDA graph (run eagerly under the interpreter)",
                "cached": "eager PyTorch: a preallocated KVCache and SDPA (enable_gqa), one launch per op",
                "recompute": "eager full forward over the prefix + 1 tokens each step (SDPA, is_causal); "
                             "last position's logits only",
                "cuda_graph": backend.on_gpu()},
    )


@benchmark("kvcache.append", chapter=CHAPTER,
           title="Appending one token to every layer's cache: torch.cat (growing) against a "
                 "write into a preallocated buffer, by context")
@torch.no_grad()
def bench_append() -> Measurement:
    config = BOOK_MODEL
    batch, contexts = backend.pick(cpu=(2, [32, 256]), gpu=(8, [512, 2048, 8192, 32768]))
    limits = ceilings.limits()
    shape = (batch, config.num_kv_heads, 1, config.head_dim)
    new = check.randn(*shape, dtype=DTYPE, device=backend.device(), seed=4)
    rows = []
    for context in contexts:
        start = check.randn(batch, config.num_kv_heads, context, config.head_dim, dtype=DTYPE,
                            device=backend.device(), seed=5)
        growing = models.GrowingKVCache(config, batch, dtype=DTYPE, device=backend.device())
        fixed = models.KVCache(config, batch, context + 1, dtype=DTYPE, device=backend.device())
        for cache in (growing, fixed):
            for layer in range(config.num_layers):
                cache.append(layer, start, start)
            cache.advance(context)

        def step(cache, context=context):
            for layer in range(config.num_layers):
                cache.append(layer, new, new)
            cache.truncate(context)

        t_grow = timing.measure(step, (growing,), reps=REPS)
        t_fixed = timing.measure(step, (fixed,), reps=REPS)
        copied = 2 * config.num_layers * (context + 1) * batch * config.num_kv_heads * config.head_dim * new.element_size()
        rows.append({
            "context": context, "batch": batch,
            "growing_ms": t_grow.median_ms, "preallocated_ms": t_fixed.median_ms,
            "growing_bytes_per_step": copied,
            "growing_at_copy_limit_ms": 2 * copied / (limits["copy_tbps"] * 1e12) * 1e3,
            "ours/growing": t_grow.median_ms / t_fixed.median_ms,
        })
    return Measurement(
        rows=rows, metric="ms per decode step to append K and V in every layer", limits=limits,
        goals=[Goal(f"ours/growing at context {max(contexts)}", rows[-1]["ours/growing"], ">=", 10.0)],
        config={"model": repr(config), "batch": batch, "dtype": str(DTYPE).replace("torch.", ""),
                "growing": "torch.cat of the whole cache per layer per step",
                "preallocated": "slice assignment into a [layers, batch, kv_heads, capacity, head_dim] buffer"},
    )


# What a kernel of the decode step does, from its name (cuBLAS, Triton and ATen names).
_KERNEL_KINDS = (
    ("decode attention", ("_decode_split", "_combine_splits")),
    ("matmul", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk", "matmul", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear")),
    ("q/k norms, rotary and cache stores in one kernel", ("qkv_norm_rope",)),
    ("copy into the cache", ("index_copy", "indexcopy", "index_put", "memcpy")),
    ("reduction (norms, softmax)", ("reduce", "norm", "softmax", "aten::mean", "aten::sum", "aten::rsqrt")),
)


def kernel_kind(name: str) -> str:
    """The part of the decode step a kernel (or, under the interpreter, an ATen op) belongs to."""
    low = name.lower()
    for kind, keys in _KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise (rotary, SwiGLU, residual, casts)"


@benchmark("kvcache.decode_step_profile", chapter=CHAPTER,
           title="Where the graphed decode step of the book's model spends its time, kernel by kernel "
                 "(torch.profiler over CUDA-graph replays)")
@torch.no_grad()
def bench_decode_step_profile() -> Measurement:
    batch, context = backend.pick(cpu=(2, 48), gpu=(4, 4096))
    steps = backend.pick(cpu=2, gpu=20)
    model = models.Decoder(BOOK_MODEL, dtype=DTYPE, device=backend.device())
    ids = torch.randint(0, BOOK_MODEL.vocab_size, (batch, context + 1),
                        generator=torch.Generator(device=backend.device()).manual_seed(0), device=backend.device())
    runner = models.GraphedDecoder(model, batch, context + 1)
    runner.prefill(ids[:, :context])
    token = ids[:, context:]

    def graphed_step():
        logits = runner.step(token)
        runner.cache.truncate(context)
        return logits

    graphed_step()  # captures the graph
    t_step = timing.measure(graphed_step, reps=REPS)
    rows = sorted(({"kernel": k.name[:160], "kind": kernel_kind(k.name), "launches_per_step": k.launches / steps,
                    "us_per_step": k.us / steps} for k in profiling.kernels_run(graphed_step, steps)),
                  key=lambda r: -r["us_per_step"])
    limits = ceilings.limits()
    weight_bytes = model.config.num_parameters() * torch.finfo(DTYPE).bits // 8
    cache_bytes = model.config.kv_bytes_per_token(torch.finfo(DTYPE).bits // 8) * batch * context
    return Measurement(
        rows=rows, metric="microseconds of GPU time per decode step, by kernel (torch.profiler)", limits=limits,
        config={"model": repr(BOOK_MODEL), "batch": batch, "context": context, "steps_profiled": steps,
                "dtype": str(DTYPE).replace("torch.", ""), "step_ms": t_step.median_ms,
                "kernel_us_per_step": sum(r["us_per_step"] for r in rows),
                "launches_per_step": sum(r["launches_per_step"] for r in rows),
                "weight_bytes": weight_bytes, "cache_bytes": cache_bytes,
                "floor_ms": (weight_bytes + cache_bytes) / (limits["read_tbps"] * 1e9),
                "floor": "weights and cache read once at the measured read bandwidth",
                "cuda_graph": backend.on_gpu()},
    )
