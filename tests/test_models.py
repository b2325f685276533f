"""labkit.models: the book's decoder against HF transformers' Qwen3, and its KV caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import backend, check, models
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

DEV = backend.device()  # where the Triton decode kernel runs (the HF comparisons stay on the CPU)
UNTIED = dataclasses.replace(models.TINY, tie_word_embeddings=False)


def hf_twin(config: models.DecoderConfig, seed: int = 0):
    """A random ``Qwen3ForCausalLM`` of the same shapes, and our model holding its weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3Config(**models.hf_config_kwargs(config))
    hf_config._attn_implementation = "eager"  # the plain reference path, not an SDPA of its own
    hf = transformers.Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():  # HF's 0.02 init makes near-uniform logits; widen them so errors show
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(5.0)
    ours = models.Decoder(config, seed=seed + 1)  # different weights until loaded
    models.load_hf_state_dict(ours, hf.state_dict())
    return hf, ours


def token_ids(batch: int, length: int, vocab: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


@pytest.mark.parametrize("config", [models.TINY, UNTIED], ids=["tied", "untied"])
def test_logits_match_hf_qwen3(config):
    hf, ours = hf_twin(config)
    ids = token_ids(3, 29, config.vocab_size, seed=1)
    with torch.no_grad():
        check.assert_close(ours(ids), hf(ids).logits, dtype=torch.float32, name="logits vs HF")


def test_cached_decoding_matches_hf_full_forward():
    hf, ours = hf_twin(UNTIED, seed=3)
    ids = token_ids(2, 23, UNTIED.vocab_size, seed=2)
    cache = ours.new_cache(batch=2, capacity=23)
    with torch.no_grad():
        steps = [ours(ids[:, :17], cache)] + [ours(ids[:, t:t + 1], cache) for t in range(17, 23)]
        want = hf(ids).logits
    check.assert_close(torch.cat(steps, dim=1), want, dtype=torch.float32, name="prefill+decode vs HF")


def test_bfloat16_model_tracks_hf_in_bfloat16():
    hf, ours = hf_twin(models.TINY, seed=4)
    ids = token_ids(2, 19, models.TINY.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(ids).logits  # fp32
        got = ours.to(torch.bfloat16)(ids)
    assert got.dtype == torch.bfloat16
    check.assert_close(got, ref, tol=3e-2, name="bf16 logits vs fp32 HF")  # several bf16 layers of rounding


@pytest.mark.parametrize("mode", ["growing", "preallocated"])
@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "triton"])
def test_cached_generation_equals_recomputation(mode, decode_kernel):
    model = models.Decoder(UNTIED, seed=7, init_std=0.1, device=DEV)
    prompt = token_ids(3, 13, UNTIED.vocab_size, seed=8, device=DEV)
    want = models.generate_greedy(model, prompt, 9, cache="recompute")
    got = models.generate_greedy(model, prompt, 9, cache=mode, decode_kernel=decode_kernel)
    assert len(set(want.tokens.flatten().tolist())) > 3, "degenerate model: the test would prove nothing"
    check.assert_close(got.logits, want.logits, dtype=torch.float32, name=f"{mode} logits")
    assert torch.equal(got.tokens, want.tokens)


def test_graphed_generation_equals_recomputation():
    """On a GPU every step after the first replays a CUDA graph; on the CPU the same static step runs eagerly."""
    model = models.Decoder(UNTIED, seed=7, init_std=0.1, device=DEV)
    prompt = token_ids(3, 13, UNTIED.vocab_size, seed=8, device=DEV)
    want = models.generate_greedy(model, prompt, 9, cache="recompute")
    got = models.generate_greedy(model, prompt, 9, cache="graphed")
    check.assert_close(got.logits, want.logits, dtype=torch.float32, name="graphed logits")
    assert torch.equal(got.tokens, want.tokens)


