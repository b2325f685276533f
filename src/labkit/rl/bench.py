"""The chapter's benchmarks: rollout speed (engine against the plain sampler) and the runs.

``rl.rollout_speed`` times one rollout of equal samples (the same prompts, samples per
prompt and generated tokens, no early stop) by the GRPO chapter's sampling loop, which
recomputes every prefix at every token, and by :class:`~labkit.rl.RolloutWorker` on the
engine (paged KV cache, one packed forward per step, CUDA graphs on a GPU). The plain
loop also draws every token on the host (``torch.multinomial`` over ``[samples, vocab]``
probabilities copied to the CPU, with a CPU generator), and at a 32k vocabulary that draw is
no small part of its time (one draw over ``[256, 32768]`` took 0.17 s on the book's CPU
machine: with one sample, ``multinomial`` draws an exponential per probability from the
serial generator). Each row reports it (``plain_sampling_s``: one step's draw timed alone,
times the tokens), so the speedup can be split into sampling and recomputation. ``rl.run``
trains one warmed-up policy through several systems (the plain sampler twice, for the
seed-to-seed noise; the engine in bf16 with and without TIS, one-step off-policy, with
dynamic sampling) and records each step's rewards, mismatch and seconds per phase.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace

import torch

from .. import backend, timing
from ..benchmarks import Measurement, benchmark, progress
from ..grpo import AdditionTask, RunConfig, sample_group
from ..grpo.train import policy_config
from ..models import TINY, Decoder, DecoderConfig
from ..results import Goal
from .loop import SystemConfig, run, warmed_policy
from .rollout import RolloutWorker

# A mid-size member of the book's model family (0.2 B parameters) with a 32k vocabulary:
# large enough that recomputing prefixes costs what it costs on a real policy.
SPEED_MODEL = DecoderConfig(vocab_size=32_768, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8,
                            head_dim=64, intermediate_size=3072, tie_word_embeddings=True,
                            max_position_embeddings=1024)
SPEED_GOAL = 5.0
# GPU rows of the mid-size model: 16 prompts x 8 samples, 64 prompt tokens, up to 128 new.
# The first version had 32 prompts and up to 256 new tokens and ran past its 140 s cap: its
# plain sampler made about 420 host draws over [256, 32768] (0.17 s each on the CPU
# machine) and recomputed 17M prefix tokens, about 4.7 PFLOP; now 160 draws over
# [128, 32768] and 2.4M tokens.
SPEED_PROMPTS, SPEED_NEW = 16, (32, 128)


def speed_shapes() -> list[dict]:
    """(model, prompts, samples per prompt, prompt tokens, generated tokens) per row."""
    task = AdditionTask()
    cpu = [dict(model="addition policy 64x2", config=policy_config(task, 64, 2), prompts=16, group=8,
                prompt_len=task.prompt_length, new=task.max_answer_tokens),
           *(dict(model="TINY", config=TINY, prompts=4, group=4, prompt_len=8, new=n) for n in (8, 24))]
    gpu = [dict(model="addition policy 128x4", config=policy_config(task, 128, 4), prompts=64, group=8,
                prompt_len=task.prompt_length, new=task.max_answer_tokens),
           *(dict(model="1024x8, 32k vocab", config=SPEED_MODEL, prompts=SPEED_PROMPTS, group=8, prompt_len=64,
                  new=n) for n in SPEED_NEW)]
    return backend.pick(cpu=cpu, gpu=gpu)


def _plain_draw_seconds(samples: int, vocab: int, device: torch.device) -> float:
    """Seconds of one step of :func:`labkit.grpo.sample_group`'s draw for ``samples`` rows of
    ``vocab`` logits: softmax on the device, the copy to the host, ``torch.multinomial`` there."""
    logits = torch.randn(samples, vocab, device=device)
    generator = torch.Generator().manual_seed(1)

    def draw():
        torch.multinomial(torch.softmax(logits.float(), dim=-1).cpu(), 1, generator=generator)
    draw()
    return timing.timed_call(draw)[1] / 1e3


@benchmark("rl.rollout_speed", chapter="rl-systems",
           title="Rollout speed at equal samples: the engine against the GRPO chapter's sampling loop")
def rollout_speed() -> Measurement:
    device = backend.device()
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    rows, models, workers = [], {}, {}
    for shape in progress(speed_shapes(), "rl.rollout_speed rows"):
        cfg = shape["config"]
        if shape["model"] not in models:
            models[shape["model"]] = Decoder(cfg, dtype=dtype, device=device).eval()
        model = models[shape["model"]]
        # No token ends a sample early (the end token is outside the vocabulary): equal work.
        eos, pad = cfg.vocab_size, 0
        prompts = torch.randint(cfg.vocab_size, (shape["prompts"], shape["prompt_len"]),
                                generator=torch.Generator().manual_seed(0)).to(device)
        n = shape["prompts"] * shape["group"]
        key = (shape["model"], shape["prompts"] * shape["group"])
        if key not in workers:  # one engine per model (its CUDA graphs are captured once)
            longest = max(s["prompt_len"] + s["new"] for s in speed_shapes() if s["model"] == shape["model"])
            workers[key] = RolloutWorker(model, max_num_seqs=n, max_model_len=longest)
        worker = workers[key]

        def plain(new: int = shape["new"]):
            sample_group(model, prompts, group_size=shape["group"], max_new_tokens=new, eos=eos, pad=pad,
                         generator=torch.Generator().manual_seed(1))

        def engine(new: int = shape["new"]):
            worker.generate(prompts, group_size=shape["group"], max_new_tokens=new, eos=eos, pad=pad, seed=1)

        for fn in (plain, engine):  # warm-up, two tokens: kernels compiled, every CUDA graph captured
            fn(2)
        plain_s, engine_s = (timing.timed_call(fn)[1] / 1e3 for fn in (plain, engine))
        sampling_s = shape["new"] * _plain_draw_seconds(n, cfg.vocab_size, device)
        rows.append({"model": shape["model"], "samples": n, "prompt_tokens": shape["prompt_len"],
                     "new_tokens": shape["new"], "plain_s": plain_s, "engine_s": engine_s,
                     "engine_tokens_per_s": n * shape["new"] / engine_s, "plain_tokens_per_s": n * shape["new"] / plain_s,
                     "speedup (plain/engine)": plain_s / engine_s,
                     "plain_sampling_s": sampling_s, "plain_sampling_share": sampling_s / plain_s})
    longest = max(rows, key=lambda r: (r["new_tokens"], r["samples"]))
    return Measurement(
        rows=rows, metric="seconds per rollout of equal samples; speedup = plain time / engine time",
        goals=[Goal(f"engine speedup over the plain sampler, {longest['model']}, {longest['samples']} samples x "
                    f"{longest['new_tokens']} tokens", longest["speedup (plain/engine)"], ">=", SPEED_GOAL)],
        config={"dtype": str(dtype).removeprefix("torch."), "device": str(device),
                "engine": "labkit.serve.LLM via RolloutWorker: n samples per prompt share its KV blocks; "
                          "CUDA graphs on a GPU (whole-step for decode, piecewise for prefill), torch attention on a CPU",
                "plain": "labkit.grpo.sample_group: the whole prefix recomputed at every token, no KV cache; "
                         "each token drawn on the host (torch.multinomial on the CPU)",
                "plain_sampling_s": "one step's host draw at the row's [samples, vocab] (softmax, copy to the "
                                    "CPU, multinomial), timed alone, times the new tokens: an estimate of the "
                                    "plain time that is sampling rather than recomputation",
                "timing": "wall clock of one rollout after one warm-up rollout, synchronised"},
    )


CPU_RUN = RunConfig(steps=6, prompts_per_step=8, group_size=8, eval_every=3, warmup_steps=200)
GPU_RUN = RunConfig(steps=120, prompts_per_step=64, group_size=8, eval_every=10)
CPU_POLICY, GPU_POLICY = (64, 2), (128, 4)
BF16_TIS = SystemConfig(engine_dtype="bfloat16")
SYSTEMS = {
    "plain sampler": (SystemConfig(rollout="plain"), 0),
    "plain sampler, seed 1": (SystemConfig(rollout="plain"), 1),
    "engine bf16 + TIS": (BF16_TIS, 0),
    "engine bf16, no TIS": (replace(BF16_TIS, tis_cap=None), 0),
    "engine bf16 + TIS, one-step off-policy": (replace(BF16_TIS, staleness=1), 0),
    "engine bf16 + TIS, dynamic sampling": (replace(BF16_TIS, dynamic_sampling=True), 0),
}
SAME_CURVE_GOAL = 0.05  # held-out reward, last three evaluations' mean: engine within 5 points of the plain sampler


def late_reward(history: list[dict], evaluations: int = 3) -> float:
    """Mean held-out reward over the run's last ``evaluations`` evaluations (less noisy than the last)."""
    values = [r["held_out_reward"] for r in history if not math.isnan(r["held_out_reward"])]
    return sum(values[-evaluations:]) / len(values[-evaluations:])


