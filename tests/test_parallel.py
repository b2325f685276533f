"""labkit.parallel: schedules and their simulator, the planner's formulas, and TP/SP/PP/CP on gloo ranks
checked against one process (losses, every gradient, ring attention against full attention) and
against the planner's traffic formulas."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from labkit import check
from labkit.collectives import launch
from labkit.models import TINY, Decoder, DecoderConfig, lm_loss
from labkit.parallel import (Action, PipelineStage, TensorParallelDecoder, bubble_fraction_formula, check_schedule,
                             in_flight, make_schedule, one_f_one_b, ring_attention, sequence_slice, simulate,
                             token_positions)
from labkit.parallel import planner, programs

# TINY's shapes with 4 layers (one per pipeline stage) and 4 K/V heads (one per TP rank of 4).
FOUR_WAY = dataclasses.asdict(dataclasses.replace(TINY, num_layers=4, num_kv_heads=4))
ROWS, SEQ, MICROBATCHES = 2, 12, 4
FP32 = 4


# --- schedules --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1), ("1f1b", 4, 2, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3), ("gpipe", 1, 3, 1)])
def test_simulated_bubble_matches_the_formula(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    check_schedule(schedule, m, v)
    for f, b in ((1.0, 2.0), (1.0, 1.0)):
        timeline = simulate(schedule, m, chunks=v, forward_time=f, backward_time=b)
        assert timeline.bubble_fraction() == pytest.approx(bubble_fraction_formula(p, m, v))
        assert timeline.makespan == pytest.approx((m + (p - 1) / v) * (f + b))


def test_one_f_one_b_bounds_the_stashed_microbatches():
    for p, m in ((4, 8), (4, 2), (5, 7)):
        assert [in_flight(actions) for actions in one_f_one_b(p, m)] == [min(p - r, m) for r in range(p)]
        assert [in_flight(actions) for actions in make_schedule("gpipe", p, m)] == [m] * p


def test_one_f_one_b_order_of_the_first_rank():
    assert [repr(a) for a in one_f_one_b(3, 4)[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_a_schedule_that_deadlocks_is_reported():
    schedule = make_schedule("1f1b", 2, 2)
    schedule[1] = [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]  # backward before its forward
    with pytest.raises(ValueError, match="deadlock"):
        simulate(schedule, 2)


def test_schedule_errors():
    with pytest.raises(ValueError, match="multiple of num_stages"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("zero-bubble", 4, 8)
    with pytest.raises(ValueError, match="interleaved"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="num_stages"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="exactly once"):
        check_schedule([[Action("F", 0)]], 1)


# --- planner ----------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [TINY, dataclasses.replace(TINY, tie_word_embeddings=False)])
def test_parameter_count_matches_the_model(config):
    model = Decoder(config)
    assert planner.ModelShape.of(config).params == sum(p.numel() for p in model.parameters())


def test_plan_fits_and_keeps_tensor_parallelism_inside_a_node():
    shape = planner.ModelShape(80, 8192, 64, 8, 128, 28672, 128256, tied=False)  # a 70B-parameter decoder
    result = planner.plan(shape, planner.hgx_h200(8), planner.Workload(seq=8192, micro_batch=1, global_batch=512))
    best = result.best
    assert best is not None and best.fits and best.memory_gb <= 0.9 * 141
    assert best.tp * best.pp * best.dp == 64 and best.tp <= 8
    assert result.candidates[0] == best and best.step_s == min(c.step_s for c in result.candidates if c.fits)
    across_nodes = [c for c in result.candidates if c.tp == 16]
    assert across_nodes and all(c.tp_link == "network" and c.tp_s > best.tp_s for c in across_nodes)
    assert all(not c.fits for c in result.candidates if c.tp == c.pp == 1)  # 1.1 TB of states on one GPU


def test_formulas_vanish_on_one_rank():
    shape = planner.ModelShape.of(TINY)
    assert planner.tensor_parallel_bytes(shape, 100, 1, 2) == 0
    assert planner.data_parallel_bytes(1000, 1, 2) == 0
    assert planner.ring_attention_forward_bytes(shape, 64, 1, 2) == 0


# --- errors that need no process group --------------------------------------------------------

def test_input_errors():
    with pytest.raises(TypeError, match="Decoder"):
        TensorParallelDecoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="split 2 layers evenly"):
        PipelineStage(Decoder(TINY), 0, 3)
    with pytest.raises(ValueError, match="multiple of 3 ranks"):
        sequence_slice(10, 0, 3)
    with pytest.raises(ValueError, match="zigzag"):
        token_positions(12, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        token_positions(12, 0, 4, "striped")
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        ring_attention(q, kv, kv)


# --- on gloo ranks ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_ranks():
    calls = [("tensor_parallel_step", (FOUR_WAY, ROWS, SEQ, False)), ("tensor_parallel_step", (FOUR_WAY, ROWS, SEQ, True))]
    calls += [("pipeline_step", (FOUR_WAY, name, MICROBATCHES, 1, ROWS, SEQ)) for name in ("gpipe", "1f1b")]
    calls += [("pipeline_step", (dict(FOUR_WAY, num_layers=8), "interleaved", MICROBATCHES, 2, ROWS, SEQ))]
    calls += [("ring_attention_check", (2, 4, 2, 24, 8, layout)) for layout in ("contiguous", "zigzag")]
    calls += [("data_parallel_step", (FOUR_WAY, ROWS, SEQ))]
    return launch.run(programs.run_many, 4, args=(calls,), backend_name="gloo", timeout_s=300)


@pytest.fixture(scope="module")
def two_ranks_tiny():
    """The book's TINY model itself: its 2 K/V heads split over 2 ranks, its 2 layers into 2 stages."""
    tiny = dataclasses.asdict(TINY)
    calls = [("tensor_parallel_step", (tiny, 3, 10, True)), ("pipeline_step", (tiny, "1f1b", 3, 1, 3, 10))]
    return launch.run(programs.run_many, 2, args=(calls,), backend_name="gloo", timeout_s=300)