class OpTrace(TorchDispatchMode):
    """Every ATen op a region runs, with its non-tensor arguments and its tensors' shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = pytree.tree_leaves((args, kwargs or {}))
        self.ops.append((str(func), tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
            else "storage" if isinstance(a, torch.UntypedStorage) else a for a in leaves)))
        return func(*args, **(kwargs or {}))


def test_static_step_runs_the_same_ops_at_every_position():
    """What a CUDA graph replays is the ops, arguments and shapes of the step it captured.
    A static step must not depend on the host's length; a KVCache step does (its slices)."""
    model = models.Decoder(models.TINY, seed=21, init_std=0.1)
    prompt = token_ids(2, 5, models.TINY.vocab_size, seed=22)
    runner = models.GraphedDecoder(model, batch=2, capacity=40)
    cache = model.new_cache(batch=2, capacity=40)
    static_ops, plain_ops = [], []
    with torch.no_grad():
        runner.prefill(prompt)
        model(prompt, cache)
        for token in ([[3], [4]], [[5], [6]], [[7], [8]]):
            runner.ids.copy_(torch.tensor(token))
            runner.cache.stage_step()
            with OpTrace() as trace:
                runner._forward()
            static_ops.append(trace.ops)
            with OpTrace() as trace:
                model(torch.tensor(token), cache, last_only=True)
            plain_ops.append(trace.ops)
    assert runner.cache.length == cache.length == 8
    assert static_ops[0] == static_ops[1] == static_ops[2]
    assert plain_ops[0] != plain_ops[1]  # the trace does see position-dependent work


def test_static_cache_writes_at_its_device_position():
    cache = models.StaticKVCache(models.TINY, batch=2, capacity=6, device=DEV)
    check.poison(cache.k)
    kv = torch.ones(2, models.TINY.num_kv_heads, 1, models.TINY.head_dim, device=DEV)
    filled(cache)
    cache.stage_step()
    assert cache.position.tolist() == [3] and cache.lengths.tolist() == [4, 4]
    k, _ = cache.append(1, kv, kv)
    assert k.shape[2] == 6 and torch.equal(k[:, :, 3:4], kv)  # the whole capacity, written at 3
    assert cache.k[1, :, :, 4:].isnan().all()


def test_chunked_prefill_equals_one_prefill():
    model = models.Decoder(models.TINY, seed=9, init_std=0.1)
    ids = token_ids(2, 31, models.TINY.vocab_size, seed=10)
    cache = model.new_cache(batch=2, capacity=40)
    with torch.no_grad():
        chunks = torch.cat([model(ids[:, :12], cache), model(ids[:, 12:], cache)], dim=1)
        check.assert_close(chunks, model(ids), dtype=torch.float32, name="two-chunk prefill")
    assert cache.length == 31


def test_positions_past_the_cached_length_are_never_read():
    model = models.Decoder(models.TINY, seed=11, init_std=0.1, device=DEV)
    ids = token_ids(2, 10, models.TINY.vocab_size, seed=12, device=DEV)
    cache = model.new_cache(batch=2, capacity=32)
    check.poison(cache.k)
    check.poison(cache.v)
    with torch.no_grad():
        model(ids[:, :9], cache)
        step = model(ids[:, 9:], cache, decode_kernel=True)
        check.assert_close(step[:, 0], model(ids)[:, -1], dtype=torch.float32, name="step over a poisoned cache")


def test_truncate_then_redo_a_step_gives_the_same_logits():
    model = models.Decoder(models.TINY, seed=13, init_std=0.1)
    ids = token_ids(1, 8, models.TINY.vocab_size, seed=14)
    with torch.no_grad():
        for cache in (model.new_cache(1, 16), models.GrowingKVCache(models.TINY, 1)):
            model(ids[:, :7], cache)
            first = model(ids[:, 7:], cache)
            cache.truncate(7)
            again = model(ids[:, 7:], cache)
            assert cache.length == 8 and torch.equal(first, again)


def test_last_only_is_the_last_row_of_all_logits():
    model = models.Decoder(models.TINY, seed=15)
    ids = token_ids(2, 6, models.TINY.vocab_size, seed=16)
    with torch.no_grad():
        check.assert_close(model(ids, last_only=True), model(ids)[:, -1:], dtype=torch.float32, name="last_only")


