"""labkit.zero: the memory and traffic formulas, the two layouts, the sharded AdamW, and
ZeRO-1/2 and FSDP on gloo processes against torch's FSDP2 ``fully_shard`` and
``ZeroRedundancyOptimizer`` (losses and parameters step by step), with the bytes counted
through the collectives and the memory of a simulated rank measured against the formulas."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import labkit  # noqa: F401  (sets the mode before anything else)
from labkit.collectives import launch
from labkit.models import TINY
from labkit.zero import (FP32_ADAMW, MIXED_ADAMW, FlatLayout, PerParameterLayout, ShardedAdamW, bench,
                         fsdp_bytes_per_rank, held_bytes, programs, ring_bytes_sent, state_bytes_per_rank,
                         traffic_per_rank)

TINY_CONFIG = dataclasses.asdict(TINY)


# --- formulas ----------------------------------------------------------------------------------

def test_zero_paper_figure_1():
    """The ZeRO paper's example (Rajbhandari et al. 2020, Figure 1): 7.5 B parameters, 64 GPUs,
    K = 12: 120 GB per GPU for DDP, 31.4 for P_os, 16.6 for P_os+g, 1.9 for P_os+g+p."""
    want = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in want.items():
        got = state_bytes_per_rank(7_500_000_000, 64, stage, MIXED_ADAMW)["total"] / 1e9
        assert got == pytest.approx(gb, abs=0.05), (stage, got)


@pytest.mark.parametrize("precision", [MIXED_ADAMW, FP32_ADAMW])
def test_each_stage_shards_one_more_kind(precision):
    p, n = 1000, 4
    assert precision.total == 16
    held = [state_bytes_per_rank(p, n, s, precision) for s in range(4)]
    assert held[0]["total"] == 16 * p and held[3]["total"] == 16 * p / n
    assert held[1]["optimizer"] == precision.optimizer * p / n and held[1]["grads"] == precision.grad * p
    assert held[2]["grads"] == precision.grad * p / n and held[2]["params"] == precision.param * p
    assert [h["total"] for h in held] == sorted((h["total"] for h in held), reverse=True)


def test_traffic_is_ddp_s_for_stages_0_to_2_and_one_and_a_half_times_at_stage_3():
    p, n, b = 10_000, 8, 2
    ddp = 2 * (n - 1) / n * p * b  # one ring all-reduce of the gradients
    for stage in (0, 1, 2):
        assert traffic_per_rank(p, n, stage, b)["total"] == pytest.approx(ddp)
    assert traffic_per_rank(p, n, 3, b)["total"] == pytest.approx(1.5 * ddp)
    assert traffic_per_rank(p, n, 3, b, regathered_params=p - 100)["all_gather"] == pytest.approx(
        ring_bytes_sent("all_gather", (2 * p - 100) * b, n))
    assert ring_bytes_sent("all_reduce", 100, 4) == 150


def test_fsdp_peak_adds_the_gathered_units():
    units, root, n = [300, 500, 400], 50, 4
    shards = state_bytes_per_rank(1250, n, 3, MIXED_ADAMW)
    got = fsdp_bytes_per_rank(units, n, MIXED_ADAMW, root_params=root)
    assert got["params"] == shards["params"] + 2 * (50 + 2 * 500)
    assert got["grads"] == shards["grads"] + 2 * 500
    assert got["optimizer"] == shards["optimizer"]
    no_prefetch = fsdp_bytes_per_rank(units, n, MIXED_ADAMW, root_params=root, prefetch=False)
    assert got["total"] - no_prefetch["total"] == 2 * 500


@pytest.mark.parametrize("call, match", [
    (lambda: state_bytes_per_rank(100, 4, 5), "stage"),
    (lambda: state_bytes_per_rank(100, 4, True), "stage"),
    (lambda: state_bytes_per_rank(0, 4, 1), "num_params"),
    (lambda: state_bytes_per_rank(100, 0, 1), "world_size"),
    (lambda: state_bytes_per_rank(100, 4, 1, "mixed"), "precision"),
    (lambda: traffic_per_rank(100, 4, 3, 2, regathered_params=101), "regathered_params"),
    (lambda: traffic_per_rank(100, 4, 3, 0), "bytes_per_element"),
    (lambda: ring_bytes_sent("broadcast", 10, 2), "collective"),
    (lambda: fsdp_bytes_per_rank([], 4), "unit_params"),
    (lambda: fsdp_bytes_per_rank([10], 4, root_params=-1), "root_params"),
])
def test_formulas_reject_bad_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --- layouts -------------------------------------------------------------------------------------

def _random_tensors(seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    shapes = [tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("layout_class", [FlatLayout, PerParameterLayout])
def test_layout_round_trip_and_equal_shards(seed, world_size, layout_class):
    tensors = _random_tensors(seed)
    layout = layout_class([t.shape for t in tensors], world_size)
    packed = layout.pack(tensors)
    assert packed.numel() == world_size * layout.shard_numel >= sum(t.numel() for t in tensors)
    assert torch.equal(torch.cat([layout.shard_of(packed, r) for r in range(world_size)]), packed)
    for got, want in zip(layout.unpack(packed), tensors):
        assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_per_parameter_shards_are_torch_chunk_rows(seed, world_size):
    """FSDP2's Shard(0): rank r holds torch.chunk(t, N)[r] of every parameter (nothing where chunk has none)."""
    tensors = _random_tensors(seed)
    layout = PerParameterLayout([t.shape for t in tensors], world_size)
    packed = layout.pack(tensors)
    for r in range(world_size):
        for t, local in zip(tensors, layout.local_rows(layout.shard_of(packed, r), r)):
            chunks = torch.chunk(t, world_size)
            assert torch.equal(local, chunks[r] if r < len(chunks) else t[:0])


