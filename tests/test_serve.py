"""labkit.serve: the engine's outputs against labkit.models' and HF's greedy generation, its
sampling, its block accounting over random traces, and requests that fail alone."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import threading
import time
import urllib.error

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import backend, check, models, serve
from test_models import hf_twin, token_ids

VOCAB = models.TINY.vocab_size


@pytest.fixture(scope="module")
def model() -> models.Decoder:
    return models.Decoder(models.TINY, seed=31, init_std=0.1)  # wide enough that tokens vary


def random_prompts(count: int, seed: int, max_len: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def reference(model: models.Decoder, prompt: list[int], new_tokens: int) -> list[int]:
    prompt_ids = torch.tensor([prompt], device=model.embed.weight.device)
    return models.generate_greedy(model, prompt_ids, new_tokens).tokens[0].tolist()


def serve_with_steps(llm: serve.LLM, prompts, params) -> tuple[list[serve.RequestOutput], list[tuple[int, int, int]]]:
    """``llm.generate`` step by step; per step, how many prefills and decodes ran and how many
    tokens went through the model (counted from the growth of each sequence's cached tokens)."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = []
    while llm.has_unfinished():
        cached_before = {seq.request_id: seq.num_cached for seq in [*llm.scheduler.running, *llm.scheduler.waiting]}
        step = llm.step()
        tokens = sum(seq.num_cached - cached_before[seq.request_id] for seq in step.prefills + step.decodes)
        steps.append((len(step.prefills), len(step.decodes), tokens))
    return [llm.output(i) for i in ids], steps


def assert_no_blocks_held(llm: serve.LLM) -> None:
    assert llm.blocks.num_free == llm.blocks.num_blocks
    assert all(count == 0 for count in llm.blocks.ref_counts)


# (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, chunked_prefill): a roomy
# pool; one sequence at a time; small steps; a pool so small that running sequences get
# preempted; prompts split into chunks of a few tokens, without and with preemption.
SETTINGS = [(128, 4, 16, 512, False), (128, 8, 1, 512, False), (64, 3, 3, 40, False), (12, 4, 8, 64, False),
            (64, 4, 4, 7, True), (12, 4, 8, 5, True)]
IDS = ["roomy", "one-at-a-time", "small-steps", "preempting", "chunked", "chunked-preempting"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_greedy_matches_generate_greedy(model, setting, async_scheduling):
    num_blocks, block_size, max_seqs, max_tokens, chunked = setting
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=num_blocks, block_size=block_size,
                    max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, chunked_prefill=chunked)
    prompts = random_prompts(8, seed=sum(setting))
    rng = random.Random(7)
    params = [serve.SamplingParams(max_tokens=rng.randint(1, 16)) for _ in prompts]
    outputs, steps = serve_with_steps(llm, prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.error is None and out.finish_reason == "length"
        assert list(out.tokens) == reference(model, prompt, p.max_tokens)
    assert all(prefills + decodes <= max_seqs for prefills, decodes, _ in steps)
    assert all(tokens <= max_tokens for _, _, tokens in steps)
    if chunked:
        assert any(prefills and decodes for prefills, decodes, _ in steps), "chunks should share steps with decodes"
    if num_blocks == 12:
        assert sum(out.num_preemptions for out in outputs) > 0, "the tiny pool should force preemption"
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("async_scheduling, decode_matmul", [(False, "torch"), (True, "torch"), (False, "split_k")],
                         ids=["sync", "async", "sync-split_k"])  # (the interpreter's split-K steps are slow)
def test_fused_model_serves_the_plain_models_greedy_tokens(async_scheduling, decode_matmul):
    """A fused model gets its projections stacked by the engine (one matmul for q, k, v, one
    kernel for norms, rotation and cache stores) and still serves the plain model's tokens,
    under chunked prefill and preemption, with those matmuls through F.linear or the split-K
    kernel."""
    device = labkit.backend.device()  # one device for both: a seed draws other weights on a GPU's generator
    plain = models.Decoder(models.TINY, seed=17, init_std=0.1, device=device)
    fused = models.Decoder(models.TINY, seed=17, init_std=0.1, device=device, fused=True)
    fused.decode_matmul = decode_matmul
    llm = serve.LLM(fused, async_scheduling=async_scheduling, num_blocks=8, block_size=4, max_num_seqs=3,
                    max_num_batched_tokens=6, chunked_prefill=True)
    assert fused.projections_fused
    prompts = random_prompts(4, seed=5, max_len=12)
    outputs = llm.generate(prompts, serve.SamplingParams(max_tokens=6))
    for prompt, out in zip(prompts, outputs):
        assert out.error is None and list(out.tokens) == reference(plain, prompt, 6)
    assert sum(out.num_preemptions for out in outputs) > 0, "the small pool should force preemption"
    assert_no_blocks_held(llm)


def test_greedy_matches_hf_generate():
    hf, ours = hf_twin(models.TINY, seed=41)
    llm = serve.LLM(ours, num_blocks=16, block_size=4, max_num_seqs=4)
    prompts = token_ids(3, 9, VOCAB, seed=42).tolist()
    outputs = llm.generate(prompts, serve.SamplingParams(max_tokens=10))
    for prompt, out in zip(prompts, outputs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
        assert list(out.tokens) == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_token_ends_a_request(model, async_scheduling):
    prompt = random_prompts(1, seed=3)[0]
    greedy = reference(model, prompt, 12)
    stop = greedy[4]
    out = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=32, block_size=4).generate(
        [prompt], serve.SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert list(out.tokens) == greedy[: greedy.index(stop) + 1]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_step_reports_where_the_hosts_time_went(model, async_scheduling, monkeypatch):
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=32, block_size=4)
    assert llm.last_step_timing is None
    llm.add_request(random_prompts(1, seed=5)[0], serve.SamplingParams(max_tokens=4))
    # A scheduler that takes 20 ms: the step's schedule phase holds those 20 ms, within the step's wall time.
    schedule = llm.scheduler.schedule

    def slow_schedule():
        time.sleep(0.02)
        return schedule()

    monkeypatch.setattr(llm.scheduler, "schedule", slow_schedule)
    for _ in range(2):
        started = time.perf_counter()
        llm.step()
        wall = time.perf_counter() - started
        timing = llm.last_step_timing
        assert isinstance(timing, serve.StepTiming)
        assert min(timing.schedule, timing.launch, timing.wait, timing.apply) >= 0.0
        assert 0.02 <= timing.schedule and timing.total <= wall
        assert min(timing.inputs, timing.placeholders, timing.forward, timing.sample) >= 0.0
        assert (timing.inputs + timing.placeholders + timing.forward + timing.sample
                == pytest.approx(timing.launch, abs=1e-9))
        # on a CPU the sampled tokens are on the host at once: no step waits for a device
        assert timing.wait == 0.0


def test_placeholders_take_the_pending_tokens_in_place():
    # -1 - j stands for token j of the step in flight; real tokens stay as they are
    ids = torch.tensor([5, -1, 7, -3, -2], device=backend.device())
    serve.model_runner.fill_placeholders(ids, torch.tensor([40, 41, 42], device=backend.device()))
    assert ids.tolist() == [5, 40, 7, 42, 41]


@pytest.mark.parametrize("part", ["inputs", "placeholders", "forward", "sample"])
def test_step_timing_splits_the_launch_where_its_time_went(model, part, monkeypatch):
    """A decode step's launch made 0.2 s slower in one part (packing the inputs, putting the
    step in flight's tokens in place, the forward, or sampling) shows the 0.2 s in that part of
    StepTiming, against the decode steps before it, and not in the others. The model's forward
    is replaced by constant logits, so that no part's own time (the interpreter's forward takes
    a variable fraction of a second) hides the delay."""
    delay = 0.2
    llm = serve.LLM(model, async_scheduling=True, num_blocks=32, block_size=4)
    monkeypatch.setattr(llm.runner, "forward", lambda batch: torch.zeros(batch.num_seqs, VOCAB))
    llm.add_request(random_prompts(1, seed=6)[0], serve.SamplingParams(max_tokens=8))
    llm.step()  # the prefill
    baseline = []
    for _ in range(3):  # each part's least time over three decode steps
        llm.step()
        baseline.append(llm.last_step_timing)
    slowed = {"inputs": (llm.runner, "prepare"), "placeholders": (serve.model_runner, "fill_placeholders"),
              "forward": (llm.runner, "forward"), "sample": (serve.engine, "sample_tokens")}[part]
    original = getattr(*slowed)

    def slow(*args, **kwargs):
        time.sleep(delay)
        return original(*args, **kwargs)

    monkeypatch.setattr(*slowed, slow)
    llm.step()
    after = llm.last_step_timing
    grew = {name: getattr(after, name) - min(getattr(t, name) for t in baseline)
            for name in ("inputs", "placeholders", "forward", "sample")}
    assert grew[part] >= delay * 0.9, grew
    assert all(abs(grew[other]) < delay / 2 for other in grew if other != part), grew


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_reproduces_under_any_schedule(model, async_scheduling):
    prompts = random_prompts(4, seed=11, max_len=12)
    params = [serve.SamplingParams(temperature=1.3, top_k=50, top_p=0.9, max_tokens=8, seed=100 + i)
              for i in range(len(prompts))]
    def engine(**kwargs):
        return serve.LLM(model, async_scheduling=async_scheduling, **kwargs)

    roomy = engine(num_blocks=128, block_size=8).generate(prompts, params)
    tight = engine(num_blocks=10, block_size=4, max_num_seqs=2).generate(prompts, params)
    alone = [engine(num_blocks=32, block_size=4).generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.tokens for o in roomy] == [o.tokens for o in tight] == [o.tokens for o in alone]
    reseeded = [serve.SamplingParams(temperature=1.3, top_k=50, top_p=0.9, max_tokens=8, seed=200 + i)
                for i in range(len(prompts))]
    other = engine(num_blocks=128, block_size=8).generate(prompts, reseeded)
    assert [o.tokens for o in other] != [o.tokens for o in roomy]


def test_sampler_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    picks = {serve.sample(logits, serve.SamplingParams(temperature=5.0, top_k=2), gen) for _ in range(200)}
    assert picks == {0, 1}
    # probabilities at temperature 1: 0.64, 0.24, 0.09, ...; top_p 0.8 keeps the first two
    picks = {serve.sample(logits, serve.SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(200)}
    assert picks == {0, 1}
    picks = {serve.sample(logits, serve.SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(50)}
    assert picks == {0}
    assert serve.sample(logits, serve.SamplingParams()) == 0
    assert serve.sample(logits, serve.SamplingParams(temperature=1e-9), gen) == 0  # no overflow to NaN


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                 dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
                                 dict(stop_token_ids=[1]), dict(seed="1"), dict(n=0), dict(n=2.0)])
def test_sampling_params_are_validated(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        serve.SamplingParams(**bad)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bad_requests_fail_alone(model, async_scheduling):
    good = random_prompts(3, seed=21)
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=16, block_size=4, max_num_seqs=4)
    prompts = [good[0], [], good[1], [VOCAB], list(range(60)), good[2], good[0]]
    params = [serve.SamplingParams(max_tokens=6)] * 6 + [dict(temperature=-1.0)]
    outputs = llm.generate(prompts, params)
    errors = [out.error for out in outputs]
    assert [e is None for e in errors] == [True, False, True, False, False, True, False]
    assert "non-empty" in errors[1]
    assert f"[0, {VOCAB})" in errors[3]
    assert "can never fit" in errors[4]
    assert "temperature" in errors[6]
    for i, prompt in ((0, good[0]), (2, good[1]), (5, good[2])):
        assert list(outputs[i].tokens) == reference(model, prompt, 6)
    assert_no_blocks_held(llm)


def test_overlong_prompt_fails_alone(model):
    llm = serve.LLM(model, num_blocks=4096, block_size=16, max_num_batched_tokens=100_000)
    too_long = [1] * models.TINY.max_position_embeddings
    out = llm.generate([too_long, [5, 6]], serve.SamplingParams(max_tokens=3))
    assert "positions" in out[0].error and out[1].error is None
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_blocks(model, async_scheduling):
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=32, block_size=4)
    ids = [llm.add_request(p, serve.SamplingParams(max_tokens=20)) for p in random_prompts(3, seed=5)]
    llm.step()
    llm.abort(ids[1])
    while llm.has_unfinished():
        llm.step()
    assert llm.output(ids[1]).finish_reason == "abort"
    assert [llm.output(i).finish_reason for i in (ids[0], ids[2])] == ["length", "length"]
    assert_no_blocks_held(llm)
    with pytest.raises(KeyError, match="not queued or running"):
        llm.abort(ids[1])


def test_async_scheduling_applies_each_step_one_call_later(model):
    """A step's tokens reach the requests one step() later, taken from the device as the next
    step's inputs in the meantime; a request that stops has spent one more step, whose token is
    dropped; the outputs are the synchronous engine's."""
    prompt = random_prompts(1, seed=3)[0]
    greedy = reference(model, prompt, 12)
    stop = greedy[4]
    params = serve.SamplingParams(max_tokens=12, stop_token_ids=(stop,))
    calls = []
    for async_scheduling in (False, True):
        llm = serve.LLM(model, num_blocks=32, block_size=4, async_scheduling=async_scheduling)
        request = llm.add_request(prompt, params)
        seen, steps = [], 0
        while llm.has_unfinished():
            step = llm.step()
            steps += bool(step.prefills or step.decodes)
            tokens, _ = llm.progress(request)
            seen.append(len(tokens[0]))
            assert all(t >= 0 for t in tokens[0])  # placeholders never show
        assert list(llm.output(request).tokens) == greedy[:greedy.index(stop) + 1]
        assert_no_blocks_held(llm)
        calls.append((steps, seen))
    (sync_steps, sync_seen), (async_steps, async_seen) = calls
    assert async_steps == sync_steps + 1  # the step queued before the stop token was known
    assert async_seen[0] == 0 and async_seen[1:len(sync_seen)] == sync_seen[:len(sync_seen) - 1]


def test_runner_takes_pending_tokens_from_the_device(model):
    """Placeholder inputs (-1 - i) become token i of the step in flight: the same logits as the real ids."""
    blocks = serve.BlockManager(num_blocks=40, block_size=4)
    kv = serve.PagedKVCache(model.config, num_blocks=41, block_size=4)
    runner = serve.ModelRunner(model, kv, pad_block=40, max_num_seqs=4, attention="torch")
    seqs = scattered_sequences(blocks, [(5, 1), (0, 3), (9, 1)], seed=4)
    for seq in seqs:
        seq.num_new = seq.num_tokens - 1
    runner.forward(runner.prepare([s for s in seqs if s.num_new]))
    for seq, new in zip(seqs, (1, 3, 1)):
        seq.num_cached, seq.num_new = seq.num_tokens - new, new
    want = runner.execute(seqs)
    in_flight = torch.tensor([seqs[2].tokens[-1], 7, seqs[0].tokens[-1]])
    seqs[0].prompt[-1], seqs[2].prompt[-1] = -3, -1  # tokens 2 and 0 of the step in flight
    check.assert_close(runner.execute(seqs, pending_tokens=in_flight), want, dtype=torch.float32,
                       name="pending tokens vs real ids")


def test_block_manager_fork_copy_on_write():
    blocks = serve.BlockManager(num_blocks=6, block_size=4)
    parent = blocks.allocate(6)                      # one full block and a partial one
    child = blocks.fork(parent)
    assert blocks.ref_counts[parent[0]] == blocks.ref_counts[parent[1]] == 2
    copy = blocks.append_slot(child, 6)              # writing to the shared partial block copies it
    assert copy == (parent[1], child[1]) and child[0] == parent[0] and child[1] != parent[1]
    assert blocks.append_slot(parent, 6) is None     # the parent now owns its partial block alone
    blocks.free(parent)
    blocks.free(child)
    assert blocks.num_free == 6
    with pytest.raises(ValueError, match="double free"):
        blocks.free([0])
    with pytest.raises(ValueError, match="only 6"):
        blocks.allocate(25)
    blocks.allocate(24)
    with pytest.raises(serve.NoFreeBlocks):
        blocks.allocate(1)


@pytest.mark.parametrize("seed", range(30))
def test_block_manager_random_traces_never_leak(seed):
    """Random allocations, appends, forks and frees against a model of who holds what."""
    rng = random.Random(seed)
    blocks = serve.BlockManager(num_blocks=rng.randint(4, 24), block_size=rng.randint(1, 5))
    live: list[tuple[list[int], int]] = []           # (block table, tokens stored)
    for _ in range(300):
        action = rng.random()
        try:
            if action < 0.3 or not live:
                tokens = rng.randint(1, 3 * blocks.block_size)
                live.append((blocks.allocate(tokens), tokens))
            elif action < 0.6:
                i = rng.randrange(len(live))
                table, tokens = live[i]
                blocks.append_slot(table, tokens)
                live[i] = (table, tokens + 1)
            elif action < 0.75:
                table, tokens = rng.choice(live)
                live.append((blocks.fork(table), tokens))
            else:
                blocks.free(live.pop(rng.randrange(len(live)))[0])
        except serve.NoFreeBlocks:
            pass
        expected = [0] * blocks.num_blocks
        for table, tokens in live:
            assert len(table) == blocks.blocks_needed(tokens)
            for block in table:
                expected[block] += 1
        assert blocks.ref_counts == expected
        assert blocks.num_free == expected.count(0)
    for table, _ in live:
        blocks.free(table)
    assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
def test_engine_random_traces_with_arrivals_and_aborts(model, seed, async_scheduling):
    """Requests arrive between steps and some are aborted; greedy outputs stay exact, no block leaks."""
    rng = random.Random(seed)
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=rng.randint(8, 16),
                    block_size=rng.randint(2, 4),
                    max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=48)
    pending = random_prompts(8, seed=50 + seed, max_len=12)
    submitted: dict[int, tuple[list[int], int]] = {}
    while pending or llm.has_unfinished():
        if pending and rng.random() < 0.5:
            prompt, new = pending.pop(), rng.randint(1, 12)
            submitted[llm.add_request(prompt, serve.SamplingParams(max_tokens=new))] = (prompt, new)
        if llm.scheduler.running and rng.random() < 0.05:
            llm.abort(rng.choice(llm.scheduler.running).request_id)
        if llm.has_unfinished():
            step = llm.step()
            assert len(step.prefills) + len(step.decodes) <= llm.scheduler.max_num_seqs
            assert len(step.decodes) + sum(len(s.tokens) - 1 for s in step.prefills) <= 48  # -1: the token just sampled
        assert all(count >= 0 for count in llm.blocks.ref_counts)
    for request_id, (prompt, new) in submitted.items():
        out = llm.output(request_id)
        expected = reference(model, prompt, new)
        if out.finish_reason == "abort":
            assert list(out.tokens) == expected[: len(out.tokens)]
        elif out.finish_reason == "error":  # the smallest pools cannot hold the longest requests
            assert "can never fit" in out.error
            assert llm.blocks.blocks_needed(len(prompt) + new) > llm.blocks.num_blocks
        else:
            assert out.finish_reason == "length" and list(out.tokens) == expected
    assert_no_blocks_held(llm)


