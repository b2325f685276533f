"""labkit.serve's scheduling under load: preemption by swap against recompute, a seeded
property test over random traces (arrivals, lengths, aborts, forced preemption) that holds
the block accounting to a model after every step, and the trace / replay / metrics layer."""

from __future__ import annotations

import math
import random

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import models, serve
from labkit.serve import metrics

VOCAB = models.TINY.vocab_size


@pytest.fixture(scope="module")
def model() -> models.Decoder:
    return models.Decoder(models.TINY, seed=31, init_std=0.1)


def reference(model: models.Decoder, prompt: list[int], new_tokens: int) -> list[int]:
    return models.generate_greedy(model, torch.tensor([prompt]), new_tokens).tokens[0].tolist()


def live_sequences(llm: serve.LLM) -> list[serve.Sequence]:
    s = llm.scheduler
    return [*s.running, *s.waiting, *s.swapped]


def assert_blocks_consistent(llm: serve.LLM) -> None:
    """Every block's reference count is the number of live tables holding it, on the device and
    in the CPU store; free lists hold exactly the unreferenced blocks, each once."""
    for manager, table_of in ((llm.blocks, lambda s: s.block_table),
                              (llm.scheduler.swap_blocks, lambda s: s.cpu_block_table)):
        if manager is None:
            continue
        expected = [0] * manager.num_blocks
        for seq in live_sequences(llm):
            for block in table_of(seq):
                expected[block] += 1
        assert manager.ref_counts == expected
        free = list(manager._free)
        assert len(free) == len(set(free)), "a block is free twice"
        assert sorted(free) == [b for b, count in enumerate(expected) if count == 0]
    for seq in llm.scheduler.running:
        assert len(seq.block_table) * llm.blocks.block_size >= seq.num_cached
    for seq in llm.scheduler.swapped:
        assert not seq.block_table and len(seq.cpu_block_table) == llm.blocks.blocks_needed(seq.num_cached)
    for seq in llm.scheduler.waiting:
        assert not seq.block_table and not seq.cpu_block_table and seq.num_cached == 0