def test_state_dict_round_trip_through_hf_names():
    transformers = pytest.importorskip("transformers")
    ours = models.Decoder(UNTIED, seed=17, init_std=0.1)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**models.hf_config_kwargs(UNTIED))).eval()
    hf.load_state_dict(models.to_hf_state_dict(ours))
    ids = token_ids(2, 9, UNTIED.vocab_size, seed=18)
    with torch.no_grad():
        check.assert_close(hf(ids).logits, ours(ids), dtype=torch.float32, name="HF holding our weights")


def test_config_translates_both_ways():
    transformers = pytest.importorskip("transformers")
    for config in (models.TINY, UNTIED, models.BOOK_GPU):
        hf = transformers.Qwen3Config(**models.hf_config_kwargs(config))
        assert models.config_from_hf(hf.to_dict()) == config


def test_kv_bytes_and_parameter_count_agree_with_allocations():
    model = models.Decoder(UNTIED)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert UNTIED.num_parameters() == sum(unique.values())
    tied = models.Decoder(models.TINY)
    assert models.TINY.num_parameters() == sum({id(p): p.numel() for p in tied.parameters()}.values())
    cache = models.KVCache(models.TINY, batch=3, capacity=5, dtype=torch.bfloat16)
    assert cache.nbytes == 3 * 5 * models.TINY.kv_bytes_per_token(2)


def test_key_mapping_is_a_bijection_on_the_models_keys():
    keys = list(models.Decoder(UNTIED).state_dict())
    assert [models.hf_key_to_ours(models.our_key_to_hf(k)) for k in keys] == keys


# --- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("changes, error", [
    (dict(num_kv_heads=3), ValueError),
    (dict(head_dim=15), ValueError),
    (dict(hidden_size=0), ValueError),
    (dict(num_layers=2.0), TypeError),
    (dict(rope_theta=-1.0), ValueError),
    (dict(tie_word_embeddings=1), TypeError),
])
def test_config_rejects_bad_values(changes, error):
    with pytest.raises(error):
        dataclasses.replace(models.TINY, **changes)


