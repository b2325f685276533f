"""Benchmark of chapter ``medusa-eagle-lookahead``.

- ``drafting.speedup``: every way of drafting at batch 1, greedy, on the previous chapter's
  task. The target trains on the byte corpus, briefly (:mod:`labkit.spec.draft`'s loop with
  a shorter budget than ``spec.speedup``'s: acceptance is measured against this target's
  own greedy output, whatever its quality); then, each in a few seconds, the previous
  chapter's draft model (distilled), Medusa heads and an EAGLE head on the frozen target.
  Each method generates ``NEW_TOKENS`` bytes after a few held-out prompts, every
  generation timed alone with the device synchronised around it, after one untimed
  generation that captures its graphs: plain decoding, speculative decoding with the
  draft model for a few ``k``, Medusa on a tree chosen from its heads' measured
  accuracies, EAGLE-2's dynamic tree, prompt lookup and lookahead. Each greedy output is
  compared token for token with plain decoding's.
"""

from __future__ import annotations

import time

import torch

from .. import backend, models, spec, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from .heads import EagleHead, MedusaHeads, eagle_loss, head_accuracy, medusa_loss
from .loop import EagleProposer, LookaheadProposer, MedusaProposer, PromptLookupProposer, generate_tree
from .runner import TreeRunner
from .tree import best_choices, tree_from_choices

CHAPTER = "medusa-eagle-lookahead"
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
FUSED = backend.on_gpu()
TARGET = backend.pick(cpu=spec.TARGET_CPU, gpu=spec.TARGET_GPU)
DRAFT = backend.pick(cpu=spec.DRAFT_CPU, gpu=spec.DRAFT_GPU)

# Training budgets: seconds on the GPU (the whole benchmark stays near a minute and a half), steps on the CPU.
TARGET_PLAN = backend.pick(cpu=spec.TrainPlan(batch=16, length=64, lr=3e-3, steps=40), gpu=spec.TrainPlan(batch=64, length=256, lr=1e-3, seconds=25.0))
DRAFT_PLAN = backend.pick(cpu=spec.TrainPlan(batch=8, length=64, lr=3e-3, steps=15),
                          gpu=spec.TrainPlan(batch=64, length=256, lr=2e-3, seconds=8.0))
HEADS_PLAN = backend.pick(cpu=spec.TrainPlan(batch=8, length=64, lr=3e-3, steps=15),
                          gpu=spec.TrainPlan(batch=64, length=256, lr=1e-3, seconds=6.0))
EAGLE_PLAN = backend.pick(cpu=spec.TrainPlan(batch=8, length=64, lr=3e-3, steps=15),
                          gpu=spec.TrainPlan(batch=64, length=256, lr=1e-3, seconds=8.0))

CORPUS_BYTES = backend.pick(cpu=1_000_000, gpu=4_000_000)
PROMPTS = backend.pick(cpu=1, gpu=4)
PROMPT_LEN = backend.pick(cpu=32, gpu=128)
NEW_TOKENS = backend.pick(cpu=24, gpu=128)
SPEC_KS = backend.pick(cpu=(3,), gpu=(2, 4, 6))
MEDUSA_HEADS = 4
MEDUSA_TOP_K = 4
MEDUSA_NODES = backend.pick(cpu=8, gpu=24)     # tree nodes after the root
EAGLE_DEPTH, EAGLE_WIDTH = backend.pick(cpu=(3, 2), gpu=(6, 4))
EAGLE_NODES = backend.pick(cpu=6, gpu=24)
LOOKUP_K = backend.pick(cpu=4, gpu=8)
LOOKAHEAD = dict(window=backend.pick(cpu=4, gpu=6), ngram=4, branches=backend.pick(cpu=3, gpu=5))


