"""labkit.moe: routers, dispatch/combine, the grouped GEMM, the layer, expert parallelism.

References are float64 loops over experts and HF transformers' Qwen3-MoE block; sizes are
odd (not multiples of the 16x32 interpreter tile), with empty and single-row experts.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from labkit import backend, check
from labkit.moe import (
    DispatchPlan, MoEWeights, combine, expert_capacity, expert_counts, experts_reference,
    gather_combine, grouped_mm, grouped_mm_loop, imbalance, load_balancing_loss, moe_layer, moe_layer_reference,
    permute, plan_dispatch, random_moe_weights, sigmoid_topk_with_bias, softmax_topk, update_bias, zipf_counts,
)
from labkit.moe import kernels
from labkit.moe.kernels import combine_launch, grouped_mm_launch
from labkit.moe.reference import tile_schedule
from labkit.moe.traffic import layer_traffic, remote_gpus_per_token

KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def offsets_from_counts(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)


# --- routers ---------------------------------------------------------------------------

def test_softmax_topk_picks_the_largest_and_renormalizes():
    logits = check.randn(37, 9, seed=1)
    r = softmax_topk(logits, 3)
    probs = torch.softmax(logits.double(), -1)
    top, ids = probs.topk(3, -1)
    assert torch.equal(r.expert_ids, ids)
    check.assert_close(r.weights, top / top.sum(-1, keepdim=True), dtype=torch.float32)
    raw = softmax_topk(logits, 3, normalize=False)
    check.assert_close(raw.weights, top, dtype=torch.float32)


def test_sigmoid_bias_steers_choice_but_not_weights():
    logits = check.randn(41, 8, seed=2)
    bias = torch.zeros(8)
    bias[5] = 100.0  # expert 5 always wins a slot
    r = sigmoid_topk_with_bias(logits, bias, 2)
    assert (r.expert_ids == 5).any(-1).all()
    scores = torch.sigmoid(logits.double())
    chosen = torch.gather(scores, -1, r.expert_ids)
    check.assert_close(r.weights, chosen / chosen.sum(-1, keepdim=True), dtype=torch.float32)


def test_balancing_loss_is_one_when_balanced_and_larger_when_not():
    ids = torch.arange(12).remainder(4).view(6, 2)  # every expert used 3 times
    balanced = softmax_topk(torch.zeros(6, 4), 2)
    assert math.isclose(load_balancing_loss(type(balanced)(ids, balanced.weights, balanced.probs)).item(), 1.0)
    skewed_logits = torch.tensor([[4.0, 3.0, 0.0, 0.0]]).repeat(6, 1)
    assert load_balancing_loss(softmax_topk(skewed_logits, 2)).item() > 1.5


def test_balancing_loss_is_hf_loss_over_k():
    qwen = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    logits = check.randn(53, 7, seed=3)
    ours = load_balancing_loss(softmax_topk(logits, 3))
    theirs = qwen.load_balancing_loss_func((logits,), num_experts=7, top_k=3)
    check.assert_close(ours * 3, theirs, dtype=torch.float32)


def test_zipf_counts_sum_exactly_and_skew_as_asked():
    assert zipf_counts(64 * 17, 64, 0.0) == [17] * 64
    counts = zipf_counts(32768, 64, 1.0)
    assert sum(counts) == 32768 and counts == sorted(counts, reverse=True)
    harmonic = sum(1 / e for e in range(1, 65))
    assert counts[0] == pytest.approx(32768 / harmonic, abs=64) and counts[1] == int(32768 / harmonic / 2)
    with pytest.raises(ValueError, match="skew must be >= 0"):
        zipf_counts(10, 4, -1.0)
    with pytest.raises(ValueError, match="rows must be a non-negative int"):
        zipf_counts(10.5, 4, 1.0)


def test_update_bias_lowers_overloaded_experts():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])  # counts 3, 2, 1, 0
    new = update_bias(torch.zeros(4), ids, 0.1)
    assert new[0] < 0 and new[3] > 0
    assert imbalance(ids, 4) == pytest.approx(3 / 1.5)


# --- dispatch and combine --------------------------------------------------------------

def test_plan_sorts_rows_by_expert_stably():
    r = softmax_topk(check.randn(29, 6, seed=4), 2)
    plan = plan_dispatch(r.expert_ids, r.weights, 6)
    sorted_ids = r.expert_ids.flatten()[plan.slot_of_row]
    assert torch.equal(plan.counts, expert_counts(r.expert_ids, 6))
    for e in range(6):
        lo, hi = plan.offsets[e].item(), plan.offsets[e + 1].item()
        assert (sorted_ids[lo:hi] == e).all()
        assert torch.all(plan.slot_of_row[lo:hi].diff() > 0)  # stable: token order kept
    assert torch.equal(plan.slot_of_row.sort().values, torch.arange(58))


def test_combine_of_permute_is_identity_with_normalized_weights():
    x = check.randn(23, 11, seed=5, dtype=torch.float64)
    r = softmax_topk(check.randn(23, 5, seed=6), 3)
    plan = plan_dispatch(r.expert_ids, r.weights, 5)
    check.assert_close(combine(permute(x, plan), plan), x, dtype=torch.float32)


def test_capacity_drops_later_tokens_and_zeroes_them():
    ids = torch.zeros(7, 1, dtype=torch.int64)  # all seven tokens want expert 0
    plan = plan_dispatch(ids, torch.ones(7, 1), 3, capacity=expert_capacity(7, 3, 1, 1.0))
    assert plan.counts.tolist() == [3, 0, 0] and plan.num_dropped == 4
    assert plan.token_of_row.tolist() == [0, 1, 2]
    out = combine(permute(check.randn(7, 4, seed=7), plan), plan)
    assert (out[3:] == 0).all() and (out[:3] != 0).all()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gather_combine_matches_combine_with_drops(dtype):
    r = softmax_topk(check.randn(37, 5, seed=30), 3)
    plan = plan_dispatch(r.expert_ids, r.weights, 5, capacity=18)  # some slots dropped
    assert plan.num_dropped > 0
    rows = check.randn(plan.slot_of_row.numel(), 43, dtype=dtype, seed=31)
    out = check.empty_poisoned((37, 43), dtype, "cpu")
    combine_launch(rows, plan.row_of_slot, r.weights.float().contiguous(), out, 3)
    check.assert_close(out, combine(rows.double(), plan), dtype=dtype, name="gather_combine")
    assert torch.equal(plan.row_of_slot[plan.slot_of_row], torch.arange(plan.slot_of_row.numel()))


def test_gather_combine_rejects_bad_input():
    r = softmax_topk(torch.randn(4, 3), 2)
    plan = plan_dispatch(r.expert_ids, r.weights, 3)
    rows = torch.randn(8, 6)
    with pytest.raises(TypeError, match="plan must be a DispatchPlan"):
        gather_combine(rows, None, r.weights)
    with pytest.raises(ValueError, match="8 rows for this plan"):
        gather_combine(rows[:7], plan, r.weights)
    with pytest.raises(ValueError, match="row-major"):
        gather_combine(torch.randn(6, 8).t(), plan, r.weights)
    with pytest.raises(ValueError, match="weights must be"):
        gather_combine(rows, plan, r.weights[:, :1])


# --- the grouped GEMM ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_grouped_mm_matches_float64_loop(dtype):
    counts = [0, 5, 17, 1, 0, 33]  # empty experts, a single row, ragged tails
    offsets = offsets_from_counts(counts)
    a = check.randn(sum(counts), 41, dtype=dtype, seed=8)
    w = check.randn(6, 53, 41, dtype=dtype, seed=9)
    out = check.empty_poisoned((sum(counts), 53), dtype, "cpu")
    grouped_mm_launch(a, w, offsets, out, None)
    check.assert_close(out, grouped_mm_loop(a.double(), w.double(), offsets), dtype=dtype, name="grouped_mm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_gathers_rows(dtype):
    counts = [9, 0, 14]
    offsets = offsets_from_counts(counts)
    x = check.randn(11, 37, dtype=dtype, seed=10)
    rows = torch.randint(0, 11, (23,), generator=torch.Generator().manual_seed(0))
    w = check.randn(3, 35, 37, dtype=dtype, seed=11)
    expected = grouped_mm_loop(x.double()[rows], w.double(), offsets)
    check.assert_close(grouped_mm(x, w, offsets, gather_rows=rows), expected, dtype=dtype)


@pytest.mark.skipif(backend.on_gpu(), reason="the interpreter's check; test_grouped_mm_real_sizes_on_gpu runs them")
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tensor-descriptors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gpu_tile_config_is_correct_in_the_interpreter(dtype, use_tma):
    """Each Hopper config that fits this dtype, one program per tile and persistent, with both
    load paths, plain and gathered (fp32's stages are twice bf16's: the autotuner drops those
    that overflow shared memory, as should this test, which compiles each for sm_90 in CI)."""
    counts = [0, 70, 300, 1, 0, 129]  # ragged tails on 32- to 256-row tiles, empty experts
    offsets = offsets_from_counts(counts)
    a = check.randn(sum(counts), 80, dtype=dtype, seed=40)  # K and N ragged against every block
    w = check.randn(6, 72, 80, dtype=dtype, seed=41)
    rows = torch.randint(0, sum(counts), (sum(counts),), generator=torch.Generator().manual_seed(1))
    expected = grouped_mm_loop(a.double(), w.double(), offsets)
    expected_gathered = grouped_mm_loop(a.double()[rows], w.double(), offsets)
    fitting = [c for c in kernels.GPU_CONFIGS if kernels.fits_in_shared_memory(c, a.element_size())]
    assert fitting, "no Hopper tile fits this dtype"
    for config in fitting:
        out = check.empty_poisoned((sum(counts), 72), dtype, "cpu")
        grouped_mm_launch(a, w, offsets, out, None, config=config, use_tma=use_tma)
        check.assert_close(out, expected, dtype=dtype, name=kernels.tile_name(config))
        grouped_mm_launch(a, w, offsets, out, rows, config=config, use_tma=use_tma)
        check.assert_close(out, expected_gathered, dtype=dtype, name=f"{kernels.tile_name(config)}, gathered")


def test_autotuning_tries_only_tiles_that_suit_the_rows_and_fit():
    configs = kernels.GPU_CONFIGS
    bf16, fp32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    for rows_per_expert, block_ms in [(16, {32, 64}), (256, {64, 128}), (2048, {128, 256})]:
        rows_class = kernels._rows_class(rows_per_expert)
        kept = kernels._configs_for_rows(configs, {"a_ptr": bf16, "ROWS_CLASS": rows_class})
        assert kept and {c.kwargs["BLOCK_M"] for c in kept} <= block_ms
        # fp32 tries only tiles whose stages fit shared memory (at 2048 rows no 128-row tile does)
        kept32 = kernels._configs_for_rows(configs, {"a_ptr": fp32, "ROWS_CLASS": rows_class})
        assert kept32 and all(c.num_stages * 4 * c.kwargs["BLOCK_K"] * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"])
                              <= 227 * 1024 for c in kept32)
        # gathered rows never get a persistent tile; plain rows at 2048 per expert do
        gathered = kernels._configs_for_rows(configs, {"a_ptr": bf16, "ROWS_CLASS": rows_class}, HAS_GATHER=True)
        assert gathered and not any(c.kwargs["PERSISTENT"] for c in gathered)
    assert any(c.kwargs["PERSISTENT"] for c in kept)


def test_grouped_mm_falls_back_to_pointers_where_tma_cannot_read():
    """A strided W (a slice of a larger weight) and unaligned rows take the pointer path, still correct."""
    counts = [3, 0, 20]
    offsets = offsets_from_counts(counts)
    a = check.randn(23, 48, seed=42)
    w = check.randn(3, 40, 48, seed=43)[:, 3:36]  # experts' rows do not follow each other
    check.assert_close(grouped_mm(a, w, offsets), grouped_mm_loop(a.double(), w.double(), offsets),
                       dtype=torch.float32)
    a_odd = check.randn(23, 49, seed=44)[:, 1:]  # rows 196 bytes apart, not 16-byte aligned
    check.assert_close(grouped_mm(a_odd, w, offsets), grouped_mm_loop(a_odd.double(), w.double(), offsets),
                       dtype=torch.float32)


def test_tile_schedule_covers_every_row_once_within_the_grid_bound():
    counts = [0, 5, 130, 1, 0, 256, 129]
    tiles = tile_schedule(counts, 128)
    covered = [r for _, lo, hi in tiles for r in range(lo, hi)]
    assert covered == list(range(sum(counts)))
    assert len(tiles) <= math.ceil(sum(counts) / 128) + len(counts)  # the kernel's grid bound
    assert [e for e, _, _ in tiles] == [1, 2, 2, 3, 5, 5, 6, 6]


def test_grouped_mm_all_rows_in_one_expert_and_none():
    a = check.randn(19, 40, seed=12)
    w = check.randn(4, 33, 40, seed=13)
    offsets = offsets_from_counts([0, 0, 19, 0])
    check.assert_close(grouped_mm(a, w, offsets), a.double() @ w[2].double().t(), dtype=torch.float32)
    empty = grouped_mm(a[:0], w, offsets_from_counts([0, 0, 0, 0]))
    assert empty.shape == (0, 33)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_mm_real_sizes_on_gpu(dtype):
    """At Qwen3-30B-A3B shapes, ragged counts and empty experts: the autotuned tile and every GPU config."""
    counts = torch.randint(0, 700, (64,), generator=torch.Generator().manual_seed(3))
    counts[[5, 17]] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).cuda()
    m = int(counts.sum())
    a = check.randn(m, 2048, dtype=dtype, device="cuda", seed=4)
    w = check.randn(64, 1536, 2048, dtype=dtype, device="cuda", seed=5, scale=2048**-0.5)
    rows = torch.randperm(m, device="cuda")
    expected = grouped_mm_loop(a.float(), w.float(), offsets)
    expected_gathered = grouped_mm_loop(a.float()[rows], w.float(), offsets)
    check.assert_close(grouped_mm(a, w, offsets), expected, dtype=dtype)
    check.assert_close(grouped_mm(a, w, offsets, gather_rows=rows), expected_gathered, dtype=dtype)
    for config in kernels.GPU_CONFIGS if dtype == torch.bfloat16 else []:
        out = check.empty_poisoned((m, 1536), dtype, "cuda")
        grouped_mm_launch(a, w, offsets, out, None, config=config)
        check.assert_close(out, expected, dtype=dtype, name=kernels.tile_name(config))
        grouped_mm_launch(a, w, offsets, out, rows, config=config)
        check.assert_close(out, expected_gathered, dtype=dtype, name=f"{kernels.tile_name(config)}, gathered")


def test_grouped_mm_rejects_bad_input():
    a, w, off = torch.randn(4, 8), torch.randn(2, 5, 8), offsets_from_counts([1, 3])
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        grouped_mm(a.tolist(), w, off)
    with pytest.raises(TypeError, match="w must have dtype"):
        grouped_mm(a, w.double(), off)
    with pytest.raises(ValueError, match="w must have 3 dimensions"):
        grouped_mm(a, w[0], off)
    with pytest.raises(ValueError, match="K=8"):
        grouped_mm(a[:, :7], w, off)
    with pytest.raises(ValueError, match="E\\+1 = 3"):
        grouped_mm(a, w, off[:2])
    with pytest.raises(TypeError, match="offsets must have dtype"):
        grouped_mm(a, w, off.int())
    with pytest.raises(TypeError, match="gather_rows must have dtype"):
        grouped_mm(a, w, off, gather_rows=torch.zeros(4, dtype=torch.int32))


# --- the layer -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_float64_experts_on_the_same_routing(dtype):
    weights = random_moe_weights(7, 44, 21, 3, dtype=dtype, seed=14)
    x = check.randn(31, 44, dtype=dtype, seed=15)
    out, routing, _ = moe_layer(x, weights, return_routing=True)
    expected = experts_reference(x.double(), routing, weights.gate_up.double(), weights.down.double())
    check.assert_close(out, expected, dtype=dtype, name="moe_layer")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_matches_hf_qwen3_moe_block(dtype):
    pytest.importorskip("transformers")
    from labkit.moe.oracle import qwen3_moe_forward

    weights = random_moe_weights(6, 40, 19, 2, dtype=dtype, seed=16)
    x = check.randn(27, 40, dtype=dtype, seed=17)
    # HF rounds every step to bf16 too, so in bf16 two roundings of the same maths meet.
    tol = check.tolerance(dtype) * (2 if dtype == torch.bfloat16 else 1)
    check.assert_close(moe_layer(x, weights), qwen3_moe_forward(weights, x).float(), tol=tol, name="vs HF")


def test_reference_layer_matches_hf():
    pytest.importorskip("transformers")
    from labkit.moe.oracle import qwen3_moe_forward

    w = random_moe_weights(5, 24, 13, 2, seed=18)
    x = check.randn(17, 24, seed=19)
    check.assert_close(moe_layer_reference(x, w.router, w.gate_up, w.down, 2), qwen3_moe_forward(w, x))


def test_layer_with_capacity_zeroes_dropped_slots():
    weights = random_moe_weights(4, 36, 17, 2, seed=20)
    x = check.randn(25, 36, seed=21)
    out, routing, plan = moe_layer(x, weights, capacity_factor=0.5, return_routing=True)
    assert plan.num_dropped > 0
    kept = torch.zeros(25 * 2, dtype=torch.bool)
    kept[plan.slot_of_row] = True
    dropped_zeroed = type(routing)(routing.expert_ids, routing.weights * kept.view(25, 2), routing.probs)
    expected = experts_reference(x.double(), dropped_zeroed, weights.gate_up.double(), weights.down.double())
    check.assert_close(out, expected, dtype=torch.float32)


def test_layer_and_routers_reject_bad_input():
    w = random_moe_weights(4, 8, 6, 2)
    with pytest.raises(TypeError, match="weights must be MoEWeights"):
        moe_layer(torch.randn(3, 8), (w.router, w.gate_up, w.down))
    with pytest.raises(ValueError, match="hidden size 7"):
        moe_layer(torch.randn(3, 7), w)
    with pytest.raises(TypeError, match="x must have dtype"):
        moe_layer(torch.randn(3, 8).double(), w)
    with pytest.raises(ValueError, match="top_k must be at most"):
        softmax_topk(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        softmax_topk(torch.randn(4), 1)
    with pytest.raises(ValueError, match="one entry per expert"):
        sigmoid_topk_with_bias(torch.randn(3, 4), torch.zeros(5), 2)
    with pytest.raises(TypeError, match="routing must be a Routing"):
        load_balancing_loss(torch.randn(3, 4))
    with pytest.raises(ValueError, match="rate must be a positive"):
        update_bias(torch.zeros(4), torch.zeros(3, 2, dtype=torch.int64), 0.0)
    with pytest.raises(TypeError, match="expert_ids must have dtype"):
        plan_dispatch(torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2), 4)
    with pytest.raises(ValueError, match="weights must match"):
        plan_dispatch(torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 1), 4)
    with pytest.raises(ValueError, match="capacity_factor must be"):
        expert_capacity(8, 4, 2, 0)
    plan = plan_dispatch(torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2), 4)
    with pytest.raises(ValueError, match="x must have 3 rows"):
        permute(torch.randn(4, 8), plan)
    with pytest.raises(TypeError, match="plan must be a DispatchPlan"):
        combine(torch.randn(6, 8), "plan")
    assert isinstance(plan, DispatchPlan) and isinstance(w, MoEWeights)


# --- expert parallelism and traffic ----------------------------------------------------

def _expert_parallel_check(world, tokens, dtype, backend_name):
    from labkit.collectives.launch import run
    from labkit.moe.parallel import check_against_single_process

    results = run(check_against_single_process, world, args=(22, tokens, 6, 24, 10, 2, dtype),
                  backend_name=backend_name, timeout_s=240)
    for rank, r in enumerate(results):
        check.assert_close(r["out"], r["expected"], name=f"rank {rank}")
        assert sum(r["rows_sent"]) == 2 * (tokens + rank)  # every slot leaves once


@pytest.mark.parametrize("world, tokens, dtype", [(3, 1, "float32"), (2, 12, "bfloat16")])
def test_expert_parallel_matches_single_process(world, tokens, dtype):
    """gloo processes on the CPU; one rank has a single token, so some splits are empty."""
    _expert_parallel_check(world, tokens, dtype, "gloo")


@pytest.mark.gpu
def test_expert_parallel_over_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL expert parallelism needs two GPUs")
    _expert_parallel_check(2, 300, "bfloat16", "nccl")


def test_traffic_ep_dedups_per_gpu_and_dp_sends_nothing():
    shape = dict(tokens=4096, hidden=2048, intermediate=768, experts=64, top_k=2, gpus=8, hbm_tbps=4.0)
    ep, tp, dp = (layer_traffic(s, **shape) for s in ("EP", "TP", "DP"))
    assert ep.bytes_per_pair / tp.bytes_sent == pytest.approx(2 / 8)  # one row per (token, choice): k/G of TP
    # the second choice shares the first one's GPU with probability 7/63: that token is sent there once
    same_gpu = 7 / 63
    remote = (1 - same_gpu) * 2 * 7 / 8 + same_gpu * 7 / 8  # distinct remote GPUs, by cases
    assert ep.bytes_sent == pytest.approx(2 * 512 * 2048 * 2 * remote)
    assert ep.bytes_sent < ep.bytes_per_pair
    assert dp.bytes_sent == 0 and dp.weight_bytes == 8 * ep.weight_bytes
    assert ep.flops == tp.flops == dp.flops
    assert dp.weight_read_time_us == pytest.approx(dp.weight_bytes / 4.0e12 * 1e6)
    slow = dict(call_latency_us=10.0, step_latency_us=2.0)
    assert layer_traffic("EP", **shape, **slow).latency_us == pytest.approx(2 * (10 + 2))
    assert layer_traffic("TP", **shape, **slow).latency_us == pytest.approx(10 + 2 * 7 * 2)
    assert layer_traffic("DP", **shape, **slow).link_time_us == 0
    assert ep.link_time_us == pytest.approx(ep.bytes_sent / 450e9 * 1e6)
    # with one expert per GPU and k = G, every other GPU gets the token exactly once
    assert remote_gpus_per_token(8, 8, 8) == pytest.approx(7)
    with pytest.raises(ValueError, match="strategy must be one of"):
        layer_traffic("PP", **shape)
    with pytest.raises(ValueError, match="divide among 7"):
        layer_traffic("EP", **{**shape, "gpus": 7})
    with pytest.raises(ValueError, match="imbalance must be"):
        layer_traffic("EP", **shape, imbalance=0.5)
    with pytest.raises(ValueError, match="step_latency_us must be"):
        layer_traffic("TP", **shape, step_latency_us=-1.0)


def test_kernels_refuse_inputs_that_want_a_gradient():
    """grouped_mm and gather_combine have no backward: they once returned a detached result."""
    a, w, off = torch.randn(4, 8), torch.randn(2, 5, 8), offsets_from_counts([1, 3])
    with pytest.raises(RuntimeError, match="forward-only.*w requires grad"):
        grouped_mm(a, w.requires_grad_(), off)
    with torch.no_grad():
        assert grouped_mm(a, w, off).shape == (4, 5)