def test_engine_validates_its_arguments(model):
    with pytest.raises(TypeError, match="Decoder"):
        serve.LLM("model", num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks"):
        serve.LLM(model, num_blocks=0)
    with pytest.raises(ValueError, match="max_model_len"):
        serve.LLM(model, num_blocks=4, max_model_len=models.TINY.max_position_embeddings + 1)
    llm = serve.LLM(model, num_blocks=4)
    with pytest.raises(TypeError, match="prompts"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="one SamplingParams or a list of 2"):
        llm.generate([[1], [2]], [serve.SamplingParams()])


def test_paged_storage_round_trips_and_copies_on_write():
    """Tokens written through a scattered block table read back in order; a forked
    sequence's write lands in its private copy and leaves the parent's tokens alone."""
    config, block_size = models.TINY, 3
    blocks = serve.BlockManager(num_blocks=8, block_size=block_size)
    kv = serve.PagedKVCache(config, num_blocks=8, block_size=block_size)
    blocks.allocate(2)                                # so the table below does not start at block 0
    table = blocks.allocate(7)
    gen = torch.Generator().manual_seed(0)
    shape = (1, config.num_kv_heads, 7, config.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    parent = kv.sequence(table, 0)
    for layer in range(config.num_layers):
        k_all, v_all = parent.append(layer, k, v)
        assert torch.equal(k_all, k) and torch.equal(v_all, v)
    parent.advance(7)
    child_table = blocks.fork(table)
    source, destination = blocks.append_slot(child_table, 7)
    kv.copy_block(source, destination)
    k_new, v_new = torch.randn(1, config.num_kv_heads, 1, config.head_dim, generator=gen), torch.zeros(
        1, config.num_kv_heads, 1, config.head_dim)
    child_k, _ = kv.sequence(child_table, 7).append(0, k_new, v_new)
    assert torch.equal(child_k, torch.cat([k, k_new], dim=2))
    assert torch.equal(serve.gather_kv(kv.k[0], torch.tensor(table), 7), k)
    with pytest.raises(ValueError, match="do not fit"):
        kv.sequence(table, 6).append(0, k[:, :, :4], v[:, :, :4])


# -- the packed forward (model runner) ------------------------------------------------------

def scattered_sequences(blocks: serve.BlockManager, lengths_cached_new: list[tuple[int, int]], seed: int):
    """Sequences of random tokens whose first ``cached`` tokens are to be stored and ``new`` run next,
    each with a block table taken from a pool that other allocations have already scattered."""
    rng = random.Random(seed)
    seqs = []
    for i, (cached, new) in enumerate(lengths_cached_new):
        blocks.allocate(rng.randint(1, 2 * blocks.block_size))  # a gap, so tables interleave
        seq = serve.Sequence(i, [rng.randrange(VOCAB) for _ in range(cached + new)], serve.SamplingParams())
        seq.block_table = blocks.allocate(cached + new)
        seqs.append(seq)
    return seqs


def _model_for(fused: bool | str, device) -> models.Decoder:
    """The tiny test model unfused, fused, or fused with its projections stacked ("stacked"),
    their matmuls through the split-K kernel too ("split_k")."""
    model = models.Decoder(models.TINY, seed=31, init_std=0.1, device=device, fused=bool(fused))
    if fused in ("stacked", "split_k"):
        model.fuse_projections()
    if fused == "split_k":
        model.decode_matmul = "split_k"
    return model


@pytest.mark.parametrize("fused", [False, True, "stacked", "split_k"], ids=["eager", "fused", "stacked", "split_k"])
def test_packed_forward_matches_each_sequence_alone(fused):
    """One packed forward over fresh prefills, chunk continuations and decodes gives every
    sequence the logits of its own full forward pass (no cache at all), on this machine's
    device (the paged kernels, and the fused ones, run there; "stacked": one matmul for q, k
    and v, and one kernel for their norms, rotation and cache stores; "split_k": those
    matmuls, the output and the down projections through labkit.matmul's split-K kernel)."""
    device = labkit.backend.device()
    model = _model_for(fused, device)
    block_size = 4
    blocks = serve.BlockManager(num_blocks=96, block_size=block_size)
    kv = serve.PagedKVCache(model.config, num_blocks=97, block_size=block_size, device=device)
    runner = serve.ModelRunner(model, kv, pad_block=96, max_num_seqs=8)
    # (cached, new): a fresh prefill, a decode, a chunk after a chunk, a one-token prompt, a decode
    plan = [(0, 9), (13, 1), (6, 5), (0, 1), (3, 1)]
    seqs = scattered_sequences(blocks, plan, seed=3)
    # store each sequence's cached tokens first, in a packed prefill of its own
    warm = [s for s, (cached, _) in zip(seqs, plan) if cached]
    for seq, (cached, _) in zip(seqs, plan):
        seq.num_new = cached
    runner.forward(runner.prepare(warm))
    for seq, (cached, new) in zip(seqs, plan):
        seq.num_cached, seq.num_new = cached, new
    logits = runner.execute(seqs)
    assert logits.shape == (len(seqs), VOCAB)
    model.decode_matmul = "torch"  # the reference: each sequence alone, every matmul F.linear
    for seq, row in zip(seqs, logits):
        alone = model(torch.tensor([seq.tokens], device=device))[0, -1]
        check.assert_close(row, alone, dtype=torch.float32, name=f"sequence {seq.request_id}")


def test_split_k_decode_matmul_runs_the_split_k_kernel(monkeypatch):
    """With decode_matmul "split_k" a packed step of at most SPLIT_K_MAX_ROWS tokens sends
    every layer's stacked q/k/v, output, gate/up and down matmuls to the split-K launcher,
    and a larger step none of them; a name other than "torch" or "split_k" is refused."""
    from labkit.matmul import kernels as matmul_kernels
    from labkit.models import decoder

    calls = []
    launch = matmul_kernels.split_k_launch

    def counted_launch(a, b, c, **kwargs):
        calls.append(b.shape)
        return launch(a, b, c, **kwargs)

    monkeypatch.setattr(matmul_kernels, "split_k_launch", counted_launch)
    device = labkit.backend.device()
    model = _model_for("split_k", device)
    config = model.config
    with torch.no_grad():
        for tokens in (3, decoder.SPLIT_K_MAX_ROWS + 1):
            calls.clear()
            kv = serve.PagedKVCache(config, num_blocks=24, block_size=4, device=device)
            runner = serve.ModelRunner(model, kv, pad_block=23, max_num_seqs=2)
            blocks = serve.BlockManager(num_blocks=23, block_size=4)
            seqs = scattered_sequences(blocks, [(0, tokens)], seed=1)
            seqs[0].num_new = tokens
            runner.execute(seqs)
            h, hd = config.hidden_size, config.head_dim
            per_layer = [(h, (config.num_heads + 2 * config.num_kv_heads) * hd), (config.num_heads * hd, h),
                         (h, 2 * config.intermediate_size), (config.intermediate_size, h)]
            assert calls == (per_layer * config.num_layers if tokens <= decoder.SPLIT_K_MAX_ROWS else []), tokens
    with pytest.raises(ValueError, match="decode_matmul must be one of"):
        model.decode_matmul = "cublas"


def test_prepare_packs_positions_slots_and_offsets(model):
    block_size = 4
    kv = serve.PagedKVCache(model.config, num_blocks=11, block_size=block_size)
    runner = serve.ModelRunner(model, kv, pad_block=10, max_num_seqs=4)
    a = serve.Sequence(0, [5, 6, 7, 8, 9, 10], serve.SamplingParams(), block_table=[7, 2], num_cached=3, num_new=3)
    b = serve.Sequence(1, [1, 2], serve.SamplingParams(), block_table=[4], num_cached=1, num_new=1)
    batch = runner.prepare([a, b])
    assert batch.input_ids.tolist() == [[8, 9, 10, 2]]
    assert batch.positions.tolist() == [3, 4, 5, 1]
    assert batch.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 4 * 4 + 1]
    assert batch.block_tables.tolist() == [[7, 2], [4, 10]]      # padded with the pad block
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4]
    assert batch.lengths.tolist() == [6, 2]
    assert batch.logits_indices.tolist() == [2, 3]
    assert not batch.decode_only and runner.prepare([b]).decode_only
    # A one-token step is not always a sequence's last token (a one-token chunk of a prompt).
    c = serve.Sequence(2, [5, 6, 7, 8], serve.SamplingParams(), output=[9], block_table=[3, 1], num_cached=1, num_new=1)
    padded = runner.prepare([b, c], pad_to=4)  # padding rows: token 0 at position 0 of the pad block
    assert padded.decode_only and padded.num_seqs == 4
    assert padded.input_ids.tolist() == [[2, 6, 0, 0]]
    assert padded.positions.tolist() == [1, 1, 0, 0]
    assert padded.slot_mapping.tolist() == [4 * 4 + 1, 3 * 4 + 1, 10 * 4, 10 * 4]
    assert padded.block_tables.tolist() == [[4, 10], [3, 1], [10, 10], [10, 10]]
    assert padded.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert padded.lengths.tolist() == [2, 2, 1, 1]
    assert padded.logits_indices.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="pad_to pads decode steps"):
        runner.prepare([a, b], pad_to=4)
    with pytest.raises(ValueError, match="pad_to pads decode steps"):
        runner.prepare([b, c], pad_to=1)
    a.num_new = 9
    with pytest.raises(ValueError, match="do not fit"):
        runner.prepare([a])
    with pytest.raises(ValueError, match="at least one"):
        runner.prepare([])


