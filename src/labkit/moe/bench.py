"""Benchmarks of the MoE chapter: the grouped GEMM, and the whole layer.

``moe.grouped_gemm`` holds the grouped GEMM against the two things a practitioner
compares it with: a Python loop of ``torch.mm`` over experts (same work, ``E`` launches)
and one dense ``torch.mm`` of the same FLOPs (the rate cuBLAS reaches with none of the
raggedness), plus ``torch._grouped_mm`` where this torch has it. It also times the
permutation fused into the kernel's loads against a separate gather, to say whether
fusing pays. ``moe.layer`` times the whole layer against the loop-over-experts layer
(what HF transformers' Qwen3-MoE block does) and Liger-Kernel's fused MoE where it runs.
Shapes follow Qwen3-30B-A3B (hidden 2048, expert intermediate 768, top-8) with 64 experts.
"""

from __future__ import annotations

import itertools
import statistics

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import grouped_mm, kernels, moe_layer
from .layer import random_moe_weights
from .reference import experts_reference, grouped_mm_loop, moe_layer_reference
from .router import softmax_topk, zipf_counts

DTYPE = torch.bfloat16
ZIPF_SKEW = 1.0  # expert e gets a share ~ 1/(e+1): the first of 64 experts about a fifth of all rows


def _torch_grouped_mm():
    """``torch._grouped_mm`` (cuBLAS/CUTLASS grouped GEMM) if this torch and GPU run it, else None."""
    fn = getattr(torch, "_grouped_mm", None)
    return fn if (fn is not None and backend.on_gpu()) else None


# Liger autotunes its three forward kernels over 32 + 32 + 40 configs, one compile each: more
# GPU time than the rest of the chapter's benchmarks together. Both sides get the same size
# of search: our grouped GEMM autotunes over its 8 GPU_CONFIGS, and each of Liger's kernels
# over 8 of its own, its fixed default (what LIGER_FUSED_MOE_AUTOTUNE=0 runs) among them:
# the two GEMMs over BLOCK_N 64 or 128, 4 or 8 warps, 2 or 4 stages at BLOCK_K 64; the
# gather over BLOCK_H 128 or 512, BLOCK_K 4 or 8, 4 or 8 warps.
LIGER_SEARCH = "8 configs per forward kernel (GEMMs: BLOCK_N 64/128 x 4/8 warps x 2/4 stages at BLOCK_K 64; " \
               "gather: BLOCK_H 128/512 x BLOCK_K 4/8 x 4/8 warps)"


def _liger_gemm_kept(config) -> bool:
    return config.kwargs.get("BLOCK_K") == 64 and config.num_stages in (2, 4)


def _liger_gather_kept(config) -> bool:
    kw = config.kwargs
    return kw.get("BLOCK_H") in (128, 512) and kw.get("BLOCK_K") in (4, 8)


_LIGER_CONFIGS_KEPT = {"_fused_up_proj_swiglu_kernel": _liger_gemm_kept, "_fused_down_proj_kernel": _liger_gemm_kept,
                       "_token_gather_weighted_sum_kernel": _liger_gather_kept}


def _liger_fused_moe():
    """Liger-Kernel's fused MoE function with its autotuning trimmed, or the reason it cannot run here."""
    if not backend.on_gpu():
        return None, "needs a CUDA GPU"
    try:
        from liger_kernel.ops import LigerFusedMoEFunction
        from liger_kernel.ops import fused_moe_kernels
    except ImportError as e:
        return None, f"not importable: {e}"
    from importlib.metadata import PackageNotFoundError, version

    kept = []
    for name, keep in _LIGER_CONFIGS_KEPT.items():
        tuner = getattr(fused_moe_kernels, name, None)
        configs = getattr(tuner, "configs", None) or []
        trimmed = [c for c in configs if keep(c)]
        if trimmed:  # a Liger that renamed its kernels, or pinned one config, is left as it is
            tuner.configs = trimmed
        kept.append(f"{len(trimmed) or len(configs)} of {len(configs)}")
    try:
        name = f"liger-kernel {version('liger-kernel')}"
    except PackageNotFoundError:
        name = "liger-kernel (version unknown)"
    return LigerFusedMoEFunction, f"{name}; autotuned over {', '.join(kept)} configs of its forward kernels"