def assert_nothing_held(llm: serve.LLM) -> None:
    assert llm.blocks.num_free == llm.blocks.num_blocks
    if llm.scheduler.swap_blocks is not None:
        assert llm.scheduler.swap_blocks.num_free == llm.scheduler.swap_blocks.num_blocks


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked"])
def test_swap_preemption_keeps_greedy_outputs_exact(model, chunked):
    """A pool far too small for its requests: they are swapped out and back in, repeatedly,
    and every output is still the model's own greedy continuation."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(7)]
    params = [serve.SamplingParams(max_tokens=rng.randint(4, 14)) for _ in prompts]
    llm = serve.LLM(model, num_blocks=10, block_size=4, max_num_seqs=6, max_num_batched_tokens=32 if not chunked else 6,
                    chunked_prefill=chunked, preemption="swap", num_swap_blocks=64)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    swapped_steps = 0
    while llm.has_unfinished():
        step = llm.step()
        swapped_steps += bool(step.swap_out)
        assert_blocks_consistent(llm)
    assert swapped_steps > 0, "the tiny pool should force swapping"
    outputs = [llm.output(i) for i in ids]
    assert sum(o.num_preemptions for o in outputs) > 0
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.finish_reason == "length" and list(out.tokens) == reference(model, prompt, p.max_tokens)
    assert_nothing_held(llm)


def test_swap_and_recompute_agree_and_a_full_cpu_store_falls_back_to_recompute(model):
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 12))] for _ in range(6)]
    params = serve.SamplingParams(max_tokens=12)
    results = {}
    for name, kwargs in (("recompute", {}), ("swap", dict(preemption="swap", num_swap_blocks=64)),
                         ("swap, 2 CPU blocks", dict(preemption="swap", num_swap_blocks=2))):
        llm = serve.LLM(model, num_blocks=9, block_size=4, max_num_seqs=6, **kwargs)
        results[name] = llm.generate(prompts, params)
        assert_nothing_held(llm)
    tokens = {name: [o.tokens for o in outs] for name, outs in results.items()}
    assert tokens["recompute"] == tokens["swap"] == tokens["swap, 2 CPU blocks"]
    assert sum(o.num_preemptions for o in results["swap"]) > 0


def test_swap_round_trips_block_contents():
    config = models.TINY
    kv = serve.PagedKVCache(config, num_blocks=5, block_size=3)
    kv.k.normal_()
    kv.v.normal_()
    k_before, v_before = kv.k.clone(), kv.v.clone()
    store = serve.SwapSpace(kv, num_blocks=4)
    store.swap_out(kv, [(1, 3), (4, 0)])
    kv.k.zero_()
    kv.v.zero_()
    store.swap_in(kv, [(3, 2), (0, 0)])
    assert torch.equal(kv.k[:, 2], k_before[:, 1]) and torch.equal(kv.v[:, 0], v_before[:, 4])
    assert kv.k[:, [1, 3, 4]].abs().sum() == 0


def test_scheduler_checks_its_preemption_arguments():
    blocks = serve.BlockManager(8, 4)
    with pytest.raises(ValueError, match="preemption must be one of"):
        serve.Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=8, preemption="evict")
    with pytest.raises(ValueError, match="needs swap_blocks"):
        serve.Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=8, preemption="swap")
    with pytest.raises(ValueError, match="block size 4|blocks' size 4"):
        serve.Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=8, preemption="swap",
                        swap_blocks=serve.BlockManager(8, 2))
    with pytest.raises(TypeError, match="PagedKVCache"):
        serve.SwapSpace("pool", 4)


@pytest.mark.parametrize("seed", range(12))
def test_random_traces_never_leak_and_finish_with_the_right_reason(model, seed):
    """Property test, seeded: requests of random lengths arrive between steps, some are aborted
    (waiting, running or swapped), pools are small enough to force preemption of either kind.
    After every step the block accounting matches the live tables; at the end every request has
    finished with the reason it should, aborted ones with a prefix of their greedy output."""
    rng = random.Random(1000 + seed)
    swap = seed % 2 == 1
    block_size = rng.randint(1, 4)
    llm = serve.LLM(model, num_blocks=rng.randint(6, 14), block_size=block_size, max_num_seqs=rng.randint(1, 6),
                    max_num_batched_tokens=rng.choice([5, 12, 64]), chunked_prefill=rng.random() < 0.5,
                    **(dict(preemption="swap", num_swap_blocks=rng.randint(1, 24)) if swap else {}))
    submitted: dict[int, tuple[list[int], int]] = {}
    aborted: set[int] = set()
    to_submit = rng.randint(6, 12)
    preempted = 0
    while to_submit or llm.has_unfinished():
        if to_submit and rng.random() < 0.4:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
            new = rng.randint(1, 10)
            submitted[llm.add_request(prompt, serve.SamplingParams(max_tokens=new))] = (prompt, new)
            to_submit -= 1
        live = live_sequences(llm)
        if live and rng.random() < 0.08:
            victim = rng.choice(live).request_id
            llm.abort(victim)
            aborted.add(victim)
        if llm.has_unfinished():
            step = llm.step()
            preempted += len(step.preempted)
        assert_blocks_consistent(llm)
    for request_id, (prompt, new) in submitted.items():
        out = llm.output(request_id)
        expected = reference(model, prompt, new)
        if request_id in aborted:
            assert out.finish_reason == "abort" and list(out.tokens) == expected[: len(out.tokens)]
        elif llm.blocks.blocks_needed(len(prompt) + new) > llm.blocks.num_blocks or (
                len(prompt) + new > llm.scheduler.max_num_batched_tokens and not llm.scheduler.chunked_prefill):
            assert out.finish_reason == "error"
        else:
            assert out.finish_reason == "length" and list(out.tokens) == expected, out
    assert_nothing_held(llm)


def test_random_traces_force_preemption_somewhere(model):
    """The property test above is only as good as its traces: the tiny pools do preempt."""
    llm = serve.LLM(model, num_blocks=6, block_size=2, max_num_seqs=4, preemption="swap", num_swap_blocks=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(4)]
    outputs = llm.generate(prompts, serve.SamplingParams(max_tokens=6))
    assert sum(o.num_preemptions for o in outputs) > 0


# -- traces, replay, metrics ------------------------------------------------------------------

def test_synthetic_trace_is_seeded_and_in_range():
    kwargs = dict(vocab_size=VOCAB, prompt_lens=(3, 40), output_lens=(1, 9), rate_per_s=5.0,
                  cancel_fraction=0.3, cancel_after_s=(0.5, 2.0))
    trace = serve.synthetic_trace(400, seed=4, **kwargs)
    assert trace == serve.synthetic_trace(400, seed=4, **kwargs)
    assert trace != serve.synthetic_trace(400, seed=5, **kwargs)
    arrivals = [r.arrival_s for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    # Poisson arrivals at 5/s: the mean gap is 0.2 s (400 gaps: well within 20%).
    assert 0.16 < arrivals[-1] / len(trace) < 0.24
    assert all(3 <= len(r.prompt) <= 40 and 1 <= r.max_tokens <= 9 for r in trace)
    assert {len(r.prompt) for r in trace} >= {3, 40} or min(len(r.prompt) for r in trace) <= 4
    cancelled = [r.cancel_after_s for r in trace if r.cancel_after_s is not None]
    assert 0.2 < len(cancelled) / len(trace) < 0.4 and all(0.5 <= c <= 2.0 for c in cancelled)
    # Log-uniform: as many prompts below the geometric middle (about 11) as above it.
    below = sum(len(r.prompt) < math.sqrt(3 * 41) for r in trace) / len(trace)
    assert 0.4 < below < 0.6
    offline = serve.synthetic_trace(5, vocab_size=VOCAB, prompt_lens=(1, 2), output_lens=(1, 2))
    assert all(r.arrival_s == 0 for r in offline)


@pytest.mark.parametrize("bad, match", [(dict(prompt_lens=(5, 2)), "prompt_lens"), (dict(output_lens=(0, 3)), "output_lens"),
                                        (dict(rate_per_s=0), "rate_per_s"), (dict(cancel_fraction=1.5), "cancel_fraction"),
                                        (dict(cancel_after_s=(2.0, 1.0)), "cancel_after_s")])
def test_synthetic_trace_rejects_bad_arguments(bad, match):
    kwargs = dict(vocab_size=VOCAB, prompt_lens=(1, 4), output_lens=(1, 4)) | bad
    with pytest.raises(ValueError, match=match):
        serve.synthetic_trace(3, **kwargs)


def test_metrics_from_a_hand_made_timeline():
    a = metrics.RequestTimeline(0, arrival_s=0.0, prompt_len=5, token_times=[1.0, 1.5, 2.0, 2.5], finish_s=2.5,
                                finish_reason="length")
    b = metrics.RequestTimeline(1, arrival_s=1.0, prompt_len=7, token_times=[4.0], finish_s=4.0, finish_reason="length")
    assert a.ttft_s == 1.0 and a.tpot_s == 0.5 and b.tpot_s is None and b.latency_s == 3.0
    s = metrics.summarize([a, b])
    assert s["output_tokens"] == 5 and s["makespan_s"] == 4.0 and s["throughput_tok_s"] == 5 / 4
    assert s["ttft_p50_s"] == 2.0 and s["tpot_p50_s"] == 0.5 and s["mean_latency_s"] == 2.75
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    times = [t for tl in (a, b) for t in tl.token_times]
    centres, rates = metrics.windowed_rate(times, [1] * len(times), window_s=2.0)
    assert centres == [1.0, 3.0, 5.0] and rates == [1.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="window_s"):
        metrics.windowed_rate(times, [1] * len(times), window_s=0)
    with pytest.raises(ValueError, match="as long"):
        metrics.windowed_rate(times, [1], window_s=1.0)
    with pytest.raises(ValueError, match="finished"):
        metrics.summarize([metrics.RequestTimeline(0, 0.0, 3)])


def test_replay_is_exact_under_both_batchings_and_cancels(model):
    """Replayed with a fixed step time, continuous and static batching serve every request its
    greedy tokens (static ones up to their own length despite the batch's padding); cancelled
    ones stop at their deadline; Little's law holds on the replay's own clock."""
    trace = serve.synthetic_trace(14, vocab_size=VOCAB, prompt_lens=(2, 12), output_lens=(1, 12), rate_per_s=200.0,
                                  cancel_fraction=0.4, cancel_after_s=(0.0, 0.03), seed=6)
    max_len = max(len(r.prompt) for r in trace) + max(r.max_tokens for r in trace)
    batch = serve.static_batch_size(24, 4, max_len)
    replays = {}
    for batching in ("continuous", "static"):
        llm = serve.LLM(model, num_blocks=24, block_size=4, max_num_seqs=8 if batching == "continuous" else batch)
        replays[batching] = r = serve.replay(llm, trace, batching=batching, step_s=0.01,
                                             static_batch_size=batch if batching == "static" else None)
        assert_nothing_held(llm)
        for request, timeline in zip(trace, r.timelines):
            expected = reference(model, list(request.prompt), request.max_tokens)
            assert timeline.finish_s is not None and timeline.token_times == sorted(timeline.token_times)
            assert timeline.tokens == expected[: len(timeline.tokens)]
            if timeline.finish_reason == "abort":
                assert request.cancel_after_s is not None
                assert timeline.finish_s >= request.arrival_s + request.cancel_after_s
                assert len(timeline.token_times) < request.max_tokens
            else:
                assert timeline.finish_reason == "length" and len(timeline.token_times) == request.max_tokens
            assert all(t >= request.arrival_s for t in timeline.token_times)
        assert any(t.finish_reason == "abort" for t in r.timelines)
        assert sum(step.output_tokens for step in r.steps) == sum(len(t.tokens) for t in r.timelines)
        s = r.summary()
        assert r.mean_in_system() == pytest.approx(s["arrival_rate_per_s"] * s["mean_latency_s"], rel=0.25)
    # The static batches hold newcomers back: its median TTFT is no better than continuous batching's.
    assert replays["static"].summary()["ttft_p50_s"] >= replays["continuous"].summary()["ttft_p50_s"]


def test_replay_and_static_batch_size_check_arguments(model):
    llm = serve.LLM(model, num_blocks=8, block_size=4)
    trace = serve.synthetic_trace(2, vocab_size=VOCAB, prompt_lens=(1, 3), output_lens=(1, 3))
    with pytest.raises(TypeError, match="LLM"):
        serve.replay("llm", trace)
    with pytest.raises(ValueError, match="TraceRequest"):
        serve.replay(llm, [])
    with pytest.raises(ValueError, match="batching must be one of"):
        serve.replay(llm, trace, batching="dynamic")
    with pytest.raises(ValueError, match="static_batch_size goes with"):
        serve.replay(llm, trace, static_batch_size=2)
    with pytest.raises(ValueError, match="step_s"):
        serve.replay(llm, trace, step_s=-1.0)
    assert serve.static_batch_size(10, 16, 50) == 3
    with pytest.raises(ValueError, match="does not fit"):
        serve.static_batch_size(2, 4, 9)


def test_figures_draw_every_request_and_every_batching(model):
    """The timeline has a bar pair per batching covering every request; the metrics menu one series
    per batching per metric, and the throughput series sums to the tokens served."""
    from labkit.serve import figures

    trace = serve.synthetic_trace(6, vocab_size=VOCAB, prompt_lens=(2, 6), output_lens=(1, 5), seed=2)
    rows, steps = [], {}
    for batching, kwargs in (("continuous", {}), ("static", dict(batching="static", static_batch_size=2))):
        result = serve.replay(serve.LLM(model, num_blocks=16, block_size=4), trace, step_s=0.5, **kwargs)
        rows += [{"batching": batching, **t.row()} for t in result.timelines]
        steps[batching] = {"end_s": [s.end_s for s in result.steps], "output_tokens": [s.output_tokens for s in result.steps]}
    timeline = figures.request_timeline(rows)
    assert set(timeline) == {"continuous", "static"}
    assert all(len(bar.y) == len(trace) for bars in timeline.values() for bar in bars)
    options = figures.metrics_over_trace(rows, steps, windows=4)
    assert len(options) == 3 and all(len(series) == 2 for series in options.values())
    throughput = next(series for name, series in options.items() if name.startswith("throughput"))
    window = max(r["finish_s"] for r in rows) / 4
    served = sum(r["output_len"] for r in rows if r["batching"] == "continuous")
    assert sum(throughput[0].y) * window == pytest.approx(served)