def test_each_step_runs_one_forward(model):
    calls = []
    handle = model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    try:
        llm = serve.LLM(model, num_blocks=64, block_size=4, max_num_seqs=8)
        ids = [llm.add_request(p, serve.SamplingParams(max_tokens=5)) for p in random_prompts(6, seed=8)]
        steps = 0
        while llm.has_unfinished():
            step = llm.step()
            steps += 1
            assert calls[-1] == (1, sum(s.num_new for s in step.prefills + step.decodes))
        assert len(calls) == steps and all(llm.output(i).finish_reason == "length" for i in ids)
    finally:
        handle.remove()


def test_decoder_packed_arguments_are_checked(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="positions go with a packed batch"):
        model(ids, positions=torch.arange(3))
    with pytest.raises(ValueError, match="not both"):
        model(ids, last_only=True, logits_indices=torch.tensor([2]))
    kv = serve.PagedKVCache(model.config, num_blocks=3, block_size=4)
    runner = serve.ModelRunner(model, kv, pad_block=2, max_num_seqs=2)
    seq = serve.Sequence(0, [1, 2, 3], serve.SamplingParams(), block_table=[0], num_new=3)
    batch = runner.prepare([seq])
    with pytest.raises(ValueError, match=r"input_ids \[1, N\] with positions \[N\]"):
        model(ids, serve.PagedBatchKV(kv, batch), positions=torch.arange(2))