@benchmark("rl.run", chapter="rl-systems",
           title="GRPO through the RL system: reward, mismatch and time per phase, six systems from one warm-up")
def rl_run() -> Measurement:
    cfg = backend.pick(cpu=CPU_RUN, gpu=GPU_RUN)
    size = backend.pick(cpu=CPU_POLICY, gpu=GPU_POLICY)
    task, device = AdditionTask(digits=2), backend.device()
    start = warmed_policy(cfg, task, device, size)
    rows, summaries = [], {}
    for name, (system, seed) in SYSTEMS.items():
        t0 = time.perf_counter()
        out = run(replace(cfg, seed=seed), system, task=task, device=device, start=start, policy_size=size,
                  progress=False)
        seconds = time.perf_counter() - t0
        rows += [{"system": name, **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}}
                 for r in out["history"]]
        summaries[name] = {"start_held_out_reward": out["start_held_out_reward"],
                           "final_held_out_reward": out["final_held_out_reward"],
                           "late_held_out_reward": late_reward(out["history"]), "wall_seconds": seconds,
                           "system": asdict(system), "seed": seed}
    s = summaries
    noise = abs(s["plain sampler"]["late_held_out_reward"] - s["plain sampler, seed 1"]["late_held_out_reward"])
    gap = abs(s["engine bf16 + TIS"]["late_held_out_reward"] - s["plain sampler"]["late_held_out_reward"])
    rise = s["engine bf16 + TIS"]["final_held_out_reward"] - s["engine bf16 + TIS"]["start_held_out_reward"]
    return Measurement(
        rows=[{k: v for k, v in r.items()} for r in rows],
        metric="reward (fraction exactly right), KL and mismatch KL (nats/token), seconds per phase",
        goals=[Goal("held-out reward rise, engine bf16 + TIS (points/100)", rise, ">=", backend.pick(cpu=0.0, gpu=0.15)),
               Goal("|engine bf16 + TIS - plain sampler|, late held-out reward", gap, "<=", SAME_CURVE_GOAL)],
        config={**asdict(cfg), "policy_hidden": size[0], "policy_layers": size[1], "systems": summaries,
                "plain_seed_to_seed_gap": noise},
    )