@benchmark("moe.grouped_gemm", chapter="moe",
           title="Grouped GEMM over experts vs a loop of torch.mm and one dense torch.mm")
def bench_grouped_gemm() -> Measurement:
    experts = backend.pick(cpu=4, gpu=64)
    n, k = backend.pick(cpu=(48, 40), gpu=(1536, 2048))  # the gate/up projection
    sweep = backend.pick(cpu=[3, 17], gpu=[16, 64, 128, 256, 512, 1024, 2048])
    zipf_sizes = backend.pick(cpu=[17], gpu=[128, 512, 2048])
    dtype = DTYPE if backend.on_gpu() else torch.float32
    dev = backend.device()
    peer = _torch_grouped_mm()
    peer_note = "ran" if peer is not None else "not available (needs torch._grouped_mm and a GPU)"
    w = check.randn(experts, n, k, dtype=dtype, device=dev, seed=1, scale=k**-0.5)
    # Balanced counts at every size, then the same totals under Zipf-skewed routing, where a
    # few experts own most rows and many get ragged, part-empty tiles.
    cases = [(per_expert, 0.0) for per_expert in sweep] + [(per_expert, ZIPF_SKEW) for per_expert in zipf_sizes]
    rows = []
    for per_expert, skew in cases:
        m = experts * per_expert
        counts = zipf_counts(m, experts, skew)
        a = check.randn(m, k, dtype=dtype, device=dev, seed=2)
        offsets = torch.tensor([0, *itertools.accumulate(counts)], device=dev, dtype=torch.int64)
        perm = torch.randperm(m, device=dev)
        flops = 2.0 * m * n * k
        check.assert_close(grouped_mm(a, w, offsets), grouped_mm_loop(a.float(), w.float(), offsets),
                           dtype=dtype, name=f"grouped_mm, skew {skew}")
        t = {
            "ours_gather": timing.measure(lambda: grouped_mm(a, w, offsets, gather_rows=perm)),
            "permute_then_ours": timing.measure(lambda: grouped_mm(a[perm], w, offsets)),
            "ours": timing.measure(lambda: grouped_mm(a, w, offsets)),  # last, so best_config is its tile
            "loop": timing.measure(lambda: grouped_mm_loop(a, w, offsets)),
            "dense": timing.measure(lambda: a @ w[0].t()),
        }
        if peer is not None:
            w_kn, ends = w.transpose(1, 2), offsets[1:].to(torch.int32)
            try:
                check.assert_close(peer(a, w_kn, offs=ends), grouped_mm_loop(a.float(), w.float(), offsets),
                                   dtype=dtype, name="torch._grouped_mm")
                t["torch_grouped_mm"] = timing.measure(lambda: peer(a, w_kn, offs=ends))
            except (RuntimeError, check.CheckFailed) as e:  # a peer that fails is noted, not fatal
                peer, peer_note = None, f"failed: {str(e).splitlines()[0][:200]}"
        row = {"tokens_per_expert": per_expert, "routing": "balanced" if skew == 0 else f"zipf s={skew:g}",
               "largest_expert_rows": max(counts), "smallest_expert_rows": min(counts),
               "experts": experts, "M": m, "N": n, "K": k,
               "ours_tile": kernels.tile_name(kernels.grouped_mm_kernel.best_config)}
        row.update({f"{name}_tflops": timing.tflops(flops, tm) for name, tm in t.items()})
        row["ours/dense"] = row["ours_tflops"] / row["dense_tflops"]
        row["ours/loop"] = row["ours_tflops"] / row["loop_tflops"]
        row["ours_gather/permute_then_ours"] = row["ours_gather_tflops"] / row["permute_then_ours_tflops"]
        if "torch_grouped_mm" in t:
            row["ours/torch_grouped_mm"] = row["ours_tflops"] / row["torch_grouped_mm_tflops"]
        rows.append(row)
    limits = ceilings.limits()
    for row in rows:
        row["ours/limit"] = row["ours_tflops"] / limits["matmul_bf16_tflops"]
    balanced = [r for r in rows if r["routing"] == "balanced"]
    big = [r["ours/dense"] for r in balanced if r["tokens_per_expert"] >= 512] or [balanced[-1]["ours/dense"]]
    return Measurement(
        rows=rows, metric="TFLOP/s", limits=limits,
        goals=[
            Goal("grouped/dense torch.mm, worst at >= 512 tokens per expert", min(big), ">=", 0.8),
            Goal(f"grouped/loop over {experts} experts, median over the sweep",
                 statistics.median(r["ours/loop"] for r in balanced), ">=", 2.0),
        ],
        config={"dtype": str(dtype).replace("torch.", ""), "experts": experts, "N": n, "K": k,
                "routing": f"balanced at every size; Zipf (expert e's share ~ (e+1)^-{ZIPF_SKEW:g}) at the sizes "
                           f"{zipf_sizes}, same total rows", "torch_grouped_mm": peer_note},
    )