def test_cuda_graphs_need_a_gpu(model):
    kv = serve.PagedKVCache(model.config, num_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="CUDA device"):
        serve.ModelRunner(model, kv, pad_block=2, max_num_seqs=2, cuda_graphs=True)
    assert serve.LLM(model, num_blocks=4).runner.cuda_graphs is False  # the CPU runs eagerly
    assert serve.capture_sizes(1) == [1]
    assert serve.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert serve.capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert serve.capture_sizes(300)[-6:] == [240, 248, 256, 272, 288, 300]
    runner = serve.LLM(model, num_blocks=4, max_num_seqs=4).runner
    with pytest.raises(ValueError, match=r"no graph of size 3: the capture sizes are \[1, 2, 4\]"):
        runner.graph(3)
    with pytest.raises(RuntimeError, match="does not use CUDA graphs"):
        runner.graph(4)


def test_sample_batch_rows_match_rows_alone():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=gen)
    params = [serve.SamplingParams(), serve.SamplingParams(temperature=0.8, top_k=5, seed=1),
              serve.SamplingParams(temperature=1.5, top_p=0.7, seed=2), serve.SamplingParams(temperature=1.0, seed=3)]
    generators = lambda: [None] + [torch.Generator().manual_seed(p.seed) for p in params[1:]]  # noqa: E731
    together = serve.sample_batch(logits, params, generators())
    alone = [serve.sample(row, p, g) for row, p, g in zip(logits, params, generators())]
    assert together == alone and together[0] == int(logits[0].argmax())
    with pytest.raises(ValueError, match="B = len"):
        serve.sample_batch(logits, params[:2], generators()[:2])


