"""labkit.kvcache: split-KV decode attention against float64 and SDPA; the memory arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import backend, check, kvcache, models
from labkit.kvcache import kernels
from labkit.matmul import kernels as matmul_kernels

DEV = backend.device()  # the kernels run on the GPU there, in the interpreter on CPU tensors here


def problem(batch, q_heads, kv_heads, capacity, head_dim, dtype=torch.float32, seed=0):
    q = check.randn(batch, q_heads, head_dim, dtype=dtype, device=DEV, seed=seed)
    k = check.randn(batch, kv_heads, capacity, head_dim, dtype=dtype, device=DEV, seed=seed + 1)
    v = check.randn(batch, kv_heads, capacity, head_dim, dtype=dtype, device=DEV, seed=seed + 2)
    return q, k, v


# (batch, q_heads, kv_heads, capacity, head_dim, lengths, num_splits): odd lengths, partial
# last tiles, splits wholly past a sequence's end, group sizes 1, 3 and 8, head_dim not a
# power of two.
CASES = [
    (3, 4, 2, 101, 16, [1, 64, 101], 3),
    (2, 6, 2, 77, 24, [77, 40], None),
    (1, 8, 1, 200, 32, [130], 5),
    (2, 3, 3, 45, 16, [45, 33], 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}Hq{c[1]}Hkv{c[2]}L{c[3]}D{c[4]}S{c[6]}")
def test_matches_float64_reference(case, dtype):
    batch, hq, hkv, capacity, d, lens, splits = case
    q, k, v = problem(batch, hq, hkv, capacity, d, dtype, seed=len(lens) + d)
    lengths = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = kvcache.decode_attention(q, k, v, lengths, num_splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    check.assert_close(out, kvcache.decode_attention_reference(q, k, v, lengths), dtype=dtype)


def test_matches_sdpa_over_a_full_cache():
    q, k, v = problem(2, 8, 2, 93, 32, seed=5)
    lengths = torch.full((2,), 93, dtype=torch.int64, device=DEV)
    want = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    check.assert_close(kvcache.decode_attention(q, k, v, lengths, num_splits=2), want, dtype=torch.float32)


def test_custom_scale():
    q, k, v = problem(1, 2, 1, 50, 16, seed=6)
    lengths = torch.tensor([41], device=DEV)
    want = kvcache.decode_attention_reference(q, k, v, lengths, scale=0.37)
    check.assert_close(kvcache.decode_attention(q, k, v, lengths, scale=0.37, num_splits=2), want,
                       dtype=torch.float32)


def test_reads_views_of_a_preallocated_cache_and_never_past_lengths():
    cache = models.KVCache(models.TINY, batch=2, capacity=70, device=DEV)
    check.poison(cache.k)
    check.poison(cache.v)
    lengths = torch.tensor([61, 29], dtype=torch.int32, device=DEV)
    shape = (2, models.TINY.num_kv_heads, 61, models.TINY.head_dim)
    cache.k[1, :, :, :61] = check.randn(*shape, device=DEV, seed=7)
    cache.v[1, :, :, :61] = check.randn(*shape, device=DEV, seed=8)
    k, v = cache.k[1, :, :, :61], cache.v[1, :, :, :61]  # strided views, NaN past position 29 of row 1
    assert not k.is_contiguous()
    q = check.randn(2, models.TINY.num_heads, models.TINY.head_dim, device=DEV, seed=9)
    out = kvcache.decode_attention(q, k, v, lengths, num_splits=2)
    check.assert_close(out, kvcache.decode_attention_reference(q, k, v, lengths), dtype=torch.float32)


def test_split_combine_in_torch_is_exact():
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(16, dtype=torch.float64, generator=gen)
    k = torch.randn(97, 16, dtype=torch.float64, generator=gen) * 3  # wide scores: the max matters
    v = torch.randn(97, 16, dtype=torch.float64, generator=gen)
    want = torch.softmax(k @ q * 0.25, 0) @ v
    # (splits, tile): one split, several tiles each, a partial last tile, splits left without a tile
    for num_splits, tile in ((1, 16), (3, 16), (4, 32), (10, 16), (97, 1)):
        o_parts, lses = kvcache.split_partials(q, k, v, num_splits, tile, 0.25)
        assert o_parts.shape[0] == num_splits
        assert torch.isinf(lses).sum() == max(0, num_splits - -(-97 // tile))
        check.assert_close(kvcache.combine_partials(o_parts, lses), want, dtype=torch.float64)


@pytest.mark.parametrize("config", [
    kernels.DecodeConfig(num_splits=1, block_n=16),
    kernels.DecodeConfig(num_splits=2, block_n=32),
    kernels.DecodeConfig(num_splits=9, block_n=16),   # more splits than the short sequence's tiles
    kernels.DecodeConfig(num_splits=2, block_n=32, merge_here=True),
    kernels.DecodeConfig(num_splits=9, block_n=16, merge_here=True),
    kernels.DecodeConfig(num_splits=1, block_n=16, merge_here=True),  # one split: nothing to merge
], ids=lambda c: f"S{c.num_splits}N{c.block_n}{'M' if c.merge_here else ''}")
def test_explicit_launch_configs_match_the_reference(config):
    q, k, v = problem(2, 8, 2, 83, 32, seed=11)
    lengths = torch.tensor([83, 20], dtype=torch.int32, device=DEV)
    out = kernels.split_kv_decode(q, k, v, lengths, 32**-0.5, config)
    check.assert_close(out, kvcache.decode_attention_reference(q, k, v, lengths), dtype=torch.float32)


def test_merging_in_the_split_kernel_leaves_its_tickets_at_zero():
    """The last split of each (sequence, KV head) merges and resets its ticket: a second
    launch merges again and gives the same bits as the first, and as the combine kernel
    within rounding (the same formula, in another kernel)."""
    q, k, v = problem(3, 8, 2, 83, 32, seed=12)
    lengths = torch.tensor([83, 20, 1], dtype=torch.int32, device=DEV)
    config = kernels.DecodeConfig(num_splits=5, block_n=16, merge_here=True)
    first = kernels.split_kv_decode(q, k, v, lengths, 32**-0.5, config)
    assert int(matmul_kernels.tickets(q.device, 3 * 2).abs().sum()) == 0
    assert torch.equal(kernels.split_kv_decode(q, k, v, lengths, 32**-0.5, config), first)
    two_kernels = kernels.split_kv_decode(q, k, v, lengths, 32**-0.5, dataclasses.replace(config, merge_here=False))
    check.assert_close(first, two_kernels, dtype=torch.float32, name="merged in the split kernel vs combine kernel")


def test_default_config_fills_one_wave_whatever_the_batch():
    sms = torch.cuda.get_device_properties(0).multi_processor_count if backend.on_gpu() else 4
    wave = kernels.PROGRAMS_PER_SM * sms
    long = 1 << 20
    for batch in (1, 2, 3):
        pairs = batch * 1
        cfg = kernels.default_config(batch, 1, long)
        want = wave // pairs if wave // pairs > kernels.PROGRAMS_PER_SM else 1
        assert cfg.num_splits == want  # as many splits as fit one wave
    assert kernels.default_config(sms, 1, long).num_splits == 1  # a program per SM already
    assert kernels.default_config(wave, 1, long).num_splits == 1  # the batch alone fills it
    short = kernels.default_config(1, 1, 3 * kernels.BLOCK_N)
    assert short.num_splits == 1  # a split gets at least MIN_TILES_PER_SPLIT tiles, when it can


def test_kv_bytes_per_token_of_published_models():
    llama3_8b = kvcache.MODEL_SHAPES["Llama-3-8B"]
    assert llama3_8b.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kvcache.MODEL_SHAPES["Llama-2-7B"].kv_bytes_per_token() == 4 * llama3_8b.kv_bytes_per_token()
    book = models.BOOK_GPU
    assert kvcache.kv_bytes_per_token(book.num_layers, book.num_kv_heads, book.head_dim, 2) == \
        book.kv_bytes_per_token(2)
    assert kvcache.kv_cache_bytes(llama3_8b, batch=3, context=1000, bytes_per_element=1) == 3000 * 64 * 1024


def test_max_cached_tokens_leaves_room_for_weights():
    shape = kvcache.MODEL_SHAPES["Llama-3-8B"]
    tokens = kvcache.max_cached_tokens(shape, 80 * 10**9)
    free = 80e9 - 16e9
    assert tokens == int(free // (128 * 1024))
    assert kvcache.max_cached_tokens(kvcache.MODEL_SHAPES["Llama-3-70B"], 80 * 10**9) == 0


# --- bad input ------------------------------------------------------------------------

def test_decode_attention_rejects_bad_input():
    q, k, v = problem(2, 4, 2, 20, 16)
    lengths = torch.tensor([20, 3], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        kvcache.decode_attention(q.tolist(), k, v, lengths)
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        kvcache.decode_attention(q, k.double(), v, lengths)
    with pytest.raises(TypeError, match="q must have dtype"):
        kvcache.decode_attention(q.double(), k.double(), v.double(), lengths)
    with pytest.raises(TypeError, match="lengths must have dtype"):
        kvcache.decode_attention(q, k, v, lengths.float())
    with pytest.raises(ValueError, match="q must have 3"):
        kvcache.decode_attention(q[:, :, None], k, v, lengths)
    with pytest.raises(ValueError, match="must match"):
        kvcache.decode_attention(q, k, v[:, :, :10], lengths)
    with pytest.raises(ValueError, match="head_dim"):
        kvcache.decode_attention(q[..., :8], k, v, lengths)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        kvcache.decode_attention(q[:, :3], k, v, lengths)
    with pytest.raises(ValueError, match="contiguous"):
        kt = k.transpose(2, 3).contiguous().transpose(2, 3)
        kvcache.decode_attention(q, kt, v, lengths)
    with pytest.raises(ValueError, match="one entry per sequence"):
        kvcache.decode_attention(q, k, v, lengths[:1])
    with pytest.raises(ValueError, match=r"\[1, capacity=20\]"):
        kvcache.decode_attention(q, k, v, torch.tensor([0, 3], device=DEV))
    with pytest.raises(ValueError, match=r"\[1, capacity=20\]"):
        kvcache.decode_attention(q, k, v, torch.tensor([21, 3], device=DEV))
    with pytest.raises(ValueError, match="share one device"):
        kvcache.decode_attention(q, k, v, torch.tensor([20, 3], device="meta"))
    with pytest.raises(ValueError, match="q must be on"):
        kvcache.decode_attention(q.to("meta"), k.to("meta"), v.to("meta"), lengths.to("meta"))
    for bad_scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            kvcache.decode_attention(q, k, v, lengths, scale=bad_scale)
    with pytest.raises(ValueError, match="num_splits"):
        kvcache.decode_attention(q, k, v, lengths, num_splits=0)


def test_memory_functions_reject_bad_input():
    shape = kvcache.MODEL_SHAPES["Qwen3-8B"]
    with pytest.raises(ValueError, match="layers"):
        kvcache.kv_bytes_per_token(0, 8, 128)
    with pytest.raises(TypeError, match="head_dim"):
        kvcache.kv_bytes_per_token(2, 8, 128.0)
    with pytest.raises(TypeError, match="ModelShape"):
        kvcache.kv_cache_bytes("Qwen3-8B", 1, 10)
    with pytest.raises(ValueError, match="context"):
        kvcache.kv_cache_bytes(shape, 1, -5)
    with pytest.raises(TypeError, match="ModelShape"):
        kvcache.max_cached_tokens(None, 10)
    with pytest.raises(ValueError, match="weight_bytes_per_param"):
        kvcache.max_cached_tokens(shape, 10**9, weight_bytes_per_param=0)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, num_warps, num_stages", [(32, 4, 2)] + [tile for _, tile in kernels.GPU_TILES])
def test_compiled_configs_are_correct_on_gpu(block_n, num_warps, num_stages):
    """Each tile default_config may pick, and a small one, at the benchmark's shapes (GQA 32/8 x 128, bf16)."""
    q, k, v = problem(3, 32, 8, 1000, 128, torch.bfloat16, seed=12)
    lengths = torch.tensor([1000, 1, 517], dtype=torch.int32, device=DEV)
    want = kvcache.decode_attention_reference(q, k, v, lengths)
    for splits in (1, 5, 40):
        config = kernels.DecodeConfig(splits, block_n, num_warps, num_stages)
        check.assert_close(kernels.split_kv_decode(q, k, v, lengths, 128**-0.5, config), want,
                           dtype=torch.bfloat16, name=str(config))


