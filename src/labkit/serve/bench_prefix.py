"""Benchmarks of chapter ``long-context``: prefix caching on a multi-turn agent trace, and the
host link that KV offload crosses.

- ``serve.prefix_ttft``: an agent trace (sessions sharing two long system prompts, each
  turn resending the conversation so far plus a new message) served one session at a time
  by the engine with prefix caching off, with the radix tree and with the hash index, at
  the Qwen3-4B shape in bf16 (random weights: speed does not depend on their values), once
  for each system prompt length. Every turn's TTFT, prompt length and cached tokens; the
  goal is TTFT on a cache hit against the same turn with caching off.
- ``serve.prefix_eviction``: the same kind of trace, four sessions at a time, through a
  pool too small to keep every prefix the trace caches, so that LRU eviction runs (a goal
  checks that it did); in fp32
  (the Qwen3-0.6B shape, weights wide enough that greedy tokens vary) so that an output
  differs only if the cache is wrong, not by bf16 rounding of a prefill split differently.
  The goal: every turn's tokens identical to the run without caching.
- ``serve.window_attention``: one layer's prefill attention at the Qwen3-4B shape with
  FlexAttention under three rules (causal, a sliding window, chunks), against SDPA's causal
  kernel, from 4K to 32K tokens: what a mask saves when the kernel skips the tiles it empties.
- ``serve.offload_link``: host-to-device and device-to-host copies, pinned and pageable,
  by size; and the engine's own block copies (:class:`~labkit.serve.swap.SwapSpace`) of a
  Qwen3-4B KV pool: the bandwidth KV offload gets.
"""

from __future__ import annotations

import gc
import statistics

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, models, timing
from ..benchmarks import Measurement, benchmark, progress
from ..results import Goal
from .conversation import agent_trace, hit_rate, longest_conversation, serve_sessions
from .economics import floor_s, step_flops_bytes
from .engine import LLM
from .long_context import attended_pairs, attention_flops, attention_mask, mask_mod
from .swap import SwapSpace

CHAPTER = "long-context"
BLOCK_SIZE = backend.pick(cpu=8, gpu=16)  # the interpreter's 16-position tile spans two blocks of 8 on the CPU
POLICIES = (None, "radix", "hash")

# The TTFT trace at each system prompt length: a hit skips the prefix, but not the engine's
# fixed cost of a step (an eager prefill's launches and host work), so its gain grows with
# the prefix it skips. Answers are short: only the first token is timed, and a longer answer
# adds decode steps to the run, not to what is measured (an answer reaches the next turn
# as part of its cached history either way).
TTFT_SETUP = backend.pick(
    cpu=dict(model="TINY", config=models.TINY, dtype=torch.float32, sessions=3, system_lens=(40,), turns=(1, 2),
             message_lens=(4, 12), output_lens=(1, 2)),
    gpu=dict(model="Qwen3-4B", config=models.QWEN3_SIZES["Qwen3-4B"], dtype=torch.bfloat16, sessions=6,
             system_lens=(4096, 16384), turns=(2, 5), message_lens=(32, 512), output_lens=(4, 16)))
# The eviction trace: the pool must hold the running sessions' conversations, so eviction runs
# only if the blocks the whole trace caches (each system prompt once, every conversation's own
# turns) exceed that. Eight sessions over three system prompts cached 343 blocks of 16 against
# a 361-block pool, and nothing was evicted (the H200 record of 89d50d3); over six prompts they
# cache about 511 against 353.
EVICTION_SETUP = backend.pick(
    cpu=dict(model="TINY", config=models.TINY, sessions=3, system_len=24, system_prompts=3, turns=(2, 2),
             message_lens=(3, 10), output_lens=(1, 3), concurrency=2, pool_fraction=0.5),
    gpu=dict(model="Qwen3-0.6B", config=models.QWEN3_SIZES["Qwen3-0.6B"], sessions=8, system_len=1024,
             system_prompts=6, turns=(2, 5), message_lens=(16, 256), output_lens=(4, 24), concurrency=4,
             pool_fraction=0.35))