def _train(device: torch.device, text: torch.Tensor) -> tuple[dict, dict]:
    """The target, then the draft model (distilled), Medusa heads and an EAGLE head on it; models and a summary."""
    target = models.Decoder(TARGET, device=device, seed=0)
    summary = {"target": spec.train_model(target, text, TARGET_PLAN, seed=0, desc="target")}
    target.eval().requires_grad_(False)
    draft = models.Decoder(DRAFT, device=device, seed=1)
    summary["draft"] = spec.train_model(draft, text, DRAFT_PLAN, seed=1, loss_fn=spec.distillation_loss(target))
    heads = MedusaHeads(TARGET.hidden_size, MEDUSA_HEADS, device=device)
    summary["medusa"] = spec.train_model(heads, text, HEADS_PLAN, seed=2, loss_fn=medusa_loss(target))
    eagle = EagleHead(TARGET, device=device, seed=3)
    summary["eagle"] = spec.train_model(eagle, text, EAGLE_PLAN, seed=3, loss_fn=eagle_loss(target))
    return {"target": target, "draft": draft.eval(), "heads": heads.eval(), "eagle": eagle.eval()}, summary


@benchmark("drafting.speedup", chapter=CHAPTER,
           title="Drafting at batch 1, greedy, on the byte corpus: a draft model, Medusa heads, EAGLE-2, prompt "
                 "lookup and lookahead against plain decoding")