def test_top_k_top_p_filter_per_row():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    masked = serve.apply_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.8, 1.0]))
    kept = torch.isfinite(masked)
    assert kept.tolist() == [[True, True, False, False, False], [True, True, False, False, False], [True] * 5]
    assert torch.equal(masked[kept], logits[kept])


# -- the memory budget -------------------------------------------------------------------------

def test_memory_budget_arithmetic():
    """vLLM's sum on injected numbers: total x utilization, minus weights, activation peak and
    non-torch growth, in whole blocks of 2 x layers x block_size x kv_heads x head_dim x bytes."""
    config = models.QWEN3_SIZES["Qwen3-0.6B"]
    block = serve.kv_block_bytes(config, 16, torch.bfloat16)
    assert block == 2 * 28 * 16 * 8 * 128 * 2  # Qwen3-0.6B: 28 layers, 8 KV heads of 128
    gib = 1 << 30
    budget = serve.plan_memory(total=140 * gib, gpu_memory_utilization=0.5, weights=3 * gib // 2,
                               activation_peak=gib // 4, non_torch=gib // 8, block_bytes=block)
    assert budget.requested == 70 * gib
    assert budget.kv_cache == 70 * gib - 3 * gib // 2 - gib // 4 - gib // 8
    assert budget.num_blocks == budget.kv_cache // block
    assert 0 <= budget.kv_cache - budget.num_blocks * block < block
    assert [name for name, _ in budget.table()][0] == "total"
    with pytest.raises(ValueError, match="no room for the KV cache"):
        serve.plan_memory(total=4 * gib, gpu_memory_utilization=0.3, weights=gib, activation_peak=gib // 4,
                          non_torch=0, block_bytes=block)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            serve.plan_memory(total=gib, gpu_memory_utilization=bad, weights=0, activation_peak=0,
                              non_torch=0, block_bytes=block)
    with pytest.raises(ValueError, match="weights"):
        serve.plan_memory(total=gib, gpu_memory_utilization=0.9, weights=-1, activation_peak=0,
                          non_torch=0, block_bytes=block)


def test_weight_bytes_counts_tied_weights_once(model):
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert serve.weight_bytes(model) == params + buffers
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.embed.weight


def test_budgeting_needs_a_gpu(model):
    with pytest.raises(ValueError, match="num_blocks is required"):
        serve.LLM(model)
    with pytest.raises(ValueError, match="CUDA device"):
        serve.profile_memory(model, gpu_memory_utilization=0.9, block_size=16, max_num_batched_tokens=64,
                             max_num_seqs=4)


# -- parallel sampling (n > 1) -------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy", "preempting"])
def test_parallel_samples_share_the_prompt_and_reproduce(model, num_blocks, async_scheduling):
    """n samples fork after one prefill; sample i equals a lone request seeded seed + i, under any
    pool, so the copy-on-write of the shared last block kept every sample's KV its own."""
    prompts = random_prompts(2, seed=17, max_len=10)
    params = serve.SamplingParams(temperature=1.0, top_k=40, max_tokens=9, seed=5, n=3)
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=num_blocks, block_size=4, max_num_seqs=6)
    ids = [llm.add_request(p, params) for p in prompts]
    forward_tokens = 0
    while llm.has_unfinished():
        step = llm.step()
        forward_tokens += sum(s.num_new for s in step.prefills + step.decodes)
    outputs = [llm.output(i) for i in ids]
    for prompt, out in zip(prompts, outputs):
        assert len(out.samples) == 3 and all(len(s) == 9 for s in out.samples)
        for index, sample in enumerate(out.samples):
            alone = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=32, block_size=4).generate(
                [prompt], serve.SamplingParams(temperature=1.0, top_k=40, max_tokens=9, seed=5 + index))[0]
            assert sample == alone.tokens
        assert len(set(out.samples)) > 1, "different seeds should give different samples"
    if num_blocks == 64:  # each prompt went through the model once, not three times
        assert forward_tokens == sum(len(p) for p in prompts) + len(prompts) * 3 * 8
    else:
        assert sum(o.num_preemptions + sum(m.num_preemptions for m in o.more_samples) for o in outputs) > 0
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_parallel_greedy_samples_agree_and_abort_stops_them_all(model, async_scheduling):
    prompt = random_prompts(1, seed=2)[0]
    llm = serve.LLM(model, async_scheduling=async_scheduling, num_blocks=32, block_size=4)
    out = llm.generate([prompt], serve.SamplingParams(max_tokens=6, n=2))[0]
    assert out.samples == (tuple(reference(model, prompt, 6)),) * 2
    request = llm.add_request(prompt, serve.SamplingParams(max_tokens=20, n=3, temperature=0.7))
    llm.step()
    llm.step()
    samples, finished = llm.progress(request)
    assert len(samples) == 3 and finished is None
    llm.abort(request)
    out = llm.output(request)
    assert [out.finish_reason] + [m.finish_reason for m in out.more_samples] == ["abort"] * 3
    assert llm.progress(request)[1] is out
    assert_no_blocks_held(llm)
    assert "n=5" in serve.LLM(model, async_scheduling=async_scheduling, num_blocks=32, max_num_seqs=4).generate(
        [prompt], serve.SamplingParams(n=5))[0].error


