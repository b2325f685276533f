"""labkit.mla: absorbed MLA decode against float64 and the naive definition; the module, its
cache and the memory arithmetic; clear errors."""

from __future__ import annotations

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import backend, benchmarks, check, kvcache, mla, models
from labkit.mla import kernels, variants

DEV = backend.device()  # the kernels run on the GPU there, in the interpreter on CPU tensors here


def problem(batch, heads, capacity, latent, rope, nope=12, v_dim=10, dtype=torch.float32, seed=0):
    """Queries, a latent cache and up-projections scaled so keys and values have unit scale."""
    return {
        "q_nope": check.randn(batch, heads, nope, dtype=dtype, device=DEV, seed=seed),
        "q_rope": check.randn(batch, heads, rope, dtype=dtype, device=DEV, seed=seed + 1),
        "cache": check.randn(batch, capacity, latent + rope, dtype=dtype, device=DEV, seed=seed + 2),
        "w_uk": check.randn(heads, nope, latent, dtype=dtype, device=DEV, seed=seed + 3, scale=latent**-0.5),
        "w_uv": check.randn(heads, v_dim, latent, dtype=dtype, device=DEV, seed=seed + 4, scale=latent**-0.5),
    }


# (batch, heads, capacity, latent, rope, lengths, num_splits): heads that are not a multiple
# of the head block, latent and rope widths that are not powers of two, partial last tiles,
# splits wholly past a short sequence's end, and one split (no combine).
CASES = [
    (3, 20, 53, 24, 8, [53, 1, 30], 3),
    (2, 5, 40, 32, 6, [40, 17], None),
    (1, 33, 70, 16, 16, [70], 1),
]


# Every GPU tile, at one shape: each compiles and autotunes once, so the sweep over shapes
# and dtypes below runs one tile and the autotuned path is checked at the benchmark's shapes.
TILES = backend.pick(cpu=(kernels.CPU_TILE,), gpu=kernels.GPU_TILES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}L{c[2]}R{c[3]}E{c[4]}S{c[6]}")
def test_absorbed_kernel_matches_float64_reference(case, dtype):
    batch, heads, capacity, latent, rope, lens, splits = case
    x = problem(batch, heads, capacity, latent, rope, dtype=dtype, seed=heads)
    q_latent = mla.absorb_query(x["q_nope"].float(), x["w_uk"].float()).to(dtype)
    lengths = torch.tensor(lens, dtype=torch.int32, device=DEV)
    splits = splits or kernels.default_config(batch, heads, capacity).num_splits
    out = kernels.mla_decode_absorbed(q_latent, x["q_rope"], x["cache"], lengths, 0.3,
                                      kernels.MLADecodeConfig(splits, TILES[-1]))
    assert out.dtype == dtype and out.shape == (batch, heads, latent)
    want = mla.mla_decode_absorbed_reference(q_latent, x["q_rope"], x["cache"], lengths, 0.3)
    check.assert_close(out, want, dtype=dtype)


@pytest.mark.parametrize("tile", TILES, ids=str)
def test_every_tile_is_correct(tile):
    x = problem(2, 70, 150, 64, 16, dtype=torch.bfloat16, seed=7)
    q_latent = mla.absorb_query(x["q_nope"].float(), x["w_uk"].float()).bfloat16()
    lengths = torch.tensor([150, 61], dtype=torch.int32, device=DEV)
    out = kernels.mla_decode_absorbed(q_latent, x["q_rope"], x["cache"], lengths, 0.3, kernels.MLADecodeConfig(3, tile))
    want = mla.mla_decode_absorbed_reference(q_latent, x["q_rope"], x["cache"], lengths, 0.3)
    check.assert_close(out, want, dtype=torch.bfloat16)


def test_public_entry_point_autotunes_and_matches():
    x = problem(3, 20, 53, 24, 8, seed=9)
    q_latent = mla.absorb_query(x["q_nope"], x["w_uk"])
    lengths = torch.tensor([53, 1, 30], device=DEV)
    out = mla.mla_decode(q_latent, x["q_rope"], x["cache"], lengths, scale=0.3)
    check.assert_close(out, mla.mla_decode_absorbed_reference(q_latent, x["q_rope"], x["cache"], lengths, 0.3),
                       dtype=torch.float32)


def test_absorption_is_exact():
    """Absorbing W_UK into the query and applying W_UV after attention changes nothing."""
    x = problem(2, 6, 37, 24, 8, nope=16, v_dim=12, seed=3)
    lengths = torch.tensor([37, 11], device=DEV)
    naive = mla.mla_decode_naive_reference(x["q_nope"], x["q_rope"], x["cache"], x["w_uk"], x["w_uv"], lengths, 0.25)
    absorbed = mla.unabsorb_output(
        mla.mla_decode_absorbed_reference(mla.absorb_query(x["q_nope"].double(), x["w_uk"].double()),
                                          x["q_rope"], x["cache"], lengths, 0.25), x["w_uv"].double())
    assert check.rel_error(absorbed, naive) < 1e-12


