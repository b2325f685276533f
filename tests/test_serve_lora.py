"""labkit.serve.lora: many LoRA adapters served at once by the engine, each request with its own.

The oracle for a request's tokens is the book's model adapted with :func:`labkit.lora.add_lora`
(its unmerged reference path), running that request alone. Mirrors src/labkit/serve/lora.py.
"""

import copy

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import check, lora, models, serve

VOCAB = models.TINY.vocab_size


@pytest.fixture(scope="module")
def base() -> models.Decoder:
    return models.Decoder(models.TINY, seed=31, init_std=0.1)


def adapted(base: models.Decoder, rank: int, seed: int, **kwargs) -> models.Decoder:
    """``base`` with LoRA adapters on every block linear, ``B`` random (a fresh adapter's ``B = 0``
    would change nothing)."""
    model = lora.add_lora(copy.deepcopy(base), rank=rank, alpha=2.0 * rank, seed=seed, **kwargs)
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed + 100))
    return model.eval()


@pytest.fixture(scope="module")
def adapters(base) -> dict[str, models.Decoder]:
    return {"a": adapted(base, 4, seed=1), "b": adapted(base, 8, seed=2),
            "c": adapted(base, 2, seed=3, variant="rslora")}


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 15, (count,), generator=gen)]


def greedy(model: models.Decoder, prompt: list[int], new_tokens: int) -> list[int]:
    return models.generate_greedy(model, torch.tensor([prompt]), new_tokens).tokens[0].tolist()


def engine(base, adapters, **kwargs) -> serve.LLM:
    """An engine with four adapter slots holding ``adapters``. Attention runs its plain-torch
    definition (the paged kernels have tests of their own; here they would only be slow under
    the interpreter); the adapters' kernels run as they do on a GPU."""
    settings = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_loras=4, max_lora_rank=8, attention="torch",
                    cuda_graphs=False)
    llm = serve.LLM(copy.deepcopy(base), **{**settings, **kwargs})
    for name, model in adapters.items():
        llm.add_lora(name, model)
    return llm


# (engine settings, asynchronous scheduling): a roomy pool; prompts in chunks of a few tokens;
# a pool so small that running sequences are preempted and recomputed.
SETTINGS = [(dict(), False), (dict(chunked_prefill=True, max_num_batched_tokens=12), True),
            (dict(num_blocks=10, max_num_batched_tokens=40), False)]


@pytest.mark.parametrize("setting, async_scheduling", SETTINGS, ids=["roomy", "chunked-async", "preempting"])
def test_each_request_gets_its_own_adapter(base, adapters, setting, async_scheduling):
    """Mixed batches (adapters of ranks 2, 4 and 8, and the base model) prefilled with SGMV, in
    chunks or after preemption, and decoded with BGMV: every request's greedy tokens are its
    own adapted model's."""
    llm = engine(base, adapters, async_scheduling=async_scheduling, **setting)
    names = ["a", None, "b", "c", "a", "b"]
    batch = prompts(len(names), seed=5)
    outputs = llm.generate(batch, serve.SamplingParams(max_tokens=6), lora=names)
    for prompt, name, out in zip(batch, names, outputs):
        assert out.error is None
        assert list(out.tokens) == greedy(base if name is None else adapters[name], prompt, 6), name
    assert len({tuple(out.tokens) for out in outputs[:4]}) == 4, "the adapters should change the tokens"
    if setting.get("num_blocks") == 10:
        assert sum(out.num_preemptions for out in outputs) > 0, "the small pool should force preemption"
    assert llm.blocks.num_free == llm.blocks.num_blocks


def test_parallel_samples_share_their_requests_adapter(base, adapters):
    llm = engine(base, adapters)
    prompt = prompts(1, seed=9)[0]
    out = llm.generate([prompt], serve.SamplingParams(max_tokens=6, n=3), lora="b")[0]
    assert out.samples == (tuple(greedy(adapters["b"], prompt, 6)),) * 3


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_staged_decode_with_adapters_matches_eager(base, adapters, batch):
    """What a decode graph replays, run eagerly here: the adapter slots staged with the batch and
    padded with -1, BGMV reading them; the logits are the eager step's."""
    model = copy.deepcopy(base)
    slots = serve.lora.AdapterSlots(model, max_loras=3, max_rank=8)
    for name in ("a", "b", "c"):
        slots.load(name, serve.lora.adapter_weights(adapters[name]))
    blocks = serve.BlockManager(num_blocks=40, block_size=4)
    kv = serve.PagedKVCache(model.config, num_blocks=41, block_size=4)
    runner = serve.ModelRunner(model, kv, pad_block=40, max_num_seqs=6, max_model_len=32, adapters=slots)
    seqs = []
    for i, prompt in enumerate(prompts(batch, seed=batch)):
        seq = serve.Sequence(i, prompt, serve.SamplingParams(), lora_slot=[0, -1, 1, 2, 0][i])
        seq.block_table, seq.num_new = blocks.allocate(len(prompt)), len(prompt) - 1
        seqs.append(seq)
    runner.forward(runner.prepare([s for s in seqs if s.num_new]))
    for seq in seqs:
        seq.num_cached, seq.num_new = seq.num_tokens - 1, 1
    eager = runner.forward(runner.prepare(seqs))
    size = runner.stage(runner.prepare(seqs, pad_to=runner.capture_size(batch)))
    staged = runner.forward(runner.static_batch(size))
    check.assert_close(staged[:batch], eager, dtype=torch.float32, name="staged with adapters vs eager")
    for seq, row in zip(seqs, eager):
        oracle = base if seq.lora_slot < 0 else adapters["abc"[seq.lora_slot]]
        check.assert_close(row, oracle(torch.tensor([seq.tokens]))[0, -1], dtype=torch.float32,
                           name=f"sequence {seq.request_id} vs its adapted model")