def _reference(config: dict, ids: torch.Tensor) -> tuple[float, dict]:
    model = Decoder(DecoderConfig(**config), seed=0, init_std=0.1)
    loss = lm_loss(model, ids)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _check_tensor_parallel(per_rank, config, rows, seq, sequence_parallel):
    loss, grads = _reference(config, programs.batch(config["vocab_size"], rows, seq, 0))
    shape, n = planner.ModelShape.of(DecoderConfig(**config)), len(per_rank)
    for r in per_rank:
        check.assert_close(torch.tensor(r["loss"]), torch.tensor(loss), name="loss")
        assert r["activation_link_bytes"] == pytest.approx(planner.tensor_parallel_bytes(shape, rows * seq, n, FP32))
        assert r["grad_sync_link_bytes"] == pytest.approx(
            planner.tensor_parallel_partial_grad_bytes(shape, n, sequence_parallel, FP32))
        want_calls = ({"all_gather": 4 * shape.layers, "reduce_scatter": 4 * shape.layers} if sequence_parallel
                      else {"all_reduce": 4 * shape.layers})
        assert r["calls"] == want_calls
    assert set(per_rank[0]["grads"]) == set(grads)
    for name, (dim, _) in per_rank[0]["grads"].items():
        got = per_rank[0]["grads"][name][1] if dim is None else torch.cat([r["grads"][name][1] for r in per_rank], dim)
        check.assert_close(got, grads[name], name=f"grad of {name}")
        if dim is None:  # replicated parameters end equal on every rank
            assert all(torch.equal(r["grads"][name][1], got) for r in per_rank)


def _check_pipeline(per_rank, config, microbatches, chunks, rows, seq):
    ids = torch.cat([programs.batch(config["vocab_size"], rows, seq, 1 + i) for i in range(microbatches)])
    loss, grads = _reference(config, ids)
    check.assert_close(torch.tensor(sum(r["loss"] for r in per_rank)), torch.tensor(loss), name="loss")
    seen = set()
    for r in per_rank:
        for name, g in r["grads"].items():
            check.assert_close(g, grads[name], name=f"grad of {name}")
            seen.add(name)
    assert seen == set(grads)
    shape, p = planner.ModelShape.of(DecoderConfig(**config)), len(per_rank)
    assert sum(r["p2p_link_bytes"] for r in per_rank) == planner.pipeline_bytes(shape, rows * seq, microbatches, p,
                                                                                chunks, FP32)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_matches_one_process(four_ranks, sequence_parallel):
    _check_tensor_parallel([r[int(sequence_parallel)] for r in four_ranks], FOUR_WAY, ROWS, SEQ, sequence_parallel)


def test_sequence_parallel_saves_fewer_activations(four_ranks):
    assert all(r[1]["saved_bytes"] < r[0]["saved_bytes"] for r in four_ranks)


def test_tiny_model_on_two_ranks(two_ranks_tiny):
    tiny = dataclasses.asdict(TINY)
    _check_tensor_parallel([r[0] for r in two_ranks_tiny], tiny, 3, 10, True)
    _check_pipeline([r[1] for r in two_ranks_tiny], tiny, 3, 1, 3, 10)


@pytest.mark.parametrize("case,name", [(2, "gpipe"), (3, "1f1b")])
def test_pipeline_matches_one_process(four_ranks, case, name):
    per_rank = [r[case] for r in four_ranks]
    _check_pipeline(per_rank, FOUR_WAY, MICROBATCHES, 1, ROWS, SEQ)
    expected = [in_flight(a) for a in make_schedule(name, 4, MICROBATCHES)]
    assert [r["peak_in_flight"] for r in per_rank] == expected


def test_interleaved_pipeline_matches_one_process(four_ranks):
    per_rank = [r[4] for r in four_ranks]
    _check_pipeline(per_rank, dict(FOUR_WAY, num_layers=8), MICROBATCHES, 2, ROWS, SEQ)
    assert [r["peak_in_flight"] for r in per_rank] == [in_flight(a) for a in make_schedule("interleaved", 4,
                                                                                           MICROBATCHES, 2)]


@pytest.mark.parametrize("case,layout", [(5, "contiguous"), (6, "zigzag")])
def test_ring_attention_matches_full_attention(four_ranks, case, layout):
    rows, heads, kv_heads, seq, head_dim = 2, 4, 2, 24, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, seq, head_dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, seq, head_dim, generator=gen) for _ in range(2))
    full = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    per_rank = [r[case] for r in four_ranks]
    assert sorted(torch.cat([r["positions"] for r in per_rank]).tolist()) == list(range(seq))
    for r in per_rank:
        check.assert_close(r["out"], full[:, :, r["positions"]], name=f"rank's output ({layout})")
    shape = planner.ModelShape(1, 1, heads, kv_heads, head_dim, 1, 1)
    assert all(r["link_bytes"] == planner.ring_attention_forward_bytes(shape, rows * seq, 4, FP32) for r in per_rank)
    work = [r["score_elements"] for r in per_rank]
    assert sum(work) == seq * (seq + 1) // 2
    assert (len(set(work)) == 1) == (layout == "zigzag")  # zigzag balances the causal work


def test_data_parallel_traffic_matches_the_formula(four_ranks):
    for r in four_ranks:
        assert r[7]["link_bytes"] == pytest.approx(planner.data_parallel_bytes(r[7]["params"], 4, FP32))
        assert r[7]["params"] == planner.ModelShape.of(DecoderConfig(**FOUR_WAY)).params