# -- the HTTP server -------------------------------------------------------------------------------

@pytest.fixture
def server(model):
    llm = serve.LLM(model, num_blocks=64, block_size=4, max_num_seqs=8)
    with serve.CompletionServer(llm) as running:
        yield running
    assert_no_blocks_held(llm)


def test_server_streams_the_greedy_tokens(server, model):
    prompt = random_prompts(1, seed=9)[0]
    chunks = list(serve.server.stream(server.url, {"prompt": prompt, "max_tokens": 7, "temperature": 0}))
    tokens = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    assert tokens == reference(model, prompt, 7)
    assert len(chunks) >= 2 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    whole = serve.server.complete(server.url, {"prompt": prompt, "max_tokens": 7, "temperature": 0})
    assert whole["choices"][0]["token_ids"] == tokens
    assert whole["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 7, "total_tokens": len(prompt) + 7}


def test_server_serves_concurrent_clients_and_text(server, model):
    prompts = random_prompts(4, seed=12)
    results = [None] * len(prompts)

    def client(i):
        results[i] = serve.server.complete(server.url, {"prompt": prompts[i], "max_tokens": 5, "temperature": 0})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, result in zip(prompts, results):
        assert result["choices"][0]["token_ids"] == reference(model, prompt, 5)
    text = serve.server.complete(server.url, {"prompt": "Hi!", "max_tokens": 4, "temperature": 0})
    assert text["usage"]["prompt_tokens"] == 3  # three bytes
    assert text["choices"][0]["token_ids"] == reference(model, list(b"Hi!"), 4)
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "seed": 3, "top_k": 20}
    sampled = serve.server.complete(server.url, body)
    assert [c["index"] for c in sampled["choices"]] == [0, 1]
    streamed = {0: [], 1: []}
    for chunk in serve.server.stream(server.url, body):
        for c in chunk["choices"]:
            streamed[c["index"]] += c["token_ids"]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in sampled["choices"]]  # seeded: the same samples


@pytest.mark.parametrize("body, message", [
    ({"prompt": []}, "non-empty"), ({"prompt": [1], "temperature": -1}, "temperature"),
    ({"prompt": 5}, "prompt must be a string"), ({"prompt": [1], "stop": ["x"]}, "unsupported fields"),
    ({"prompt": [1], "max_tokens": 50_000}, "max_model_len"), ({"prompt": [VOCAB + 3]}, "token ids must be"),
])
def test_server_refuses_bad_requests_and_keeps_serving(server, model, body, message):
    for send in (serve.server.complete, lambda url, b: list(serve.server.stream(url, b))):
        with pytest.raises(urllib.error.HTTPError, match=message) as failure:
            send(server.url, body)
        assert failure.value.code == 400
    ok = serve.server.complete(server.url, {"prompt": [4, 5], "max_tokens": 3, "temperature": 0})
    assert ok["choices"][0]["token_ids"] == reference(model, [4, 5], 3)


def test_server_malformed_json_and_routes(server):
    import http.client
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 400 and "JSON" in reply.read().decode()
    conn.request("GET", "/v1/models")
    reply = conn.getresponse()
    assert reply.status == 200 and "labkit" in reply.read().decode()
    conn.request("GET", "/nowhere")
    reply = conn.getresponse()
    assert reply.status == 404 and reply.read()
    conn.close()