def _blocks_for(sessions, concurrency: int | None = None) -> int:
    """Blocks that hold every session's whole conversation (``None``), or ``concurrency`` of the longest at once."""
    lengths = sorted((longest_conversation(s) for s in sessions), reverse=True)
    if concurrency is not None:
        lengths = lengths[:concurrency]
    return sum(-(-n // BLOCK_SIZE) for n in lengths)


def _engine(model, sessions, policy, num_blocks: int, max_num_seqs: int) -> LLM:
    longest = max(longest_conversation(s) for s in sessions)
    return LLM(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(longest, 256), max_model_len=longest, prefix_caching=policy)


def _model_and_trace(setup: dict, *, dtype: torch.dtype, init_std: float, num_system_prompts: int, seed: int):
    """The setup's model (random weights; on a GPU with labkit.fused's kernels) and its agent trace."""
    model = models.Decoder(setup["config"], dtype=dtype, device=backend.device(), seed=0, init_std=init_std,
                           fused=backend.on_gpu())
    trace = agent_trace(setup["sessions"], vocab_size=setup["config"].vocab_size, system_len=setup["system_len"],
                        num_system_prompts=num_system_prompts, turns=setup["turns"], message_lens=setup["message_lens"],
                        output_lens=setup["output_lens"], seed=seed)
    return model, trace


def _label(policy: str | None) -> str:
    return "off" if policy is None else policy


@benchmark("serve.prefix_ttft", chapter=CHAPTER,
           title="Prefix caching on a multi-turn agent trace (Qwen3-4B shape, bf16): TTFT of every turn with "
                 "caching off, with SGLang-style radix tree and with vLLM-style hash index, by system prompt length")
@torch.no_grad()
def bench_prefix_ttft() -> Measurement:
    s = TTFT_SETUP
    model = models.Decoder(s["config"], dtype=s["dtype"], device=backend.device(), seed=0, init_std=0.02,
                           fused=backend.on_gpu())
    limits = ceilings.limits()
    rows, summary = [], {}
    for system_len in progress(s["system_lens"], "serve.prefix_ttft system prompt lengths"):
        trace = agent_trace(s["sessions"], vocab_size=s["config"].vocab_size, system_len=system_len,
                            num_system_prompts=2, turns=s["turns"], message_lens=s["message_lens"],
                            output_lens=s["output_lens"], seed=0)
        if backend.on_gpu():
            # Warm-up on the measured trace itself, with caching off and with the radix tree (the
            # hash index prefills the same shapes as the radix tree): Triton compiles a kernel
            # variant for each new specialization of its integer arguments and cuBLAS picks an
            # algorithm per shape, so a warm-up on another trace left compilations inside the
            # timed turns of whichever policy met a shape first: the radix tree, timed before the
            # hash index.
            for policy in (None, "radix"):
                serve_sessions(_engine(model, trace, policy, _blocks_for(trace), 1), trace)
                gc.collect()
        by_policy = {}
        for policy in POLICIES:
            llm = _engine(model, trace, policy, _blocks_for(trace), 1)
            by_policy[policy] = serve_sessions(llm, trace, concurrency=1)
            rows += [{"system_len": system_len, "caching": _label(policy), **r.row()} for r in by_policy[policy]]
            del llm
            backend.free_memory()
        summary[system_len] = _ttft_summary(by_policy)
    # Every turn against its roofline floor: the prefill it ran (the uncached tokens after the
    # cached ones) at the matmul rate and read bandwidth measured in the same run.
    for row in rows:
        new = row["prompt_len"] - row["cached_tokens"]
        work = step_flops_bytes(s["config"], batch=1, new_tokens=new, context=row["cached_tokens"],
                                bytes_per_element=model.embed.weight.element_size())
        row["floor_s"] = floor_s(work, limits["matmul_bf16_tflops"], limits["read_tbps"])
        row["ttft/floor"] = row["ttft_s"] / row["floor_s"]
    for system_len, by_policy in summary.items():
        for policy, entry in by_policy.items():
            hit_rows = [r["ttft/floor"] for r in rows if r["system_len"] == system_len and r["caching"] == policy
                        and r["cached_tokens"] > 0]
            entry["hit_ttft/floor_median"] = statistics.median(hit_rows) if hit_rows else float("nan")
    return Measurement(
        rows=rows, metric="seconds from a turn's submission to its first token (TTFT), per turn; floor: the turn's "
                          "prefill at the measured matmul rate and read bandwidth", limits=limits,
        goals=[Goal(f"TTFT off / {p} on cache-hit turns, system prompts of {n} tokens (median over turns)",
                    summary[n][p]["ttft_off/hit_median"], ">=", 5.0) for n in s["system_lens"] for p in ("radix", "hash")],
        config={"model": s["model"], "model_config": repr(s["config"]), "dtype": str(s["dtype"]).replace("torch.", ""),
                "block_size": BLOCK_SIZE, "sessions": s["sessions"], "system_prompts": 2,
                "system_lens": list(s["system_lens"]), "turns": s["turns"], "message_lens": s["message_lens"],
                "output_lens": s["output_lens"], "distribution": "log-uniform", "trace_seed": 0, "concurrency": 1,
                "fused": model.fused, "summary": {str(n): v for n, v in summary.items()},
                "timing": "engine steps timed by wall clock with the device synchronised after each; a turn's TTFT "
                          "is the end of the step that gave its first token minus its submission"},
    )


def _ttft_summary(by_policy: dict) -> dict:
    """Per caching policy: hit rate, TTFT on hits against the same turns uncached, identical outputs."""
    off = by_policy[None]
    summary = {}
    for policy in POLICIES[1:]:
        records = by_policy[policy]
        hits = [(r, o) for r, o in zip(records, off) if r.num_cached_tokens > 0]
        misses = [(r, o) for r, o in zip(records, off) if r.num_cached_tokens == 0]
        ratios = [o.timeline.ttft_s / r.timeline.ttft_s for r, o in hits]
        summary[_label(policy)] = {
            "hit_rate": hit_rate(records), "turns": len(records), "turns_with_hit": len(hits),
            "ttft_hit_median_s": statistics.median(r.timeline.ttft_s for r, _ in hits) if hits else None,
            "ttft_same_turns_off_median_s": statistics.median(o.timeline.ttft_s for _, o in hits) if hits else None,
            "ttft_miss_median_s": statistics.median(r.timeline.ttft_s for r, _ in misses) if misses else None,
            "ttft_off/hit_median": statistics.median(ratios) if ratios else float("nan"),
            "ttft_off/hit_min": min(ratios) if ratios else float("nan"),
            "identical_turns": sum(r.timeline.tokens == o.timeline.tokens for r, o in zip(records, off)),
        }
    return summary


@benchmark("serve.prefix_eviction", chapter=CHAPTER,
           title="Prefix caching under LRU eviction (Qwen3-0.6B shape, fp32): hit rate, evictions, and outputs "
                 "against the run without caching")
@torch.no_grad()
def bench_prefix_eviction() -> Measurement:
    s = EVICTION_SETUP
    model, trace = _model_and_trace(s, dtype=torch.float32, init_std=0.1, num_system_prompts=s["system_prompts"],
                                    seed=2)
    everything = _blocks_for(trace)
    # Room for the running sessions' conversations at least, and a fraction of everything.
    pool = max(_blocks_for(trace, s["concurrency"]) + 1, int(s["pool_fraction"] * everything))
    runs = {}
    rows = []
    for policy, num_blocks in progress(((None, everything), ("radix", pool), ("hash", pool), ("radix", everything)),
                                       "serve.prefix_eviction runs"):
        llm = _engine(model, trace, policy, num_blocks, s["concurrency"])
        records = serve_sessions(llm, trace, concurrency=s["concurrency"], step_s=1.0)
        cache = llm.prefix_cache
        runs[policy, num_blocks] = records
        reference = runs[None, everything]
        tokens = [t for r in records for t in r.timeline.tokens]
        rows.append({"caching": _label(policy), "pool_blocks": num_blocks, "blocks_for_all": everything,
                     "hit_rate": hit_rate(records), "evicted_blocks": cache.evicted_blocks if cache else 0,
                     "turns": len(records),
                     "identical_turns": sum(r.timeline.tokens == o.timeline.tokens for r, o in zip(records, reference)),
                     "output_tokens": len(tokens), "distinct_output_tokens": len(set(tokens))})
        del llm
        gc.collect()
    for row in rows:
        row["identical_fraction"] = row["identical_turns"] / row["turns"]
    return Measurement(
        rows=rows, metric="turns whose output tokens equal the run without caching; prompt-token hit rate",
        goals=[Goal(f"identical turns / turns, {r['caching']} with {r['pool_blocks']} blocks",
                    r["identical_fraction"], ">=", 1.0) for r in rows[1:]]
        # a record whose small pool never evicted would check nothing about eviction
        + [Goal(f"blocks evicted, {r['caching']} with {r['pool_blocks']} blocks", r["evicted_blocks"], ">=", 1)
           for r in rows[1:3]],
        config={"model": s["model"], "model_config": repr(s["config"]), "dtype": "float32", "init_std": 0.1,
                "block_size": BLOCK_SIZE, "sessions": s["sessions"], "system_prompts": s["system_prompts"],
                "system_len": s["system_len"], "turns": s["turns"], "message_lens": s["message_lens"],
                "output_lens": s["output_lens"], "trace_seed": 2, "concurrency": s["concurrency"],
                "fused": model.fused},
    )


LINK_SIZES_MB = (1, 4, 16, 64, 256)


@benchmark("serve.offload_link", chapter=CHAPTER,
           title="The host link KV offload crosses: H2D and D2H copies, pinned and pageable, by size; and the "
                 "engine's swap of Qwen3-4B KV blocks")
def bench_offload_link() -> Measurement:
    if not backend.on_gpu():  # no host link to measure without a device: the chapter shows the recorded run
        return Measurement(rows=[], metric="GB/s", config={"skipped": "no CUDA device"})
    rows = []
    for mb in LINK_SIZES_MB:
        n = mb * 2**20
        device = torch.empty(n, dtype=torch.uint8, device="cuda")
        for pinned in (True, False):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            for direction, fn in (("H2D", lambda: device.copy_(host, non_blocking=True)),
                                  ("D2H", lambda: host.copy_(device, non_blocking=True))):
                t = timing.measure(fn, flush_l2=False)
                rows.append({"what": "copy", "direction": direction, "pinned": pinned, "bytes": n,
                             "ms": t.median_ms, "GB/s": n / t.median_ms / 1e6})
            del host
        del device
    # The engine's own offload path: a preempted sequence's scattered blocks gathered to pinned
    # CPU blocks (every layer in one indexed copy) and back.
    from .paged_cache import PagedKVCache

    config = models.QWEN3_SIZES["Qwen3-4B"]
    kv = PagedKVCache(config, 512, BLOCK_SIZE, dtype=torch.bfloat16, device="cuda")
    swap = SwapSpace(kv, 256)
    block_bytes = 2 * config.num_layers * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 2
    for blocks in (16, 64, 256):
        device_ids = torch.randperm(512)[:blocks].tolist()
        pairs = list(zip(device_ids, range(blocks)))
        t_out = timing.measure(lambda: swap.swap_out(kv, pairs), flush_l2=False, warmup=1, reps=5)
        t_in = timing.measure(lambda: swap.swap_in(kv, [(c, d) for d, c in pairs]), flush_l2=False, warmup=1, reps=5)
        for direction, t in (("D2H", t_out), ("H2D", t_in)):
            rows.append({"what": "swap blocks", "direction": direction, "pinned": True, "bytes": blocks * block_bytes,
                         "blocks": blocks, "tokens": blocks * BLOCK_SIZE, "ms": t.median_ms,
                         "GB/s": blocks * block_bytes / t.median_ms / 1e6})
    del kv, swap
    gc.collect()
    torch.cuda.empty_cache()
    best = {d: max(r["GB/s"] for r in rows if r["what"] == "copy" and r["direction"] == d and r["pinned"])
            for d in ("H2D", "D2H")}
    return Measurement(
        rows=rows, metric="GB/s (bytes / median time)",
        config={"kv_model": "Qwen3-4B", "kv_bytes_per_token": config.kv_bytes_per_token(2), "block_size": BLOCK_SIZE,
                "block_bytes": block_bytes, "best_pinned_GB/s": best,
                "swap_path": "SwapSpace: one indexed gather per direction over every layer; out: .to('cpu') into a "
                             "pageable temporary, then a CPU scatter into the pinned store; in: a CPU gather into a "
                             "pageable temporary, a copy to the device, a device scatter",
                "timing": "labkit.timing.measure (CUDA events, median), no L2 flush (the copies cross the host link)"},
    )


WINDOW_SETUP = backend.pick(
    cpu=dict(config=models.TINY, lengths=(48, 96), window=16, chunk=32, dtype=torch.float32),
    # Up to 32K: create_block_mask evaluates the rule over the whole length x length grid.
    gpu=dict(config=models.QWEN3_SIZES["Qwen3-4B"], lengths=(4096, 8192, 16384, 32768), window=4096, chunk=8192,
             dtype=torch.bfloat16))


@benchmark("serve.window_attention", chapter=CHAPTER,
           title="Prefill attention of one Qwen3-4B layer (bf16): full causal, sliding window 4096 and chunks of "
                 "8192 with FlexAttention's block masks, against SDPA's causal kernel, by length")
@torch.no_grad()
def bench_window_attention() -> Measurement:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = WINDOW_SETUP
    config, dtype, device = s["config"], s["dtype"], backend.device()
    on_gpu = backend.on_gpu()
    # One mask_mod for every rule, its limits in tensors changed in place: one compiled kernel,
    # and each rule's block mask (which tiles to skip) is an input of it.
    longest = max(s["lengths"])
    window, chunk = torch.tensor(longest, device=device), torch.tensor(longest, device=device)
    rule = mask_mod(window, chunk)
    attend = torch.compile(flex_attention) if on_gpu else flex_attention
    patterns = {"causal": {}, f"window {s['window']}": {"window": s["window"]}, f"chunk {s['chunk']}": {"chunk": s["chunk"]}}
    def inputs(n):
        q = torch.randn(1, config.num_heads, n, config.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, config.num_kv_heads, n, config.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        return q, k, v, *(t.repeat_interleave(config.group_size, dim=1) for t in (k, v))

    def block_mask_for(n, limits):
        window.fill_(limits.get("window", longest))
        chunk.fill_(limits.get("chunk", longest))
        return create_block_mask(rule, 1, 1, n, n, device=device)

    # Checked against SDPA with the dense mask before anything is timed, at the shortest length
    # with a window and chunks that cut into it (odd sizes, not multiples of the 128-wide tiles).
    n = min(s["lengths"])
    q, k, v, kr, vr = inputs(n)
    for limits in ({}, {"window": n // 8 + 3}, {"chunk": n // 4 + 5}, {"window": n // 8 + 3, "chunk": n // 4 + 5}):
        out = attend(q, k, v, block_mask=block_mask_for(n, limits), enable_gqa=True)
        ref = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(),
                                             attn_mask=attention_mask(n, n, **limits, device=device))
        check.assert_close(out.float(), ref, dtype=dtype, name=f"flex {limits or 'causal'} vs dense-mask SDPA")
    rows = []
    for n in s["lengths"]:
        q, k, v, kr, vr = inputs(n)
        t_sdpa = timing.measure(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
        for name, limits in patterns.items():
            block_mask = block_mask_for(n, limits)
            t = timing.measure(lambda: attend(q, k, v, block_mask=block_mask, enable_gqa=True))
            flops = attention_flops(config, n, **limits)
            rows.append({"length": n, "pattern": name, "ms": t.median_ms,
                         "attended_pairs": attended_pairs(n, **limits), "tflops": flops / t.median_ms / 1e9,
                         "sdpa_causal_ms": t_sdpa.median_ms, "sdpa_causal/ours": t_sdpa.median_ms / t.median_ms,
                         "kv_tokens_kept": min(n, limits.get("window", n), limits.get("chunk", n))})
        del q, k, v, kr, vr
    for row in rows:
        causal = next(r for r in rows if r["length"] == row["length"] and r["pattern"] == "causal")
        row["causal_ms/ms"] = causal["ms"] / row["ms"]
        row["causal_pairs/pairs"] = causal["attended_pairs"] / row["attended_pairs"]
    return Measurement(
        rows=rows, metric="ms per prefill attention of one layer (batch 1), useful TFLOP/s",
        config={"model_shape": "Qwen3-4B" if on_gpu else "TINY", "q_heads": config.num_heads,
                "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "dtype": str(dtype).replace("torch.", ""),
                "window": s["window"], "chunk": s["chunk"], "torch": torch.__version__,
                "flex": "torch.nn.attention.flex_attention under torch.compile (default options) on a GPU, eager on a "
                        "CPU; block masks from create_block_mask (128x128 tiles)",
                "sdpa": "F.scaled_dot_product_attention(is_causal=True), KV heads repeated, default backend choice"},
    )