def test_kernel_equals_naive_decode_through_the_kvcache_kernel():
    """The two decode paths the chapter times give the same heads' outputs: the absorbed
    kernel, and labkit.kvcache's kernel over the decompressed cache (values zero-padded to
    the keys' width, as the benchmark's naive path does)."""
    x = problem(2, 7, 45, 24, 8, nope=12, v_dim=10, seed=5)
    lengths = torch.tensor([45, 29], device=DEV)
    k, v = mla.decompress(x["cache"], x["w_uk"], x["w_uv"])
    v_padded = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
    naive = kvcache.decode_attention(torch.cat([x["q_nope"], x["q_rope"]], -1), k, v_padded, lengths, scale=0.2,
                                     num_splits=2)[..., :10]
    o_latent = mla.mla_decode(mla.absorb_query(x["q_nope"], x["w_uk"]), x["q_rope"], x["cache"], lengths,
                              scale=0.2, num_splits=3)
    check.assert_close(mla.unabsorb_output(o_latent, x["w_uv"]), naive, dtype=torch.float32)
    want = mla.mla_decode_naive_reference(x["q_nope"], x["q_rope"], x["cache"], x["w_uk"], x["w_uv"], lengths, 0.2)
    check.assert_close(naive, want, dtype=torch.float32)


