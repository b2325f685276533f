"""Benchmarks of chapter ``speculative-decoding``.

- ``spec.verify_cost``: what a forward pass of one sequence costs as its number of query
  tokens grows (1 is a decode step, ``k + 1`` a verification), for the book's GPU model and
  for this chapter's target and draft, all with random weights (speed does not depend on
  their values): each step replayed from its CUDA graph (:class:`~labkit.spec.StepRunner`)
  after a 512-token prompt, timed with :func:`labkit.timing.measure`. The floor beside it
  is the weights read once at the read bandwidth measured in the same run.
- ``spec.speedup``: the chapter's task end to end. The target and the draft train on the
  byte corpus (the draft distilled from the target; :mod:`labkit.spec.draft`), then
  generate from held-out prompts at batch 1: plain decoding and speculative decoding for
  several ``k``, greedy and sampled (temperature 1), each generation timed alone with the
  device synchronised around it. Greedy outputs are compared token for token with plain
  decoding's (bf16, and again in fp32), and the first two sampled tokens of many
  speculative steps are tested against the target's exact distribution
  (:mod:`labkit.spec.exactness`).
"""

from __future__ import annotations

import time

import torch

from .. import backend, ceilings, check, models, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from ..serve.memory_budget import weight_bytes
from .acceptance import estimate_alpha
from .draft import DRAFT_CPU, DRAFT_GPU, DRAFT_PLAN, TARGET_CPU, TARGET_GPU, TARGET_PLAN
from .draft import as_dtype, distillation_loss, held_out_loss, train_model
from .exactness import first_two_tokens
from .loop import generate_plain, generate_speculative
from .runner import StepRunner

CHAPTER = "speculative-decoding"
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
FUSED = backend.on_gpu()  # labkit.fused's kernels on the GPU: fewer launches per step
TARGET = backend.pick(cpu=TARGET_CPU, gpu=TARGET_GPU)
DRAFT = backend.pick(cpu=DRAFT_CPU, gpu=DRAFT_GPU)

KS = backend.pick(cpu=(1, 2, 4), gpu=(1, 2, 3, 4, 6, 8))  # drafts per step in spec.speedup
# Step sizes of spec.verify_cost: every verification of KS (k + 1), and on to where arithmetic starts to count.
QUERY_COUNTS = tuple(sorted({1, *(k + 1 for k in KS), *backend.pick(cpu=(), gpu=(12, 16, 24, 32, 48, 64))}))
CONTEXT = backend.pick(cpu=32, gpu=512)

CORPUS_BYTES = backend.pick(cpu=1_000_000, gpu=4_000_000)
PROMPTS = backend.pick(cpu=2, gpu=4)
PROMPT_LEN = backend.pick(cpu=32, gpu=128)
NEW_TOKENS = backend.pick(cpu=48, gpu=256)
IDENTITY_K = backend.pick(cpu=2, gpu=4)
PAIR_SAMPLES = backend.pick(cpu=4000, gpu=40_000)
PAIR_CHUNK = backend.pick(cpu=4000, gpu=1024)  # rows side by side: 1024 fp32 caches of the target are 30 GB
TEMPERATURES = (0.0, 1.0)


@benchmark("spec.verify_cost", chapter=CHAPTER,
           title="One sequence's forward pass against its number of query tokens (graphed, after a 512-token "
                 "prompt): the book's model, the chapter's target and its draft")
def verify_cost() -> Measurement:
    device = backend.device()
    read_tbps = ceilings.read_bandwidth_tbps()
    configs = {"book model": backend.pick(cpu=models.TINY, gpu=models.BOOK_GPU), "target": TARGET, "draft": DRAFT}
    rows = []
    for name, config in configs.items():
        model = models.Decoder(config, dtype=DTYPE, device=device, seed=0, fused=FUSED).eval()
        runner = StepRunner(model, CONTEXT + max(QUERY_COUNTS), QUERY_COUNTS)
        runner.prefill(torch.randint(0, config.vocab_size, (CONTEXT,), device=device))
        floor_ms = weight_bytes(model) / (read_tbps * 1e9)
        one = None
        for n in QUERY_COUNTS:
            tokens = torch.randint(0, config.vocab_size, (n,), device=device)

            def step(tokens=tokens):
                runner.step(tokens)
                runner.truncate(CONTEXT)

            ms = timing.measure(step).median_ms
            one = ms if n == 1 else one
            rows.append({"model": name, "query_tokens": n, "ms": ms, "ms/ms_at_1": ms / one,
                         "floor_ms": floor_ms, "limit/ours": floor_ms / ms, "weight_gb": weight_bytes(model) / 1e9})
        del model, runner
        backend.free_memory()
    at = {(r["model"], r["query_tokens"]): r for r in rows}
    goals = [Goal(f"target: {n} query tokens cost / 1 token", at[("target", n)]["ms/ms_at_1"], "<=", 1.3)
             for n in (5,) if ("target", n) in at]
    return Measurement(
        rows=rows, metric="ms per forward of one sequence; ms/ms_at_1 is its cost in one-token steps; "
                          "limit/ours is the weights' read time over it",
        limits=ceilings.limits(), goals=goals,
        config={"models": {name: repr(c) for name, c in configs.items()}, "context": CONTEXT,
                "dtype": str(DTYPE).replace("torch.", ""), "fused": FUSED,
                "cuda_graphs": backend.on_gpu(), "runner": "labkit.spec.StepRunner (DenseStepKV attention)"})