def test_flat_layout_lets_a_parameter_straddle_ranks():
    layout = FlatLayout([(3,), (4,)], 2)  # 7 elements, shards of 4: the second tensor is split 1 + 3
    packed = layout.pack([torch.arange(3.0), torch.arange(10.0, 14.0)])
    assert layout.shard_of(packed, 0).tolist() == [0, 1, 2, 10] and layout.shard_of(packed, 1).tolist() == [11, 12, 13, 0]


def test_layouts_reject_no_tensors():
    with pytest.raises(ValueError, match="at least one"):
        FlatLayout([], 2)
    with pytest.raises(ValueError, match="world_size"):
        PerParameterLayout([(2,)], 0)


# --- the sharded optimizer and the accounting -----------------------------------------------

@pytest.mark.parametrize("numel, chunk", [(1001, 1), (1001, 64), (1001, 5000), (37, 7)])
def test_sharded_adamw_is_torch_adamw_bit_for_bit(numel, chunk):
    g = torch.Generator().manual_seed(numel + chunk)
    start = torch.randn(numel, generator=g)
    master, ref = start.clone(), torch.nn.Parameter(start.clone())
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, theirs = ShardedAdamW(master, chunk_numel=chunk, **hyper), torch.optim.AdamW([ref], **hyper)
    for _ in range(4):
        grad = torch.randn(numel, generator=g)
        ours.step(grad)
        ref.grad = grad.clone()
        theirs.step()
    assert torch.equal(master, ref.detach())
    assert sum(t.numel() for t in ours.state_tensors() if t.dim()) == 2 * numel  # two moments, nothing more


def test_sharded_adamw_steps_fp32_masters_from_bf16_gradients():
    master = torch.randn(50)
    ShardedAdamW(master, lr=0.1, chunk_numel=8).step(torch.randn(50).to(torch.bfloat16))
    assert master.dtype == torch.float32 and torch.isfinite(master).all()


@pytest.mark.parametrize("call, error, match", [
    (lambda: ShardedAdamW(torch.zeros(4, dtype=torch.bfloat16), lr=1.0), TypeError, "master"),
    (lambda: ShardedAdamW(torch.zeros(2, 2), lr=1.0), ValueError, "master"),
    (lambda: ShardedAdamW(torch.zeros(4), lr=1.0, chunk_numel=0), ValueError, "chunk_numel"),
    (lambda: ShardedAdamW(torch.zeros(4), lr=1.0).step(torch.zeros(5)), ValueError, "grad"),
])
def test_sharded_adamw_rejects_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_held_bytes_counts_a_shared_storage_once():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:]]
    other = torch.zeros(10, dtype=torch.float64)
    held = held_bytes({"params": views, "grads": [flat, other, None]})
    assert held == {"params": 400, "grads": 80, "total": 480}
    other.untyped_storage().resize_(0)  # a freed (resharded) tensor holds nothing
    assert held_bytes({"grads": [other]})["total"] == 0