def test_server_aborts_a_stream_whose_client_leaves(model):
    llm = serve.LLM(model, num_blocks=600, block_size=4)
    steps = []
    step = llm.step
    llm.step = lambda: steps.append(1) or step()  # count the engine's steps
    max_tokens = 2000
    with serve.CompletionServer(llm) as server:
        events = serve.server.stream(server.url, {"prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0})
        next(events)
        events.close()  # drops the connection after the first chunk
        while llm.has_unfinished():
            threading.Event().wait(0.01)
    assert len(steps) < max_tokens, "the abandoned request should have been aborted, not run to its end"
    assert_no_blocks_held(llm)


# -- on a GPU: CUDA graphs and the measured budget -------------------------------------------------

@pytest.mark.gpu
def test_replaying_a_runners_graph_reruns_the_step_last_staged():
    llm = serve.LLM(models.Decoder(models.TINY, seed=31, device="cuda"), num_blocks=32, block_size=4, max_num_seqs=4)
    for prompt in random_prompts(3, seed=8):
        llm.add_request(prompt, serve.SamplingParams(max_tokens=8))
    while llm.scheduler.waiting or any(s.num_cached < s.num_tokens - 1 for s in llm.scheduler.running):
        llm.step()
    seqs = llm.scheduler.schedule().decodes  # one token each, its slot allocated
    assert len(seqs) == 3
    logits = llm.runner.execute(seqs)  # a view of the graph of size 4's output
    staged = logits.clone()
    logits.zero_()
    llm.runner.graph(llm.runner.capture_size(len(seqs))).replay()
    torch.testing.assert_close(logits, staged, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_steps_wait_is_the_time_blocked_on_the_device(async_scheduling):
    """Work queued on the device before a step (a kernel of some 10 ms) shows in the ``wait`` of
    the step that applies the tokens queued behind it: that same step with the update after
    each step; the next one with asynchronous scheduling (the step right after the kernel
    applies tokens sampled before it)."""
    llm = serve.LLM(models.Decoder(models.TINY, seed=31, device="cuda"), async_scheduling=async_scheduling,
                    num_blocks=32, block_size=4)
    llm.add_request(random_prompts(1, seed=5)[0], serve.SamplingParams(max_tokens=4))
    llm.step()
    llm.step()  # compiled, captured and warm
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    llm.step()
    waits = [llm.last_step_timing.wait]
    llm.step()
    waits.append(llm.last_step_timing.wait)
    assert max(waits) > 0.004 and (waits[0] > 0.004) == (not async_scheduling)


# In a fresh process: this one may have launched the fill's kernels already.
FIRST_FILL_BEHIND_QUEUED_WORK = """
import torch
from labkit import models, serve
model = models.Decoder(models.TINY, seed=0, device="cuda")
serve.LLM(model, num_blocks=8, block_size=4, max_num_seqs=2, cuda_graphs=False)  # builds the runner
ids, pending = torch.tensor([-1, 5], device="cuda"), torch.tensor([7], device="cuda")
torch.cuda.synchronize()
torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU work
serve.model_runner.fill_placeholders(ids, pending)
print("returned while queued" if not torch.cuda.current_stream().query() else "waited for the queue")
torch.cuda.synchronize()
assert ids.tolist() == [7, 5], ids.tolist()
"""


@pytest.mark.gpu
def test_the_first_placeholder_fill_after_building_a_runner_waits_for_nothing_queued():
    """CUDA loads a kernel at its first launch, and the load waits for all the work queued. The
    runner launches the placeholder fill once when it is built, so that the first asynchronous
    step does not load its kernels behind the step in flight (on an H100 a first fill issued behind
    20 ms of queued work held the host 0.10 s): after building an engine, a fill issued behind a
    second of GPU sleep returns while the sleep still runs."""
    run = subprocess.run([sys.executable, "-c", FIRST_FILL_BEHIND_QUEUED_WORK], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "returned while queued"


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-stacked"])
def test_an_asynchronous_launch_makes_no_call_that_synchronizes(fused):
    """What asynchronous scheduling rests on (and the chapter says): queuing a step (its block
    copies, inputs, forward and sampling, and the copy of its tokens to the host) reads nothing
    back from the device. torch's sync debug mode raises at the synchronizing calls it knows
    (a prototype: it does not see every wait, such as a kernel's first launch, whose loading waits
    for the work queued: see the test before this one). The same requests run
    twice, the second time under it (the first compiles and tunes every kernel the steps launch:
    the autotuner's timing waits), with decode steps graphed and eager."""
    prompts = random_prompts(3, seed=8)
    params = serve.SamplingParams(max_tokens=8)
    for cuda_graphs in (True, False):
        model = models.Decoder(models.TINY, seed=31, init_std=0.1, device="cuda", fused=fused)
        llm = serve.LLM(model, async_scheduling=True, cuda_graphs=cuda_graphs, num_blocks=32, block_size=4,
                        max_num_seqs=4)
        expected = llm.generate(prompts, params)
        launch, launches = llm._launch, []

        def launch_strictly(step, launch=launch, launches=launches):
            torch.cuda.set_sync_debug_mode("error")
            try:
                launches.append(launch(step))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            return launches[-1]

        llm._launch = launch_strictly
        outputs = llm.generate(prompts, params)
        assert [out.tokens for out in outputs] == [out.tokens for out in expected]
        assert sum(item is not None for item in launches) >= params.max_tokens, "every step should launch checked"
        assert_no_blocks_held(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [SETTINGS[0], SETTINGS[3], SETTINGS[5]], ids=["roomy", "preempting", "chunked"])
@pytest.mark.parametrize("fused", [False, True, "split_k"], ids=["plain", "fused-stacked", "fused-stacked-split-k"])
def test_cuda_graphs_change_no_token_on_gpu(setting, fused):
    """Greedy outputs with decode steps replayed from graphs (batches padded to capture sizes),
    with and without asynchronous scheduling, equal the eager engine's and generate_greedy's,
    in fp32 on the GPU; a fused model also runs its stacked projections ("split_k": through
    the split-K kernel, autotuned before each capture)."""
    num_blocks, block_size, max_seqs, max_tokens, chunked = setting
    plain = models.Decoder(models.TINY, seed=31, init_std=0.1, device="cuda")
    model = models.Decoder(models.TINY, seed=31, init_std=0.1, device="cuda", fused=bool(fused))
    if fused == "split_k":
        model.decode_matmul = "split_k"
    prompts = random_prompts(10, seed=4)
    params = [serve.SamplingParams(max_tokens=n) for n in random.Random(5).choices(range(1, 20), k=len(prompts))]
    outs = {}
    for graphs, async_scheduling in ((True, False), (True, True), (False, False)):
        llm = serve.LLM(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
                        max_num_batched_tokens=max_tokens, chunked_prefill=chunked, cuda_graphs=graphs,
                        max_model_len=64, async_scheduling=async_scheduling)
        outs[graphs, async_scheduling] = [o.tokens for o in llm.generate(prompts, params)]
        assert llm.runner.cuda_graphs is graphs and bool(llm.runner._graphs) is graphs
        assert model.projections_fused is bool(fused)
        assert_no_blocks_held(llm)
    assert outs[True, False] == outs[True, True] == outs[False, False]
    for prompt, p, tokens in zip(prompts, params, outs[True, False]):
        assert list(tokens) == reference(plain, prompt, p.max_tokens)


@pytest.mark.gpu
def test_memory_budget_is_measured_on_gpu():
    model = models.Decoder(models.TINY, device="cuda", dtype=torch.bfloat16)
    llm = serve.LLM(model, max_num_batched_tokens=512, gpu_memory_utilization=0.05, block_size=16)
    budget = llm.memory_budget
    assert budget.weights == serve.weight_bytes(model) and budget.activation_peak > 0
    assert llm.blocks.num_blocks == budget.num_blocks - 1
    assert llm.kv.k.nbytes + llm.kv.v.nbytes <= budget.kv_cache
    out = llm.generate([[1, 2, 3]], serve.SamplingParams(max_tokens=4))[0]
    assert out.error is None and len(out.tokens) == 4


def test_runner_decode_attention_matches_the_paged_reference():
    """The runner's decode path (no host reads: capturable, and no stall per layer) against the
    reference, over a scattered pool."""
    gen = torch.Generator().manual_seed(6)
    device = labkit.backend.device()  # where the kernel runs
    k_pool, v_pool = torch.randn(2, 13, 4, 2, 16, generator=gen).to(device)
    q = torch.randn(3, 4, 16, generator=gen).to(device)
    tables = torch.tensor([[5, 0, 12, 7], [3, 12, 12, 12], [9, 1, 2, 12]], dtype=torch.int32, device=device)  # 12 pads
    lengths = torch.tensor([14, 1, 9], dtype=torch.int32, device=device)
    want = serve.attention.paged_decode_attention_reference(q, k_pool, v_pool, tables, lengths)
    got = serve.model_runner.runner_decode_attention(q, k_pool, v_pool, tables, lengths)
    check.assert_close(got, want, dtype=torch.float32, name="runner decode attention")


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_staged_padded_decode_matches_eager(model, batch):
    """What a graph replays, run eagerly on the CPU: the batch staged into the static inputs,
    padded to its capture size, through the capturable attention: the real rows' logits equal
    the eager step's, and the padding rows wrote nowhere but the pad block."""
    block_size = 4
    blocks = serve.BlockManager(num_blocks=40, block_size=block_size)
    kv = serve.PagedKVCache(model.config, num_blocks=41, block_size=block_size)
    runner = serve.ModelRunner(model, kv, pad_block=40, max_num_seqs=6, max_model_len=32)
    seqs = scattered_sequences(blocks, [(c, 1) for c in (7, 0, 12, 3, 9)][:batch], seed=batch)
    for seq in seqs:
        seq.num_new = len(seq.tokens) - 1
    runner.forward(runner.prepare([s for s in seqs if s.num_new]))  # store all but each last token
    for seq in seqs:
        seq.num_cached, seq.num_new = len(seq.tokens) - 1, 1
    eager = runner.forward(runner.prepare(seqs))
    pool_before = kv.k[:, :40].clone()
    size = runner.stage(runner.prepare(seqs))
    assert size == next(s for s in runner.graph_sizes if s >= batch)
    staged = runner.forward(runner.static_batch(size))
    check.assert_close(staged[:batch], eager, dtype=torch.float32, name="staged vs eager")
    # Padded on the host, as execute stages a batch for its graph: the same logits.
    assert runner.stage(runner.prepare(seqs, pad_to=size)) == size
    check.assert_close(runner.forward(runner.static_batch(size))[:batch], eager, dtype=torch.float32,
                       name="staged (padded on the host) vs eager")
    # A narrower batch after a wider one: the static tables' columns past its width still hold the
    # wider batch's blocks, which no kernel reads.
    narrow = [min(seqs, key=lambda seq: len(seq.block_table))]
    narrow_size = runner.stage(runner.prepare(narrow, pad_to=1))
    check.assert_close(runner.forward(runner.static_batch(narrow_size))[:1], runner.forward(runner.prepare(narrow)),
                       dtype=torch.float32, name="narrow batch staged after a wider one")
    # the real rows rewrote their own slots (same values, up to rounding); padding touched only the pad block
    check.assert_close(kv.k[:, :40], pool_before, dtype=torch.float32, name="pool outside the pad block")
    with pytest.raises(ValueError, match="only decode batches"):
        runner.stage(dataclasses.replace(runner.prepare(seqs), decode_only=False))


@pytest.mark.parametrize("fused", [False, True, "stacked"], ids=["eager", "fused", "stacked"])
@pytest.mark.parametrize("max_tokens", [16, 40])
def test_piecewise_step_matches_eager(fused, max_tokens):
    """What the piecewise graphs replay, run inline on this machine: a mixed step's tokens
    staged into the static inputs and padded to their token size, attention between the
    pieces: every sequence's logits equal the eager step's, and the padding tokens wrote
    nowhere but the pad block."""
    device = labkit.backend.device()
    model = _model_for(fused, device)
    block_size = 4
    blocks = serve.BlockManager(num_blocks=60, block_size=block_size)
    kv = serve.PagedKVCache(model.config, num_blocks=61, block_size=block_size, device=device)
    runner = serve.ModelRunner(model, kv, pad_block=60, max_num_seqs=3, max_num_batched_tokens=max_tokens)
    assert runner.piecewise.sizes == {16: [16], 40: [16, 32, 40]}[max_tokens]
    plan = [(0, 9), (13, 1), (6, 5)]  # a fresh prefill, a decode, a chunk after a chunk: 15 tokens, size 16
    seqs = scattered_sequences(blocks, plan, seed=8)
    for seq, (cached, _) in zip(seqs, plan):
        seq.num_new = cached
    runner.forward(runner.prepare([s for s, (cached, _) in zip(seqs, plan) if cached]))
    for seq, (cached, new) in zip(seqs, plan):
        seq.num_cached, seq.num_new = cached, new
    batch = runner.prepare(seqs)
    eager = runner.forward(batch)
    pool_before = kv.k[:, :60].clone()
    stale = torch.full_like(runner.piecewise.attn_out, 7.0)
    runner.piecewise.attn_out.copy_(stale)  # rows attention does not write keep garbage: no real row may read them
    pieces = runner.forward_piecewise(batch)
    assert pieces.shape == eager.shape == (3, VOCAB)
    check.assert_close(pieces, eager, dtype=torch.float32, name="piecewise vs eager")
    check.assert_close(kv.k[:, :60], pool_before, dtype=torch.float32, name="pool outside the pad block")
    assert runner.piecewise.size_for(max_tokens + 1) is None  # a larger step runs eagerly
    assert serve.token_sizes(8) == [8] and serve.token_sizes(64) == [16, 32, 64]
    crowded = serve.ModelRunner(model, kv, pad_block=60, max_num_seqs=2, max_num_batched_tokens=max_tokens)
    with pytest.raises(ValueError, match="3 sequences is above the 2"):
        crowded.forward_piecewise(batch)
    with pytest.raises(RuntimeError, match="no piecewise graphs"):
        serve.ModelRunner(model, kv, pad_block=60, max_num_seqs=3).forward_piecewise(batch)


def test_server_survives_a_failing_step(model):
    llm = serve.LLM(model, num_blocks=64, block_size=4)
    step = llm.step
    failures = [RuntimeError("injected")]

    def flaky_step():
        if failures:
            raise failures.pop()
        return step()

    llm.step = flaky_step
    with serve.CompletionServer(llm) as server:
        with pytest.raises(urllib.error.HTTPError, match="the engine failed a step: RuntimeError: injected") as err:
            serve.server.complete(server.url, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert err.value.code == 500
        ok = serve.server.complete(server.url, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert ok["choices"][0]["token_ids"] == reference(model, [1, 2, 3], 4)
    assert_no_blocks_held(llm)


def test_public_helpers_refuse_bad_arguments(model):
    with pytest.raises(ValueError, match=r"\[B, vocab\]"):
        serve.apply_top_k_top_p(torch.zeros(5), None, None)
    with pytest.raises(ValueError, match=r"top_k must be None or a \[2\] tensor"):
        serve.apply_top_k_top_p(torch.zeros(2, 5), torch.tensor([1, 2, 3]), None)
    with pytest.raises(ValueError, match="logits must be \\[vocab\\]"):
        serve.sample(torch.zeros(2, 5), serve.SamplingParams())
    with pytest.raises(TypeError, match="DecoderConfig"):
        serve.kv_block_bytes("Qwen3", 16, torch.bfloat16)
    with pytest.raises(ValueError, match="max_batch must be positive"):
        serve.capture_sizes(0)
    with pytest.raises(TypeError, match="labkit.serve.LLM"):
        serve.CompletionServer(model)
    with pytest.raises(ValueError, match="max_model_len must be positive"):
        serve.ModelRunner(model, serve.PagedKVCache(model.config, 2, 4), pad_block=1, max_num_seqs=1, max_model_len=0)


@pytest.mark.skipif(backend.on_gpu(), reason="on a GPU it runs at full size: python -m labkit.bench "
                                              "serve.engine_decode")
def test_engine_decode_benchmark_records_each_step_phase_and_the_launch_in_parts():
    from labkit import benchmarks, results

    rec = benchmarks.run("serve.engine_decode", record=False)
    assert results.validate(rec.to_dict()) == []
    phases, parts = rec.config["engine_step_phases_ms"], rec.config["engine_step_launch_parts_ms"]
    assert set(phases) == set(parts) == {"graphed", "graphed_async", "eager"}
    for mode in phases:
        assert sum(parts[mode].values()) == pytest.approx(phases[mode]["launch"], rel=1e-6)