def speedup() -> Measurement:
    device = backend.device()
    seconds = {}
    t0 = time.perf_counter()
    train_text, held_text = models.stdlib_corpus(CORPUS_BYTES)
    trained, training = _train(device, train_text)
    seconds["train"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(7)
    prompts = [models.random_windows(held_text, 1, PROMPT_LEN, gen)[0].to(device) for _ in range(PROMPTS)]
    windows = models.random_windows(held_text, backend.pick(cpu=4, gpu=16), 128, torch.Generator().manual_seed(8)).to(device)
    accuracy = head_accuracy(trained["heads"], trained["target"], windows, MEDUSA_TOP_K)
    tree = tree_from_choices(best_choices(accuracy, MEDUSA_NODES))
    target = spec.as_dtype(trained["target"], DTYPE, fused=FUSED)
    draft = spec.as_dtype(trained["draft"], DTYPE, fused=FUSED)
    heads = trained["heads"].to(DTYPE)
    eagle = EagleHead(TARGET, dtype=DTYPE, device=device)  # built fresh: its rotary table stays fp32
    eagle.load_state_dict(trained["eagle"].state_dict())
    eagle.eval()
    capacity = -(-(PROMPT_LEN + NEW_TOKENS + 64) // 64) * 64
    graphs = backend.on_gpu()
    plain_runner = spec.StepRunner(target, capacity, (1, *(k + 1 for k in SPEC_KS)))
    draft_runner = spec.StepRunner(draft, capacity, (1,))
    builders = {
        "Medusa": lambda g: MedusaProposer(heads, target.lm_head.weight, tree, use_graph=g),
        "EAGLE-2": lambda g: EagleProposer(eagle, target, capacity + EAGLE_DEPTH * (EAGLE_WIDTH + 1) + 1,
                                           depth=EAGLE_DEPTH, width=EAGLE_WIDTH, total=EAGLE_NODES, use_graph=g),
        "prompt lookup": lambda g: PromptLookupProposer(LOOKUP_K, device),
        "lookahead": lambda g: LookaheadProposer(device=device, **LOOKAHEAD),
    }
    built = {}

    def build(name: str, use_graph: bool) -> None:
        proposer = builders[name](use_graph)
        built[name] = (proposer, TreeRunner(target, capacity, (proposer.tree_size,), use_graph=use_graph))

    methods = {"plain": lambda prompt: (spec.generate_plain(plain_runner, prompt, NEW_TOKENS), None)}
    for k in SPEC_KS:
        methods[f"draft model k={k}"] = lambda prompt, k=k: _pair(
            spec.generate_speculative(plain_runner, draft_runner, prompt, NEW_TOKENS, k=k))
    for name in builders:
        build(name, graphs)
        methods[name] = lambda prompt, name=name: _pair(
            generate_tree(built[name][1], built[name][0], prompt, NEW_TOKENS))
    graph_failures = {}
    for name, run in methods.items():  # capture every graph, compile every kernel
        try:
            run(prompts[0])
        except RuntimeError as error:  # recorded, and that method measured eagerly rather than not at all
            if name not in builders or not graphs:
                raise
            graph_failures[name] = f"{type(error).__name__}: {error}"[:500]
            build(name, False)
            run(prompts[0])
    seconds["setup"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rows = []
    for index, prompt in enumerate(prompts):
        plain_tokens = None
        for name, run in methods.items():
            (tokens, accepted), ms = timing.timed_call(lambda: run(prompt))
            row = {"method": name, "prompt": index, "ms": ms, "tokens_per_s": NEW_TOKENS / ms * 1e3}
            if accepted is None:
                plain_tokens, plain_ms = tokens, ms
                row.update(tokens_per_step=1.0, steps=NEW_TOKENS)
            else:
                row.update(tokens_per_step=len(tokens) / len(accepted), steps=len(accepted),
                           mean_accepted=sum(accepted) / len(accepted), speedup=plain_ms / ms,
                           identical=tokens == plain_tokens)
            rows.append(row)
    seconds["generate"] = time.perf_counter() - t0

    summary = []
    plain_ms = sum(r["ms"] for r in rows if r["method"] == "plain")
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        steps = sum(r["steps"] for r in mine)
        kept = sum(r.get("mean_accepted", 0.0) * r["steps"] for r in mine) / steps
        proposed = (built[name][0].tree_size - 1 if name in built
                    else int(name.split("k=")[1]) if name.startswith("draft model") else 0)
        summary.append({"method": name, "speedup": plain_ms / sum(r["ms"] for r in mine),
                        "tokens_per_step": len(mine) * NEW_TOKENS / steps,
                        "ms_per_step": sum(r["ms"] for r in mine) / steps,
                        "accepted_per_step": kept, "proposed_per_step": proposed,
                        "acceptance": kept / proposed if proposed else float("nan"),
                        "identical": sum(r.get("identical", True) for r in mine) / len(mine)})
    spec_best = max((s for s in summary if s["method"].startswith("draft model")), key=lambda s: s["speedup"])
    for s in summary:
        s["over_draft_model"] = s["speedup"] / spec_best["speedup"]
        # The ceiling: drafting free and a verification as cheap as one plain step, the speedup is tokens per step.
        s["limit"] = s["tokens_per_step"]
        s["ours/limit"] = s["speedup"] / s["limit"]
    best = max((s for s in summary if s["method"] != "plain"), key=lambda s: s["speedup"])
    goals = [
        Goal(f"best speedup over plain decoding at batch 1 ({best['method']})", best["speedup"], ">=", 2.5),
        Goal("greedy outputs identical to plain decoding (fraction of generations)",
             sum(r["identical"] for r in rows if "identical" in r) / sum("identical" in r for r in rows), ">=", 0.9),
    ]
    backend.free_memory()
    return Measurement(
        rows=rows, metric="ms per generation of new_tokens at batch 1, greedy; speedup = plain ms / ms (same prompt)",
        limits={}, goals=goals,
        config={"target": repr(TARGET), "draft": repr(DRAFT), "dtype": str(DTYPE).replace("torch.", ""),
                "fused": FUSED, "cuda_graphs": graphs, "corpus_bytes": CORPUS_BYTES, "prompts": PROMPTS,
                "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "spec_ks": list(SPEC_KS),
                "medusa": {"heads": MEDUSA_HEADS, "top_k": MEDUSA_TOP_K, "tree_parents": list(tree.parents),
                           "accuracy": accuracy.tolist()},
                "eagle": {"depth": EAGLE_DEPTH, "width": EAGLE_WIDTH, "nodes": EAGLE_NODES},
                "prompt_lookup": {"k": LOOKUP_K}, "lookahead": LOOKAHEAD,
                "tree_sizes": {name: p.tree_size for name, (p, _) in built.items()},
                "graph_failures": graph_failures,
                "training": training, "summary": summary, "seconds": seconds})


def _pair(out: spec.SpecOutput) -> tuple[list[int], list[int]]:
    return out.tokens, out.accepted