@pytest.mark.parametrize("name", ["kvcache.decode_attention", "kvcache.decode_step", "kvcache.append"])
def test_benchmark_produces_a_valid_record(name):
    from labkit import benchmarks, results

    rec = benchmarks.run(name, record=False)
    assert results.validate(rec.to_dict()) == []
    assert rec.chapter == "kv-cache" and rec.goals and all(r for r in rec.rows)
    if name == "kvcache.decode_attention":  # each row beside a bare read of its own bytes
        for r in rec.rows:
            assert r["same_size_read_tbps"] > 0
            assert r["ours/same-size read"] == pytest.approx(r["ours_tbps"] / r["same_size_read_tbps"])


def test_decode_step_profile_accounts_for_every_kernel():
    from labkit import benchmarks, results

    rec = benchmarks.run("kvcache.decode_step_profile", record=False)
    assert results.validate(rec.to_dict()) == []
    assert rec.config["kernel_us_per_step"] == pytest.approx(sum(r["us_per_step"] for r in rec.rows))
    assert [r["us_per_step"] for r in rec.rows] == sorted((r["us_per_step"] for r in rec.rows), reverse=True)
    assert "matmul" in {r["kind"] for r in rec.rows}
    assert rec.config["floor_ms"] > 0 and rec.config["weight_bytes"] > rec.config["cache_bytes"] > 0


@pytest.mark.parametrize(("name", "kind"), [
    ("_decode_split_kernel", "decode attention"), ("_combine_splits_kernel", "decode attention"),
    ("nvjet_tst_128x8_64x12_2x1_v_bz_splitK_TNT", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
    ("void at::native::index_copy_kernel_impl<...>", "copy into the cache"),
    ("void at::native::reduce_kernel<512, 1, ...>", "reduction (norms, softmax)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise (rotary, SwiGLU, residual, casts)"),
])
def test_kernel_kind_from_its_name(name, kind):
    from labkit.kvcache.bench import kernel_kind

    assert kernel_kind(name) == kind