@benchmark("moe.layer", chapter="moe",
           title="MoE layer forward: grouped GEMMs vs the loop over experts and Liger's fused MoE")
def bench_layer() -> Measurement:
    experts, hidden, inter, top_k = backend.pick(cpu=(4, 40, 24, 2), gpu=(64, 2048, 768, 8))
    sweep = backend.pick(cpu=[5, 33], gpu=[16, 128, 512, 2048, 8192, 32768])
    dtype = DTYPE if backend.on_gpu() else torch.float32
    dev = backend.device()
    weights = random_moe_weights(experts, hidden, inter, top_k, dtype=dtype, device=dev, seed=3)
    liger, liger_note = _liger_fused_moe()

    def loop(x):
        return moe_layer_reference(x, weights.router, weights.gate_up, weights.down, top_k)

    def liger_layer(x):
        routing = softmax_topk(F.linear(x, weights.router), top_k)
        return liger.apply(x, weights.gate_up, weights.down, routing.expert_ids.to(torch.int32),
                           routing.weights.to(dtype))

    if liger is not None:
        # Liger autotunes once per layer shape, at its first call: make that call at the
        # largest batch, where its tile choice matters most.
        try:
            liger_layer(check.randn(sweep[-1], hidden, dtype=dtype, device=dev, seed=4))
        except (RuntimeError, TypeError) as e:  # noted, not fatal
            liger, liger_note = None, f"failed: {str(e).splitlines()[0][:200]}"
    rows = []
    for tokens in sweep:
        x = check.randn(tokens, hidden, dtype=dtype, device=dev, seed=4)
        out, routing, _ = moe_layer(x, weights, return_routing=True)
        expected = experts_reference(x.float(), routing, weights.gate_up.float(), weights.down.float())
        check.assert_close(out, expected, dtype=dtype, name="moe_layer")
        t = {"ours": timing.measure(lambda: moe_layer(x, weights)), "loop": timing.measure(lambda: loop(x))}
        if liger is not None:
            try:
                check.assert_close(liger_layer(x), expected, dtype=dtype, name="Liger fused MoE")
                t["liger"] = timing.measure(lambda: liger_layer(x))
            except (RuntimeError, TypeError, check.CheckFailed) as e:  # noted, not fatal
                liger, liger_note = None, f"failed: {str(e).splitlines()[0][:200]}"
        flops = 6.0 * tokens * top_k * hidden * inter
        row = {"tokens": tokens, "tokens_per_expert": tokens * top_k / experts}
        row.update({f"{name}_ms": tm.median_ms for name, tm in t.items()})
        row["ours_tflops"] = timing.tflops(flops, t["ours"])
        row["ours/loop"] = t["loop"].median_ms / t["ours"].median_ms  # speed-up: > 1 is faster
        if "liger" in t:
            row["ours/liger"] = t["liger"].median_ms / t["ours"].median_ms
        rows.append(row)
    limits = ceilings.limits()
    for row in rows:
        row["ours/limit"] = row["ours_tflops"] / limits["matmul_bf16_tflops"]
    return Measurement(
        rows=rows, metric="ms", limits=limits,
        goals=[Goal("layer speed-up over the loop over experts, worst size", min(r["ours/loop"] for r in rows),
                    ">=", 1.0)],
        config={"dtype": str(dtype).replace("torch.", ""), "experts": experts, "hidden": hidden,
                "intermediate": inter, "top_k": top_k, "liger": liger_note,
                "search": f"ours: the grouped GEMM's {len(kernels.GPU_CONFIGS)} GPU configs; Liger: {LIGER_SEARCH}"},
    )