def test_reads_a_layer_of_a_latent_cache_and_never_past_lengths():
    cfg = mla.MLAConfig(kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    cache = mla.LatentCache(3, cfg, batch=2, capacity=50, device=DEV)
    cache.rows.fill_(float("nan"))  # anything read past a length poisons the output
    rows = cache.append(1, check.randn(2, 31, 24, device=DEV, seed=1), check.randn(2, 31, 8, device=DEV, seed=2))
    assert rows.shape == (2, 31, 32) and rows.stride(0) == 50 * 32  # a view of the preallocated rows
    q_latent, q_rope = check.randn(2, 4, 24, device=DEV, seed=3), check.randn(2, 4, 8, device=DEV, seed=4)
    lengths = torch.tensor([31, 12], device=DEV)
    out = mla.mla_decode(q_latent, q_rope, cache.rows[1], lengths, scale=0.3, num_splits=2)
    assert not out.isnan().any()
    check.assert_close(out, mla.mla_decode_absorbed_reference(q_latent, q_rope, rows, lengths, 0.3),
                       dtype=torch.float32)


def test_default_config_splits_only_when_the_batch_leaves_the_gpu_idle():
    few = kernels.default_config(batch=1, num_heads=16, max_len=4096)
    many = kernels.default_config(batch=4096, num_heads=128, max_len=4096)
    short = kernels.default_config(batch=1, num_heads=16, max_len=kernels.PLAN_BLOCK_N)
    assert few.num_splits > 1 and many.num_splits == 1 and short.num_splits == 1


TINY_MLA = mla.MLAConfig(kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)


def tiny_model(seed=0):
    return mla.mla_decoder(models.TINY, TINY_MLA, device=DEV, seed=seed, init_std=0.2)


@pytest.mark.parametrize("decode_kernel", [False, True])
def test_incremental_decoding_equals_the_full_forward(decode_kernel):
    model = tiny_model()
    ids = torch.randint(0, models.TINY.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        full = model(ids)
        cache = mla.LatentCache(models.TINY.num_layers, TINY_MLA, batch=2, capacity=16, device=DEV)
        steps = [model(ids[:, :9], cache)]
        steps += [model(ids[:, t:t + 1], cache, decode_kernel=decode_kernel) for t in range(9, 13)]
    assert cache.length == 13
    check.assert_close(torch.cat(steps, dim=1), full, dtype=torch.float32)


def test_the_cache_holds_only_latents_and_rotary_keys():
    cache = mla.LatentCache(models.TINY.num_layers, TINY_MLA, batch=3, capacity=10, device=DEV)
    assert cache.nbytes == models.TINY.num_layers * 3 * 10 * (20 + 6) * 4


def test_mla_model_trains():
    model = tiny_model(seed=1)
    ids = torch.randint(0, models.TINY.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1)).to(DEV)
    before = models.lm_loss(model, ids).item()
    models.train_lm(model, lambda step: ids, steps=25, lr=3e-3, progress=False)
    assert models.lm_loss(model, ids).item() < 0.7 * before


def test_bytes_per_token_of_the_published_shapes():
    v3 = mla.MLA_SHAPES["DeepSeek-V3"]
    # 61 layers x (512 latent + 64 rotary key) x 2 bytes; decompressed: 128 heads x (192 + 128).
    assert v3.kv_bytes_per_token() == 61 * (512 + 64) * 2
    assert v3.decompressed_bytes_per_token() == 61 * 128 * (128 + 64 + 128) * 2
    assert mla.mla_kv_bytes_per_token(2, 4, 2, bytes_per_element=1) == 12
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla.mla_kv_bytes_per_token(2, 0, 2)


def test_decode_costs_per_cached_token():
    costs = mla.decode_costs(heads=128, head_dim=128, kv_heads=8, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128)
    assert costs["MHA"].cached_elements == 2 * 128 * 128 and costs["GQA-8"].cached_elements == 2 * 8 * 128
    assert costs["MQA"].cached_elements == 2 * 128 and costs["MQA"].flops == costs["MHA"].flops == 4 * 128 * 128
    assert costs["MLA absorbed"].cached_elements == 576 and costs["MLA naive"].cached_elements == 128 * 320
    # absorbed: 576-wide scores and a 512-wide weighted sum for each of 128 heads
    assert costs["MLA absorbed"].flops == 2 * 128 * (576 + 512)
    assert costs["MHA"].intensity() == 1.0  # one query head per KV head: a FLOP per byte in bf16
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        mla.decode_costs(heads=12, head_dim=8, kv_heads=5, kv_lora_rank=8, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8)


def test_variants_cache_what_they_should():
    s = variants.CPU_SETUP
    table = {name: variants.build(s, kv_heads, seed, DEV)[1] for name, (kv_heads, seed) in variants.variants(s).items()}
    assert table["MHA"] == 2 * s.num_heads * s.head_dim and table["MQA"] == 2 * s.head_dim
    assert table["MLA"] == 4 * s.head_dim + s.head_dim // 2


def test_benchmarks_are_registered_for_the_chapter():
    for name in ("mla.decode", "mla.variants"):
        assert benchmarks.get(name).chapter == "mqa-gqa-mla"


def test_mla_decode_rejects_bad_input():
    x = problem(2, 4, 20, 16, 8)
    q_latent = mla.absorb_query(x["q_nope"], x["w_uk"])
    q_rope, cache = x["q_rope"], x["cache"]
    lengths = torch.tensor([20, 5], device=DEV)
    with pytest.raises(TypeError, match="q_latent must be a torch.Tensor"):
        mla.mla_decode(q_latent.tolist(), q_rope, cache, lengths, scale=0.1)
    with pytest.raises(TypeError, match="cache must have dtype"):
        mla.mla_decode(q_latent, q_rope, cache.double(), lengths, scale=0.1)
    with pytest.raises(TypeError, match="lengths must have dtype"):
        mla.mla_decode(q_latent, q_rope, cache, lengths.float(), scale=0.1)
    with pytest.raises(ValueError, match="q_rope must be"):
        mla.mla_decode(q_latent, q_rope[:, :3], cache, lengths, scale=0.1)
    with pytest.raises(ValueError, match=r"latent \+ rope = 24"):
        mla.mla_decode(q_latent, q_rope, cache[..., :20], lengths, scale=0.1)
    with pytest.raises(ValueError, match="contiguous"):
        mla.mla_decode(q_latent, q_rope, cache.transpose(1, 2).contiguous().transpose(1, 2), lengths, scale=0.1)
    with pytest.raises(ValueError, match="one entry per sequence"):
        mla.mla_decode(q_latent, q_rope, cache, lengths[:1], scale=0.1)
    with pytest.raises(ValueError, match=r"\[1, capacity=20\]"):
        mla.mla_decode(q_latent, q_rope, cache, lengths + 1, scale=0.1)
    with pytest.raises(ValueError, match="scale must be"):
        mla.mla_decode(q_latent, q_rope, cache, lengths, scale=float("nan"))
    with pytest.raises(ValueError, match="num_splits"):
        mla.mla_decode(q_latent, q_rope, cache, lengths, scale=0.1, num_splits=0)


def test_module_and_cache_reject_bad_input():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        mla.MLAConfig(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=5, v_head_dim=8)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla.MLAConfig(kv_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(TypeError, match="mla must be an MLAConfig"):
        mla.mla_decoder(models.TINY, {"kv_lora_rank": 8})
    cache = mla.LatentCache(2, TINY_MLA, batch=2, capacity=4, device=DEV)
    latent, k_pe = torch.zeros(2, 3, 20, device=DEV), torch.zeros(2, 3, 6, device=DEV)
    with pytest.raises(ValueError, match="layer must be"):
        cache.append(2, latent, k_pe)
    with pytest.raises(ValueError, match=r"expected latent \[batch=2, new, 20\]"):
        cache.append(0, latent[..., :19], k_pe)
    cache.append(0, latent, k_pe)
    cache.advance(3)
    with pytest.raises(ValueError, match="cache full"):
        cache.append(0, latent, k_pe)
