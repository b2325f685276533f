"""The paged attention kernels (labkit.serve.attention over labkit.kvcache.kernels): against a
float64 reference, SDPA and the contiguous split-KV kernel on the same cache contents; their
argument checks; write_kv; and the chapter's benchmarks."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit import check
from labkit.kvcache import kernels
from labkit.serve import attention
from labkit.serve.paged_cache import paged_copy

DEV = labkit.device()


def random_pool(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32, *, seed):
    k = check.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEV, seed=seed)
    v = check.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEV, seed=seed + 1)
    return k, v


def random_tables(lengths, block_size, num_blocks, width, *, seed, padding=-1):
    """Each sequence's blocks drawn without replacement from a shuffled pool; unused entries hold ``padding``."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((len(lengths), width), padding, dtype=torch.int32)
    for b, length in enumerate(lengths):
        used = -(-length // block_size)
        tables[b, :used] = torch.tensor([order.pop() for _ in range(used)], dtype=torch.int32)
    return tables.to(DEV)


def poison_unused(k_pool, v_pool, tables, lengths):
    """NaN in every block and slot that no sequence uses: a kernel that reads one returns NaN."""
    block_size = k_pool.shape[1]
    used = torch.zeros(k_pool.shape[:2], dtype=torch.bool, device=k_pool.device)
    for b, length in enumerate(lengths):
        for n in range(length):
            used[tables[b, n // block_size], n % block_size] = True
    k_pool[~used] = math.nan
    v_pool[~used] = math.nan


def reference64(q, k_pool, v_pool, tables, cu_seqlens, lengths):
    """The plain-torch definition in float64, with unused slots zeroed (SDPA's float64 path is exact enough)."""
    k, v = torch.nan_to_num(k_pool.double()), torch.nan_to_num(v_pool.double())
    return attention.paged_prefill_attention_reference(q.double(), k, v, tables.long(), cu_seqlens, lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [5, 8, 32])   # odd; a tile spans blocks; a block spans tiles
def test_paged_decode_matches_the_definition(dtype, block_size):
    """Odd lengths (1 included), GQA 6/2, head size 24, shuffled blocks, NaN in every unused slot."""
    lengths = [37, 1, 80]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    k_pool, v_pool = random_pool(num_blocks, block_size, 2, 24, dtype, seed=1)
    tables = random_tables(lengths, block_size, num_blocks, -(-80 // block_size) + 1, seed=2)
    poison_unused(k_pool, v_pool, tables, lengths)
    q = check.randn(3, 6, 24, dtype=dtype, device=DEV, seed=3)
    lens = torch.tensor(lengths, device=DEV)
    out = attention.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    want = reference64(q, k_pool, v_pool, tables.clamp(min=0), torch.arange(4, device=DEV), lens)
    check.assert_close(out, want, dtype=dtype, name=f"paged decode, block size {block_size}")


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_paged_decode_equals_the_contiguous_kernel_on_the_same_contents(splits):
    """The same cache laid out both ways, the same launch: the same numbers, to rounding."""
    k = check.randn(2, 2, 96, 16, device=DEV, seed=4)
    v = check.randn(2, 2, 96, 16, device=DEV, seed=5)
    q = check.randn(2, 4, 16, device=DEV, seed=6)
    lengths = torch.tensor([96, 45], dtype=torch.int32, device=DEV)
    k_pool, tables = paged_copy(k, 8, seed=7)
    v_pool, _ = paged_copy(v, 8, seed=7)
    config = kernels.DecodeConfig(num_splits=splits)
    paged = kernels.paged_split_kv_decode(q, k_pool, v_pool, tables, lengths, 0.25, config)
    contiguous = kernels.split_kv_decode(q, k, v, lengths, 0.25, config)
    check.assert_close(paged, contiguous, dtype=torch.float32, name=f"paged vs contiguous, {splits} splits")
    merged_here = dataclasses.replace(config, merge_here=True)
    check.assert_close(kernels.paged_split_kv_decode(q, k_pool, v_pool, tables, lengths, 0.25, merged_here), contiguous,
                       dtype=torch.float32, name=f"paged, merged in the split kernel, vs contiguous, {splits} splits")
    sdpa = F.scaled_dot_product_attention(q[:1, :, None], k[:1], v[:1], enable_gqa=True, scale=0.25)[:, :, 0]
    check.assert_close(paged[:1], sdpa, dtype=torch.float32, name="paged vs SDPA on the full sequence")


def test_paged_copy_preserves_every_position():
    k = check.randn(3, 2, 24, 4, device=DEV, seed=8)
    pool, tables = paged_copy(k, 8, seed=9)
    assert sorted(tables.flatten().tolist()) == list(range(9))
    for b in range(3):
        torch.testing.assert_close(attention.gather_kv(pool, tables[b].long(), 24)[0], k[b], rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of block_size"):
        paged_copy(k, 5, seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_prefill_matches_the_definition(dtype):
    """Packed queries: a fresh prompt, a chunk after a cached prefix, a decode-like single query,
    a sequence with no queries this step; GQA 6/2; block size 5; NaN in unused slots."""
    lengths = [23, 40, 9, 12]
    new = [23, 17, 1, 0]
    block_size = 5
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_pool, v_pool = random_pool(num_blocks, block_size, 2, 24, dtype, seed=10)
    tables = random_tables(lengths, block_size, num_blocks, 9, seed=11, padding=10**6)
    poison_unused(k_pool, v_pool, tables, lengths)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = check.randn(sum(new), 6, 24, dtype=dtype, device=DEV, seed=12)
    lens = torch.tensor(lengths, device=DEV)
    out = attention.paged_prefill_attention(q, k_pool, v_pool, tables, cu, lens)
    safe_tables = torch.where(tables < num_blocks, tables, 0)
    want = reference64(q, k_pool, v_pool, safe_tables, cu, lens)
    check.assert_close(out, want, dtype=dtype, name="paged prefill")


def test_paged_prefill_of_a_whole_prompt_is_causal_sdpa():
    """A fresh prefill (no cached prefix) is SDPA with is_causal on the gathered prompt."""
    k = check.randn(1, 2, 40, 16, device=DEV, seed=13)
    v = check.randn(1, 2, 40, 16, device=DEV, seed=14)
    q = check.randn(1, 8, 37, 16, device=DEV, seed=15)
    k_pool, tables = paged_copy(k, 8, seed=16)
    v_pool, _ = paged_copy(v, 8, seed=16)
    packed = q[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 37], device=DEV)
    out = attention.paged_prefill_attention(packed, k_pool, v_pool, tables, cu, torch.tensor([37], device=DEV))
    want = F.scaled_dot_product_attention(q, k[:, :, :37], v[:, :, :37], is_causal=True, enable_gqa=True)
    check.assert_close(out, want[0].transpose(0, 1), dtype=torch.float32, name="prefill vs causal SDPA")


def test_write_kv_then_decode_reads_what_was_written():
    k_pool, v_pool = random_pool(6, 4, 1, 8, seed=17)
    k_new = check.randn(3, 1, 8, device=DEV, seed=18)
    v_new = check.randn(3, 1, 8, device=DEV, seed=19)
    attention.write_kv(k_pool, v_pool, k_new, v_new, torch.tensor([21, 22, 9], device=DEV))
    assert torch.equal(k_pool[5, 1], k_new[0]) and torch.equal(v_pool[5, 2], v_new[1])
    assert torch.equal(k_pool[2, 1], k_new[2])


def pool_args():
    k_pool, v_pool = random_pool(4, 4, 2, 8, seed=20)
    q = check.randn(2, 4, 8, device=DEV, seed=21)
    tables = torch.tensor([[0, 1], [2, 3]], device=DEV)
    return q, k_pool, v_pool, tables, torch.tensor([5, 8], device=DEV)


@pytest.mark.parametrize(("change", "error", "match"), [
    (lambda a: a.update(q=a["q"].double()), TypeError, "q must have dtype"),
    (lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple of kv_heads"),
    (lambda a: a.update(q=a["q"][..., :6]), ValueError, "head_dim"),
    (lambda a: a.update(k_pool=a["k_pool"].half(), v_pool=a["v_pool"].half()), TypeError, "q's dtype"),
    (lambda a: a.update(v_pool=a["v_pool"][:3]), ValueError, "must match"),
    (lambda a: a.update(k_pool=a["k_pool"][0]), ValueError, "4 dimensions"),
    (lambda a: a.update(block_tables=a["block_tables"].float()), TypeError, "block_tables must have dtype"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), ValueError, "one row per sequence"),
    (lambda a: a.update(lengths=torch.tensor([0, 8], device=DEV)), ValueError, r"lengths must lie in \[1, "),
    (lambda a: a.update(lengths=torch.tensor([5, 9], device=DEV)), ValueError, "max_blocks"),
    (lambda a: a.update(block_tables=torch.tensor([[0, 4], [2, 3]], device=DEV)), ValueError, r"block ids in \[0, 4\)"),
    (lambda a: a.update(block_tables=torch.tensor([[0, -1], [2, 3]], device=DEV)), ValueError, "block ids"),
    (lambda a: a.update(scale=-1.0), ValueError, "scale must be a positive"),
])
def test_paged_decode_rejects_bad_input(change, error, match):
    q, k_pool, v_pool, tables, lengths = pool_args()
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, lengths=lengths)
    change(args)
    with pytest.raises(error, match=match):
        attention.paged_decode_attention(**args)


def test_padding_past_a_sequences_blocks_is_not_checked_or_read():
    """Table entries past ceil(length / block_size) are padding: any value passes and none is read."""
    q, k_pool, v_pool, tables, lengths = pool_args()
    lengths = torch.tensor([3, 8], device=DEV)
    padded = torch.tensor([[0, 99], [2, 3]], device=DEV)
    check.assert_close(attention.paged_decode_attention(q, k_pool, v_pool, padded, lengths),
                       attention.paged_decode_attention_reference(q, k_pool, v_pool, tables, lengths),
                       dtype=torch.float32, name="padded table")


@pytest.mark.parametrize(("cu", "lengths", "match"), [
    ([0, 2], [5, 8], "one row per sequence"),
    ([1, 2, 3], [5, 8], "start at 0"),
    ([0, 2, 1], [5, 8], "never decrease"),
    ([0, 1, 2], [5, 8], "end at N=3"),
    ([0, 3, 3], [2, 8], "sequence 0 has 3 queries but only 2 positions"),
    ([0], [5], "batch \\+ 1 >= 2"),
])
def test_paged_prefill_rejects_bad_input(cu, lengths, match):
    _, k_pool, v_pool, tables, _ = pool_args()
    q = check.randn(3, 4, 8, device=DEV, seed=22)
    with pytest.raises(ValueError, match=match):
        attention.paged_prefill_attention(q, k_pool, v_pool, tables[:len(lengths)],
                                          torch.tensor(cu, device=DEV), torch.tensor(lengths, device=DEV))


def test_write_kv_rejects_bad_input():
    k_pool, v_pool = random_pool(4, 4, 2, 8, seed=23)
    new = check.randn(3, 2, 8, device=DEV, seed=24)
    with pytest.raises(ValueError, match="kv_heads=2, head_dim=8"):
        attention.write_kv(k_pool, v_pool, new[:, :1], new[:, :1], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="one row per token"):
        attention.write_kv(k_pool, v_pool, new, new, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        attention.write_kv(k_pool, v_pool, new, new, torch.tensor([0.0, 1.0, 2.0]))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
def test_paged_decode_on_gpu_at_the_benchmark_shapes(block_size):
    """bf16, Qwen3-0.6B heads (16/8 x 128), each launch paged_config picks, ragged lengths."""
    lengths = [1000, 1, 517, 4096]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 7
    k_pool, v_pool = random_pool(num_blocks, block_size, 8, 128, torch.bfloat16, seed=25)
    tables = random_tables(lengths, block_size, num_blocks, -(-4096 // block_size), seed=26)
    poison_unused(k_pool, v_pool, tables, lengths)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q = check.randn(4, 16, 128, dtype=torch.bfloat16, device=DEV, seed=27)
    want = reference64(q, k_pool, v_pool, tables.clamp(min=0), torch.arange(5, device=DEV), lens)
    for splits in (1, 5, 40):
        for _, (block_n, warps, stages) in kernels.GPU_TILES:  # each launch paged_config can make
            config = kernels.DecodeConfig(splits, block_n, warps, stages + kernels.PAGED_EXTRA_STAGES)
            got = kernels.paged_split_kv_decode(q, k_pool, v_pool, tables, lens, 128**-0.5, config)
            check.assert_close(got, want, dtype=torch.bfloat16, name=f"block {block_size}, {config}")


@pytest.mark.gpu
def test_paged_prefill_on_gpu():
    lengths, new = [700, 129, 2048], [700, 64, 1]
    num_blocks = sum(-(-n // 16) for n in lengths) + 5
    k_pool, v_pool = random_pool(num_blocks, 16, 8, 128, torch.bfloat16, seed=28)
    tables = random_tables(lengths, 16, num_blocks, 128, seed=29)
    poison_unused(k_pool, v_pool, tables, lengths)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = check.randn(sum(new), 16, 128, dtype=torch.bfloat16, device=DEV, seed=30)
    lens = torch.tensor(lengths, device=DEV)
    out = attention.paged_prefill_attention(q, k_pool, v_pool, tables, cu, lens)
    check.assert_close(out, reference64(q, k_pool, v_pool, tables.clamp(min=0), cu, lens), dtype=torch.bfloat16,
                       name="paged prefill, bf16")


@pytest.mark.parametrize("name", ["serve.paged_decode", "serve.paged_prefill", "serve.paged_decode_stages"])
def test_benchmark_produces_a_valid_record(name):
    from labkit import benchmarks, results

    rec = benchmarks.run(name, record=False)
    assert results.validate(rec.to_dict()) == []
    assert rec.chapter == "paged-attention" and all(r for r in rec.rows)
    if name == "serve.paged_decode":
        assert len(rec.goals) == 2 and {r["block_size"] for r in rec.rows} > {rec.config["block_size"]}


def test_every_slot_is_accounted_for_at_every_step():
    from labkit.serve import fragmentation as fr

    prompts, outputs = fr.request_lengths(60, seed=1, max_len=256)
    for policy in fr.POLICIES:
        tl = fr.simulate(prompts, outputs, 1000, policy, max_len=256, block_size=16)
        totals = sum(torch.tensor(tl.parts[p]) for p in fr.PARTS)
        assert torch.all(totals == 1000), policy
        assert sum(tl.batch) and not tl.saturated[-1]  # every request ran; the queue emptied
        # One token per running sequence per step; a preempted sequence keeps its tokens (recomputed).
        assert sum(tl.batch) == int(outputs.sum()), policy


def test_what_each_allocator_wastes():
    from labkit.serve import fragmentation as fr

    prompts, outputs = fr.request_lengths(80, seed=2, max_len=512)
    runs = {p: fr.simulate(prompts, outputs, 4096, p, max_len=512, block_size=16) for p in fr.POLICIES}
    assert max(runs["max"].batch) <= 4096 // 512          # fixed slots of the model length
    assert max(runs["oracle"].parts["internal"]) == 0      # exact reservations never over-reserve
    assert max(runs["paged"].parts["stranded"]) == 0       # any free block serves any sequence
    # A paged sequence wastes less than a block: its last block's unfilled slots.
    for internal, batch in zip(runs["paged"].parts["internal"], runs["paged"].batch):
        assert internal < 16 * max(batch, 1)
    assert runs["paged"].summary()["tokens"] > runs["oracle"].summary()["tokens"] > runs["max"].summary()["tokens"]
    assert sum(runs["oracle"].parts["stranded"]) > 0       # holes between reservations strand memory


def test_request_lengths_and_simulate_reject_bad_input():
    from labkit.serve import fragmentation as fr

    prompts, outputs = fr.request_lengths(500, seed=3, max_len=300)
    assert prompts.min() >= 1 and outputs.min() >= 1 and (prompts + outputs).max() <= 300
    with pytest.raises(ValueError, match="policy must be one of"):
        fr.simulate(prompts, outputs, 1000, "buddy", max_len=300)
    with pytest.raises(ValueError, match="needs 300 slots"):
        fr.simulate(prompts, outputs, 200, "max", max_len=300)
    with pytest.raises(ValueError, match="at most max_len=100"):
        fr.simulate(prompts, outputs, 1000, "paged", max_len=100)


def test_paged_config_keeps_the_contiguous_launch_but_its_depth():
    """The paged launch differs from default_config's only by its extra pipeline stages."""
    for batch, kv_heads, capacity in ((1, 8, 16384), (16, 8, 4096), (64, 8, 1024), (3, 2, 203)):
        base = kernels.default_config(batch, kv_heads, capacity)
        paged = kernels.paged_config(batch, kv_heads, capacity, head_dim=128, element_size=2)
        assert (paged.num_splits, paged.block_n, paged.num_warps) == (base.num_splits, base.block_n, base.num_warps)
        assert paged.num_stages == base.num_stages + kernels.PAGED_EXTRA_STAGES > base.num_stages


def test_fit_shared_memory_halves_the_tile_of_a_cache_too_wide_for_an_sm():
    """A lone program's 128-position tile fits an H200 SM (227 KiB) in bf16, not in fp32: the
    fp32 launch takes 64 positions; everything but the tile is kept."""
    h200 = 232_448
    lone = kernels.DecodeConfig(num_splits=2, block_n=128, num_warps=8, num_stages=5)
    assert kernels.fit_shared_memory(lone, 128, 2, h200) == lone
    fp32 = kernels.fit_shared_memory(lone, 128, 4, h200)
    assert (fp32.block_n, fp32.num_splits, fp32.num_warps, fp32.num_stages) == (64, 2, 8, 5)
    assert kernels.fit_shared_memory(lone, 256, 4, 1).block_n == 16  # never below 16 positions