# --- on processes: against torch ----------------------------------------------------------------

def _check_same_run(report, bitwise):
    steps = len(report["our_loss"])
    if bitwise:
        assert report["our_loss"] == report["their_loss"], report
        assert all(report["params_equal"]), report["max_param_diff"]
    else:  # another order of summing over ranks: last-bit differences, amplified a little by Adam
        assert max(report["max_param_diff"]) < 1e-4, report["max_param_diff"]
        assert max(abs(a - b) for a, b in zip(report["our_loss"], report["their_loss"])) < 1e-4
    # the weights moved (Adam's first step moves each by about lr): runs that did nothing prove nothing
    assert steps and report["moved"] > 0.5 * programs.HYPER["lr"]


def _check_traffic(report):
    """The bytes counted through our collectives are the formula's (shards padded to N)."""
    n, p = report["world_size"], report["num_params"]
    stage = programs.STAGE_OF[report["kind"]]
    regathered = p - report.get("root_params", 0)
    want = traffic_per_rank(p, n, stage, 4, regathered_params=regathered if stage == 3 else None)
    for step in report["sent"]:
        for collective in ("reduce_scatter", "all_gather"):
            assert want[collective] <= step[collective] <= want[collective] * 1.01, (collective, step, want)


def test_every_wrapper_matches_torch_bit_for_bit_on_two_ranks():
    """ZeRO-1/2 against DDP + ZeroRedundancyOptimizer, FSDP (both layouts) against FSDP2's fully_shard."""
    cases = [(kind, TINY_CONFIG, 3, {}) for kind in programs.WRAPPERS]
    reports = launch.run(programs.compare_cases, 2, args=(cases,), backend_name="gloo", timeout_s=300)
    for rank_reports in zip(*reports):
        assert all(r["our_loss"] == rank_reports[0]["our_loss"] for r in rank_reports)  # ranks agree
    for report in reports[0]:
        _check_same_run(report, bitwise=True)
        _check_traffic(report)
    fsdp2 = next(r for r in reports[0] if r["kind"] == "fsdp2")
    assert fsdp2["sent"] == fsdp2["their_sent"]  # FSDP2's own collectives, counted: the same bytes, padding included


def test_fsdp_matches_fsdp2_for_twenty_steps_on_four_ranks():
    """The issue's goal: loss curves identical to FSDP2 for 20 steps (here also every parameter)."""
    cases = [("fsdp2", TINY_CONFIG, 20, {}), ("zero1", TINY_CONFIG, 3, {})]
    fsdp2, zero1 = launch.run(programs.compare_cases, 4, args=(cases,), backend_name="gloo", timeout_s=400)[0]
    _check_same_run(fsdp2, bitwise=True)
    _check_traffic(fsdp2)
    assert fsdp2["sent"] == fsdp2["their_sent"]
    # DDP's all-reduce adds the four ranks' gradients in another order than a reduce-scatter does
    _check_same_run(zero1, bitwise=False)
    _check_traffic(zero1)


def test_ring_collectives_and_no_prefetch_on_three_ranks():
    """Our ring reduce-scatter and all-gather (labkit.collectives) under the wrappers, on a world size
    that is not a power of two (every shard padded); FSDP without prefetching."""
    cases = [("zero2", TINY_CONFIG, 3, dict(impl="ring")), ("fsdp1", TINY_CONFIG, 3, dict(impl="ring", prefetch=False))]
    for report in launch.run(programs.compare_cases, 3, args=(cases,), backend_name="gloo", timeout_s=300)[0]:
        _check_same_run(report, bitwise=False)
        _check_traffic(report)


# --- memory of a simulated rank ----------------------------------------------------------------