def test_lora_step_is_per_token_for_decodes_and_per_sequence_for_prefills(base):
    model = copy.deepcopy(base)
    runner = serve.ModelRunner(model, serve.PagedKVCache(model.config, num_blocks=9, block_size=4), pad_block=8,
                               max_num_seqs=4, adapters=serve.lora.AdapterSlots(model, max_loras=2, max_rank=4))
    a = serve.Sequence(0, [1, 2, 3], serve.SamplingParams(), block_table=[0], num_new=3, lora_slot=1)
    b = serve.Sequence(1, [4, 5], serve.SamplingParams(), block_table=[1], num_cached=1, num_new=1)
    mixed = runner.prepare([a, b])
    step = serve.model_runner.lora_step(mixed)
    assert step.token_slots.tolist() == [1, 1, 1, -1] and step.seg_slots.tolist() == [1, -1]
    assert step.seg_starts.tolist() == [0, 3, 4] and step.max_segment == 3
    a.num_cached, a.num_new = 2, 1
    decode = serve.model_runner.lora_step(runner.prepare([b, a], pad_to=4))
    assert decode.seg_starts is None and decode.token_slots.tolist() == [-1, 1, -1, -1]
    assert serve.model_runner.lora_step(runner.prepare([b])) is None  # no adapter in the step: nothing to add


def test_bad_adapters_and_requests_get_clear_errors(base, adapters):
    llm = engine(base, {"a": adapters["a"]})
    outputs = llm.generate(prompts(2, seed=1), serve.SamplingParams(max_tokens=3), lora=["a", "zzz"])
    assert outputs[0].error is None and "no adapter named 'zzz'" in outputs[1].error
    plain = serve.LLM(copy.deepcopy(base), num_blocks=16, block_size=4)
    assert "serves no adapters" in plain.generate([[1, 2]], lora="a")[0].error
    with pytest.raises(ValueError, match="construct it with max_loras"):
        plain.add_lora("a", adapters["a"])
    with pytest.raises(ValueError, match="loaded already"):
        llm.add_lora("a", adapters["a"])
    with pytest.raises(ValueError, match="above max_lora_rank 8"):
        llm.add_lora("big", adapted(base, 16, seed=4))
    for variant, kind in (("dora", "DoRA"), ("pissa", "PiSSA")):
        with pytest.raises(ValueError, match=f"is a {kind} layer"):
            llm.add_lora(variant, adapted(base, 2, seed=5, variant=variant))
    with pytest.raises(ValueError, match="has no LoRA layers"):
        llm.add_lora("none", base)
    for name in ("b", "c", "d"):
        llm.add_lora(name, adapters["b"])
    with pytest.raises(ValueError, match="all 4 adapter slots are in use"):
        llm.add_lora("e", adapters["b"])
    request = llm.add_request([1, 2, 3], serve.SamplingParams(max_tokens=2), lora="d")
    with pytest.raises(ValueError, match="in use by a queued or running request"):
        llm.remove_lora("d")
    while llm.has_unfinished():
        llm.step()
    assert llm.output(request).error is None
    llm.remove_lora("d")
    llm.add_lora("e", adapters["c"])  # the freed slot is reused
    with pytest.raises(KeyError, match="no adapter named 'd'"):
        llm.remove_lora("d")
    with pytest.raises(ValueError, match="prefix caching with adapters"):
        serve.LLM(copy.deepcopy(base), num_blocks=16, max_loras=2, prefix_caching="radix")
    with pytest.raises(ValueError, match="max_loras must be an int"):
        serve.LLM(copy.deepcopy(base), num_blocks=16, max_loras=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_adapters_inside_decode_graphs_on_gpu(base, adapters, async_scheduling):
    """On the GPU the decode steps replay graphs that contain the BGMV launches, reading the
    staged slots; the prefills run eagerly with SGMV. Tokens as each adapted model's, in fp32."""
    on_gpu = {name: copy.deepcopy(model).cuda() for name, model in {None: base, **adapters}.items()}
    llm = serve.LLM(copy.deepcopy(base).cuda(), num_blocks=64, block_size=4, max_num_seqs=8, max_loras=4,
                    max_lora_rank=8, max_model_len=64, async_scheduling=async_scheduling)
    assert llm.runner.cuda_graphs and llm.runner.piecewise is None
    for name, model in on_gpu.items():
        if name is not None:
            llm.add_lora(name, model)
    names = ["a", None, "b", "c", "a", "b", None, "c"]
    batch = prompts(len(names), seed=6)
    outputs = llm.generate(batch, serve.SamplingParams(max_tokens=10), lora=names)
    for prompt, name, out in zip(batch, names, outputs):
        want = models.generate_greedy(on_gpu[name], torch.tensor([prompt], device="cuda"), 10).tokens[0].tolist()
        assert list(out.tokens) == want, name