def test_forward_rejects_bad_input():
    model = models.Decoder(models.TINY)
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="cache"):
        model(torch.zeros(1, 3, dtype=torch.long), cache={})
    small = dataclasses.replace(models.TINY, max_position_embeddings=4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        models.Decoder(small)(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="DecoderConfig"):
        models.Decoder({"hidden_size": 8})
    with pytest.raises(ValueError, match="init_std"):
        models.Decoder(models.TINY, init_std=0)


KV3 = torch.zeros(2, models.TINY.num_kv_heads, 3, models.TINY.head_dim)  # 3 positions, batch 2


def filled(cache):
    """``cache`` with 3 positions cached in every layer."""
    for layer in range(models.TINY.num_layers):
        cache.append(layer, KV3, KV3)
    cache.advance(3)
    return cache


@pytest.mark.parametrize("make", [lambda: models.KVCache(models.TINY, batch=2, capacity=4),
                                  lambda: models.StaticKVCache(models.TINY, batch=2, capacity=4),
                                  lambda: models.GrowingKVCache(models.TINY, batch=2)],
                         ids=["preallocated", "static", "growing"])
@pytest.mark.parametrize("bad, error, match", [
    (lambda c: c.append(models.TINY.num_layers, KV3, KV3), ValueError, "layer"),
    (lambda c: c.append(0, KV3[:1], KV3[:1]), ValueError, "batch"),
    (lambda c: c.append(0, KV3, KV3[:, :, :2]), ValueError, "must match"),
    (lambda c: c.append(0, KV3.numpy(), KV3), TypeError, "k_new"),
    (lambda c: c.advance(0), ValueError, "n must be positive"),
    (lambda c: c.truncate(4), ValueError, "length"),
    (lambda c: c.truncate(-1), ValueError, "length"),
])
def test_caches_reject_bad_calls(make, bad, error, match):
    cache = filled(make())
    with pytest.raises(error, match=match):
        bad(cache)


def test_preallocated_cache_rejects_overflow_and_bad_construction():
    cache = filled(models.KVCache(models.TINY, batch=2, capacity=4))
    with pytest.raises(ValueError, match="cache full"):
        cache.append(0, KV3, KV3)
    with pytest.raises(ValueError, match="capacity"):
        cache.advance(2)
    with pytest.raises(TypeError, match="DecoderConfig"):
        models.KVCache("tiny", 1, 4)
    with pytest.raises(ValueError, match="capacity"):
        models.KVCache(models.TINY, 1, 0)
    with pytest.raises(TypeError, match="DecoderConfig"):
        models.GrowingKVCache("tiny", 1)


def test_static_cache_rejects_unstaged_steps_and_overflow():
    cache = filled(models.StaticKVCache(models.TINY, batch=2, capacity=4))
    one = KV3[:, :, :1]
    with pytest.raises(RuntimeError, match="stage_step"):
        cache.append(0, one, one)
    cache.stage_step()
    for layer in range(models.TINY.num_layers):
        cache.append(layer, one, one)
    cache.advance(1)
    with pytest.raises(RuntimeError, match="stage_step"):  # staged for the previous length
        cache.append(0, one, one)
    with pytest.raises(ValueError, match="cache full"):
        cache.stage_step()


def test_growing_cache_advances_only_after_every_layer():
    growing = models.GrowingKVCache(models.TINY, batch=2)
    growing.append(0, KV3, KV3)
    with pytest.raises(ValueError, match="every layer"):
        growing.advance(3)


def test_state_dict_loading_rejects_what_does_not_fit():
    model = models.Decoder(UNTIED)
    good = models.to_hf_state_dict(models.Decoder(UNTIED, seed=1))
    with pytest.raises(ValueError, match="no counterpart"):
        models.load_hf_state_dict(model, {**good, "model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        models.load_hf_state_dict(model, {k: v for k, v in good.items() if "down_proj" not in k})
    bad_shape = {**good, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="shape"):
        models.load_hf_state_dict(model, bad_shape)
    with pytest.raises(TypeError, match="Decoder"):
        models.load_hf_state_dict(torch.nn.Linear(2, 2), good)
    with pytest.raises(TypeError, match="mapping"):
        models.load_hf_state_dict(model, list(good.items()))
    with pytest.raises(ValueError, match="not a key"):
        models.our_key_to_hf("blocks.0.attn.bias")
    with pytest.raises(ValueError, match="lacks"):
        models.config_from_hf({"vocab_size": 10})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="plain RoPE"):
        models.config_from_hf({**models.hf_config_kwargs(models.TINY), "rope_scaling": yarn})
    with pytest.raises(ValueError, match="dense layout"):
        models.config_from_hf({**models.hf_config_kwargs(models.TINY), "attention_bias": True})
    with pytest.raises(TypeError, match="DecoderConfig"):
        models.hf_config_kwargs({})


def test_generate_rejects_bad_input():
    model = models.Decoder(models.TINY)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="cache"):
        models.generate_greedy(model, prompt, 2, cache="paged")
    with pytest.raises(TypeError, match="Decoder"):
        models.generate_greedy(torch.nn.Linear(2, 2), prompt, 2)
    with pytest.raises(ValueError, match="new_tokens"):
        models.generate_greedy(model, prompt, 0)
    with pytest.raises(TypeError, match="prompt"):
        models.generate_greedy(model, prompt.float(), 2)


def test_graphed_decoder_rejects_bad_input():
    model = models.Decoder(models.TINY)
    with pytest.raises(TypeError, match="Decoder"):
        models.GraphedDecoder(torch.nn.Linear(2, 2), 1, 8)
    with pytest.raises(ValueError, match="capacity"):
        models.GraphedDecoder(model, 1, 0)
    with pytest.raises(TypeError, match="use_graph"):
        models.GraphedDecoder(model, 1, 8, use_graph="yes")
    if not backend.on_gpu():
        with pytest.raises(ValueError, match="CUDA device"):
            models.GraphedDecoder(model, 1, 8, use_graph=True)
    runner = models.GraphedDecoder(model, 2, 8)
    runner.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, 1\]"):
        runner.step(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens"):
        runner.step(torch.zeros(2, 1))


@pytest.mark.gpu
def test_graph_replays_follow_the_host_length_on_gpu():
    """Captured once, replayed at new positions, re-timed after a truncate: always the eager answer."""
    model = models.Decoder(UNTIED, seed=23, init_std=0.1, device="cuda", dtype=torch.bfloat16)
    ids = token_ids(4, 40, UNTIED.vocab_size, seed=24, device="cuda")
    runner = models.GraphedDecoder(model, batch=4, capacity=40)
    assert runner.use_graph
    runner.prefill(ids[:, :30])
    with torch.no_grad():
        want = model(ids)[:, 30:40].float()  # the logits at positions 30..39
    got = [runner.step(ids[:, t:t + 1]).float() for t in range(30, 40)]  # .float() copies the buffer
    assert runner._graph is not None and runner.cache.length == 40
    check.assert_close(torch.stack(got, dim=1), want, tol=3e-2, name="graph replays vs a full forward")
    runner.cache.truncate(35)
    assert torch.equal(runner.step(ids[:, 35:36]).float(), got[5])


# --- stacked projections (Decoder.fuse_projections) ------------------------------------------

def _fused_model(seed: int = 7) -> models.Decoder:
    return models.Decoder(models.TINY, seed=seed, init_std=0.1, device=DEV, fused=True)


def test_fuse_projections_keeps_parameters_values_and_state_dict():
    model = _fused_model()
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    assert model.projections_fused
    assert all(p is params[name] for name, p in model.named_parameters())  # an optimizer's references hold
    assert model.state_dict().keys() == state.keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    # The separate weights are views of the stacked ones, in order: no second copy exists.
    assert attn.wq.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.wv.weight.data_ptr() + attn.wv.weight.nbytes == attn.qkv_weight.data_ptr() + attn.qkv_weight.nbytes
    assert mlp.up.weight.data_ptr() == mlp.gate_up_weight[mlp.gate.weight.shape[0]:].data_ptr()
    model.unfuse_projections()
    assert not model.projections_fused and attn.qkv_weight is None
    assert attn.wq.weight.untyped_storage().data_ptr() != attn.wk.weight.untyped_storage().data_ptr()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


def test_stacked_projections_serve_inference_and_training_keeps_the_separate_ones():
    """Inference runs the stacked matmuls (same logits); with gradients on, every separate weight
    gets its gradient, and an optimizer step on them moves the stacked matrix with them."""
    model = _fused_model()
    ids = token_ids(2, 9, models.TINY.vocab_size, seed=3, device=DEV)
    with torch.no_grad():
        want = model(ids)
    model.fuse_projections()
    mlp = model.blocks[1].mlp
    assert models.decoder.stacked_weight(mlp.gate_up_weight, mlp.gate, mlp.up) is None  # gradients are on
    with torch.no_grad():
        assert models.decoder.stacked_weight(mlp.gate_up_weight, mlp.gate, mlp.up) is mlp.gate_up_weight
        check.assert_close(model(ids), want, dtype=torch.float32, name="stacked MLP projections vs separate")
    model(ids).float().square().mean().backward()
    attn = model.blocks[0].attn
    for linear in (attn.wq, attn.wk, attn.wv, mlp.gate, mlp.up):
        assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.testing.assert_close(attn.qkv_weight, torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]).detach(),
                               rtol=0, atol=0)


def test_stacked_weight_falls_back_when_a_layer_changed():
    """A layer wrapped since (LoRA) or weights moved since (.to) must not be bypassed by a stale stack."""
    from labkit import lora

    model = _fused_model()
    model.fuse_projections()
    attn = model.blocks[0].attn
    with torch.no_grad():
        assert models.decoder.stacked_weight(attn.qkv_weight, attn.wq, attn.wk, attn.wv) is attn.qkv_weight
        lora.add_lora(model, rank=2, alpha=4.0, targets=("wk",))
        assert models.decoder.stacked_weight(attn.qkv_weight, attn.wq, attn.wk, attn.wv) is None
        moved = _fused_model()
        moved.fuse_projections()
        moved.to(torch.float64)
        mlp = moved.blocks[0].mlp
        assert models.decoder.stacked_weight(mlp.gate_up_weight, mlp.gate, mlp.up) is None
        moved(token_ids(1, 4, models.TINY.vocab_size, seed=1, device=DEV))  # the separate matmuls still run