def _warm_runners(target: models.Decoder, draft: models.Decoder, prompt: torch.Tensor, capacity: int,
                  use_graph: bool | None) -> tuple[StepRunner, StepRunner]:
    """The target's runner (a graph per step of 1 and of k + 1 tokens) and the draft's, every graph
    captured and every kernel compiled by a short generation of each kind."""
    target_runner = StepRunner(target, capacity, (1, *(k + 1 for k in KS)), use_graph=use_graph)
    draft_runner = StepRunner(draft, capacity, (1,), use_graph=use_graph)
    for temperature in TEMPERATURES:
        generate_plain(target_runner, prompt, 4, temperature=temperature)
        for k in KS:
            generate_speculative(target_runner, draft_runner, prompt, 3 * (k + 1), k=k, temperature=temperature)
    return target_runner, draft_runner


@torch.no_grad()
def _book_greedy(runner: models.GraphedDecoder, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding with the book's one-token graphed step (:class:`labkit.models.GraphedDecoder`,
    the split-KV decode kernel), its graph captured once and reused across prompts."""
    runner.cache.truncate(0)
    logits = runner.prefill(prompt[None])
    picks = []
    for i in range(new_tokens):
        picks.append(logits.argmax(-1, keepdim=True))
        if i + 1 < new_tokens:
            logits = runner.step(picks[-1])
    return torch.cat(picks, dim=1)[0].tolist()


def _divergence(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ; -1 when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


@benchmark("spec.speedup", chapter=CHAPTER,
           title="Speculative decoding at batch 1 on the byte corpus: a distilled 2-layer draft for a 28-layer "
                 "target, speedup by k, greedy and sampled; exactness checked")
def speedup() -> Measurement:
    device = backend.device()
    seconds = {}
    t0 = time.perf_counter()
    train_text, held_text = models.stdlib_corpus(CORPUS_BYTES)
    target = models.Decoder(TARGET, device=device, seed=0)
    target_training = train_model(target, train_text, TARGET_PLAN, seed=0, desc="target")
    draft = models.Decoder(DRAFT, device=device, seed=1)
    draft_training = train_model(draft, train_text, DRAFT_PLAN, seed=1, loss_fn=distillation_loss(target.eval()),
                                 desc="draft")
    target.eval(), draft.eval()
    held_loss = {"target": held_out_loss(target, held_text), "draft": held_out_loss(draft, held_text)}
    seconds["train"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(7)
    prompts = [models.random_windows(held_text, 1, PROMPT_LEN, gen)[0].to(device) for _ in range(PROMPTS)]
    capacity = -(-(PROMPT_LEN + NEW_TOKENS + max(KS) + 1) // 64) * 64  # a round width for the attention mask
    fast_target, fast_draft = as_dtype(target, DTYPE, fused=FUSED), as_dtype(draft, DTYPE, fused=FUSED)
    graphs_failed = None
    try:
        target_runner, draft_runner = _warm_runners(fast_target, fast_draft, prompts[0], capacity, None)
    except RuntimeError as error:  # recorded, and measured eagerly rather than not at all
        graphs_failed = f"{type(error).__name__}: {error}"[:500]
        target_runner, draft_runner = _warm_runners(fast_target, fast_draft, prompts[0], capacity, False)
    book_runner = models.GraphedDecoder(fast_target, 1, capacity) if backend.on_gpu() else None
    if book_runner is not None:
        _book_greedy(book_runner, prompts[0], 4)

    rows = []
    for temperature in TEMPERATURES:
        for index, prompt in enumerate(prompts):
            def rng(offset=0):
                return torch.Generator(device=device).manual_seed(1000 * index + offset)

            plain, plain_ms = timing.timed_call(lambda: generate_plain(target_runner, prompt, NEW_TOKENS,
                                                            temperature=temperature, generator=rng()))
            rows.append({"temperature": temperature, "prompt": index, "k": 0, "ms": plain_ms,
                         "tokens_per_s": NEW_TOKENS / plain_ms * 1e3, "tokens_per_step": 1.0})
            if temperature == 0 and book_runner is not None:
                book, book_ms = timing.timed_call(lambda: _book_greedy(book_runner, prompt, NEW_TOKENS))
                rows.append({"temperature": temperature, "prompt": index, "k": 0, "baseline": "GraphedDecoder",
                             "ms": book_ms, "tokens_per_s": NEW_TOKENS / book_ms * 1e3, "identical": book == plain})
            for k in KS:
                out, ms = timing.timed_call(lambda: generate_speculative(target_runner, draft_runner, prompt, NEW_TOKENS, k=k,
                                                              temperature=temperature, generator=rng(k)))
                row = {"temperature": temperature, "prompt": index, "k": k, "ms": ms,
                       "tokens_per_s": NEW_TOKENS / ms * 1e3, "speedup": plain_ms / ms,
                       "tokens_per_step": out.tokens_per_step, "alpha": estimate_alpha(out.accepted, k),
                       "steps": out.steps}
                if temperature == 0:
                    row["identical"] = out.tokens == plain
                    row["first_divergence"] = _divergence(out.tokens, plain)
                rows.append(row)
    used_graphs = target_runner.use_graph
    del target_runner, draft_runner, book_runner, fast_target, fast_draft
    backend.free_memory()
    seconds["generate"] = time.perf_counter() - t0

    # Exactness in fp32 (the trained weights as they are), where rounding no longer ties:
    # greedy token for token, and the first two sampled tokens' law.
    t0 = time.perf_counter()
    identity = []
    exact_target, exact_draft = as_dtype(target, torch.float32), as_dtype(draft, torch.float32)
    for index, prompt in enumerate(prompts):
        plain = generate_plain(StepRunner(exact_target, capacity, (1,)), prompt, NEW_TOKENS)
        out = generate_speculative(StepRunner(exact_target, capacity, (1, IDENTITY_K + 1)),
                                   StepRunner(exact_draft, capacity, (1,)), prompt, NEW_TOKENS, k=IDENTITY_K)
        identity.append({"prompt": index, "k": IDENTITY_K, "identical": out.tokens == plain,
                         "first_divergence": _divergence(out.tokens, plain)})
    pairs = first_two_tokens(exact_target, exact_draft, prompts[0], k=IDENTITY_K, samples=PAIR_SAMPLES,
                             temperature=1.0, generator=torch.Generator(device=device).manual_seed(11),
                             chunk=PAIR_CHUNK)
    seconds["exactness"] = time.perf_counter() - t0

    summary = []
    for temperature in TEMPERATURES:
        base = sum(r["ms"] for r in rows if r["temperature"] == temperature and r["k"] == 0 and "baseline" not in r)
        for k in KS:
            mine = [r for r in rows if r["temperature"] == temperature and r["k"] == k]
            summary.append({"temperature": temperature, "k": k, "speedup": base / sum(r["ms"] for r in mine),
                            "tokens_per_step": sum(r["tokens_per_step"] * r["steps"] for r in mine)
                            / sum(r["steps"] for r in mine),
                            "alpha": sum(r["alpha"] * r["steps"] for r in mine) / sum(r["steps"] for r in mine)})
    best_greedy = max((s for s in summary if s["temperature"] == 0), key=lambda s: s["speedup"])
    goals = [
        Goal(f"greedy speedup at batch 1 (best k = {best_greedy['k']})", best_greedy["speedup"], ">=", 2.0),
        Goal("greedy fp32 outputs identical to plain decoding (fraction of prompts)",
             sum(r["identical"] for r in identity) / len(identity), ">=", 1.0),
        Goal("chi-square p-value of the first two sampled tokens", pairs.test.p_value, ">=", 1e-3),
    ]
    return Measurement(
        rows=rows, metric="ms per generation of new_tokens at batch 1; speedup = plain ms / speculative ms "
                          "(same prompt, same temperature); k = 0 is plain decoding",
        limits={}, goals=goals,
        config={"target": repr(TARGET), "draft": repr(DRAFT), "dtype": str(DTYPE).replace("torch.", ""),
                "fused": FUSED, "cuda_graphs": used_graphs, "graph_failure": graphs_failed,
                "corpus_bytes": CORPUS_BYTES,
                "prompts": PROMPTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "ks": list(KS),
                "training": {"target": target_training, "draft": {**draft_training, "objective": "KL(target || draft)"}},
                "held_out_loss": held_loss, "summary": summary, "identity_fp32": identity,
                "pair_test": {"k": IDENTITY_K, "samples": PAIR_SAMPLES, "statistic": pairs.test.statistic,
                              "dof": pairs.test.dof, "p_value": pairs.test.p_value, "cells": pairs.test.cells,
                              "mean_accepted": pairs.mean_accepted},
                "seconds": seconds})