def test_measured_memory_is_within_ten_percent_of_the_formula():
    """The issue's goal, on the CPU: every stage, 2, 4 and 8 ranks, storage counted."""
    rec = bench.measure()
    assert {(r["kind"], r["world_size"]) for r in rec.rows} == {(k, n) for k in programs.WRAPPERS for n in (2, 4, 8)}
    for row in rec.rows:
        assert abs(row["held/formula"] - 1) <= bench.TOLERANCE, row
        assert row["held_optimizer"] == pytest.approx(row["formula_optimizer"], rel=0.01), row
    assert all(goal.met for goal in rec.goals)
    by = {(r["kind"], r["world_size"]): r["held_bytes"] for r in rec.rows}
    for n in (2, 4, 8):  # each stage holds less than the one before
        assert by[("zero1", n)] > by[("zero2", n)] > by[("fsdp2", n)]


def test_prefetching_holds_one_more_unit():
    config = bench.CPU_CONFIG
    on = programs.simulated_rank_memory(config, 4, "fsdp2", prefetch=True)
    off = programs.simulated_rank_memory(config, 4, "fsdp2", prefetch=False)
    unit = max(on["formula"]["params"] - off["formula"]["params"], 1)
    assert on["held_peak"]["params"] - off["held_peak"]["params"] == pytest.approx(unit, rel=0.05)


# --- errors ----------------------------------------------------------------------------------------

@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone, for the checks that need one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_wrappers_reject_bad_arguments(one_rank_group):
    from labkit.models import Decoder, DecoderConfig
    from labkit.zero import Communicator, FullyShard, ZeroDataParallel

    model = Decoder(DecoderConfig(**TINY_CONFIG))
    cases = [
        (lambda: ZeroDataParallel(model, stage=3), ValueError, "stage must be 1 or 2"),
        (lambda: ZeroDataParallel(model, stage=1, bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
        (lambda: ZeroDataParallel(model, stage=1, betas=(0.9, 1.5)), ValueError, "betas"),
        (lambda: ZeroDataParallel(model, stage=1, lr=-1), ValueError, "lr"),
        (lambda: ZeroDataParallel("model", stage=1), TypeError, "torch.nn.Module"),
        (lambda: ZeroDataParallel(torch.nn.Linear(2, 2).requires_grad_(False), stage=1), ValueError, "no trainable"),
        (lambda: FullyShard(model, [torch.nn.Linear(2, 2)]), ValueError, "units must be"),
        (lambda: FullyShard(model, [model]), ValueError, "units must be"),
        (lambda: FullyShard(model, model.blocks, layout="rows"), ValueError, "layout"),
        (lambda: FullyShard(model, model.blocks, prefetch=1), TypeError, "prefetch"),
        (lambda: Communicator("nccl-please"), ValueError, "impl"),
        (lambda: Communicator().all_gather(torch.zeros(3), torch.zeros(2)), ValueError, "world_size"),
        (lambda: Communicator().reduce_scatter(torch.zeros(2), torch.zeros(2, dtype=torch.float64)), TypeError,
         "dtype"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_wrappers_need_a_process_group():
    from labkit.models import Decoder, DecoderConfig
    from labkit.zero import FullyShard, ZeroDataParallel

    model = Decoder(DecoderConfig(**TINY_CONFIG))
    with pytest.raises(RuntimeError, match="no process group"):
        ZeroDataParallel(model, stage=2)
    with pytest.raises(RuntimeError, match="no process group"):
        FullyShard(model, model.blocks)


def test_torch_collectives_are_counted_once_and_restored(one_rank_group):
    import torch.distributed as dist

    from labkit.zero import counting_torch_collectives

    before = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    log = []
    with counting_torch_collectives(log):
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, torch.ones(6))
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3))
    assert [(t.collective, t.tensor_bytes) for t in log] == [("all_gather", 24), ("reduce_scatter", 12)]
    assert all(t.sent_bytes == 0 for t in log)  # one rank sends nothing
    assert all(getattr(dist, name) is fn for name, fn in before.items())


def test_ownership_figure_shows_both_cuts():
    from labkit.zero import figures

    maps = figures.ownership_heatmaps([(3, 2), (2, 2)], 2)  # 10 elements: flat shards of 5; chunks of 2 and 1 rows
    flat, per_param = (maps[k][0].z for k in ("FSDP1: flat", "FSDP2: per-parameter"))
    assert [list(r) for r in flat] == [[0, 0], [0, 0], [0, 1], [None, None], [1, 1], [1, 1]]
    assert [list(r) for r in per_param] == [[0, 0], [0, 0], [1, 1], [None, None], [0, 0], [1, 1]]
