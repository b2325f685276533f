"""labkit.parallel: schedules and their simulator, the planner's formulas, and TP/SP/PP/CP on gloo ranks
checked against one process (losses, every gradient, ring attention against full attention) and
against the planner's traffic formulas."""

import dataclasses

import pytest
import torch

from labkit.collectives import launch
from labkit.models import QWEN3_SIZES, TINY, Decoder, DecoderConfig
from labkit.parallel import (Action, PipelineStage, TensorParallelDecoder, bubble_fraction_formula, check_schedule,
                             in_flight, make_schedule, one_f_one_b, ring_attention, sequence_slice, simulate,
                             token_positions)
from labkit.parallel import bench, planner, programs, verify

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
    assert best.tp * best.cp * best.pp * best.dp == 64 and best.tp <= 8
    assert result.candidates[0] == best and best.step_s == min(c.step_s for c in result.candidates if c.fits and c.cp == 1)
    across_nodes = [c for c in result.candidates if c.tp == 16]
    assert across_nodes and all(c.tp_link == "network" and c.tp_s > best.tp_s for c in across_nodes)
    assert all(not c.fits for c in result.candidates if c.tp == c.pp == 1)  # 1.1 TB of states on one GPU


def test_long_sequences_call_for_context_parallelism():
    shape = planner.ModelShape.of(QWEN3_SIZES["Qwen3-8B"])
    short, long = (planner.plan(shape, planner.hgx_h200(4), planner.Workload(seq=seq, micro_batch=1, global_batch=64))
                   for seq in (4096, 262144))
    assert short.best.cp == 1 and long.best is not None and long.best.cp > 1 and long.best.tp <= 8
    assert any("Context parallelism" in reason for reason in long.reasons)


def test_planner_input_errors():
    with pytest.raises(TypeError, match="shape must be a ModelShape"):
        planner.plan(TINY, planner.hgx_h200(1), planner.Workload(seq=128, micro_batch=1, global_batch=8))
    with pytest.raises(ValueError, match="nodes"):
        planner.hgx_h200(0)
    with pytest.raises(ValueError, match="mfu"):
        planner.Workload(seq=128, micro_batch=1, global_batch=8, mfu=1.5)
    with pytest.raises(ValueError, match="network_gbps"):
        planner.Cluster("x", 1, 8, 80.0, 450.0, 0.0, 989.0)


def test_planner_counts_the_stash_the_schedules_make():
    for p, m, v in ((4, 8, 1), (4, 2, 1), (4, 8, 2), (4, 4, 2), (8, 16, 4), (2, 6, 3)):
        name = "1f1b" if v == 1 else "interleaved"
        assert planner.stashed_microbatches(p, m, v) == in_flight(make_schedule(name, p, m, v)[0])


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
def strategies():
    """The chapter's benchmark: every strategy on 4 ranks, verified against one process (it raises if not)."""
    return bench.measure()


@pytest.fixture(scope="module")
def two_ranks_tiny():
    """The book's TINY model itself: its 2 K/V heads split over 2 ranks, its 2 layers into 2 stages."""
    tiny = dataclasses.asdict(TINY)
    calls = [("tensor_parallel_step", (tiny, 3, 10, True)), ("pipeline_step", (tiny, "1f1b", 3, 1, 3, 10))]
    return launch.run(programs.run_many, 2, args=(calls,), backend_name="gloo", timeout_s=300)


def test_every_strategy_matches_one_process(strategies):
    checks = strategies.config["checks"]
    assert set(checks) == {"TP", "TP + SP", "TP vs torch parallelize_module", "PP gpipe", "PP 1f1b", "PP interleaved",
                           "PP 1f1b vs torch Schedule1F1B", "CP contiguous", "CP zigzag"}
    assert checks["PP 1f1b vs torch Schedule1F1B"]["gradients_checked"] == checks["PP 1f1b"]["gradients_checked"] + 1
    assert all(goal.met for goal in strategies.goals), strategies.goals
    tensors = len(list(Decoder(DecoderConfig(**bench.MODEL)).parameters()))
    assert checks["TP"]["gradients_checked"] == checks["PP 1f1b"]["gradients_checked"] == tensors
    assert checks["PP interleaved"]["gradients_checked"] == len(
        list(Decoder(DecoderConfig(**bench.INTERLEAVED_MODEL)).parameters()))


def test_torch_leaves_the_head_norms_partial(strategies):
    """Against torch's parallelize_module: same sharded gradients; its q/k-norm gradients are per-rank partials."""
    versus = strategies.config["checks"]["TP vs torch parallelize_module"]
    assert versus["gradients_checked"] == 9 * bench.MODEL["num_layers"]  # 7 sharded weights and 2 head norms per block
    assert versus["norm_partial_rel_error"] > 0.1


def test_traffic_matches_the_formulas(strategies):
    assert len(strategies.rows) == 9
    for row in strategies.rows:
        assert row["measured_bytes"] > 0 and row["measured_bytes"] == pytest.approx(row["formula_bytes"]), row


def test_tensor_parallel_makes_four_collectives_per_block(strategies):
    layers = bench.MODEL["num_layers"]
    assert strategies.config["tp_calls"] == {"TP": {"all_reduce": 4 * layers},
                                             "TP + SP": {"all_gather": 4 * layers, "reduce_scatter": 4 * layers}}


def test_sequence_parallel_saves_fewer_activations(strategies):
    saved = strategies.config["saved_bytes"]
    assert saved["TP + SP"] < saved["TP"] < saved["one process"]


def test_pipeline_ranks_stash_what_the_schedule_says(strategies):
    for name, _, chunks in bench.PIPELINES:
        want = [in_flight(a) for a in make_schedule(name, bench.WORLD_SIZE, bench.MICROBATCHES, chunks)]
        assert strategies.config["checks"][f"PP {name}"]["stashed"] == want
        if name != "gpipe":  # the planner assumes 1F1B
            assert want[0] == planner.stashed_microbatches(bench.WORLD_SIZE, bench.MICROBATCHES, chunks)
        events = strategies.config["pipeline_events"][name]
        assert [len(rank) for rank in events] == [2 * bench.MICROBATCHES * chunks] * bench.WORLD_SIZE


def test_zigzag_balances_causal_ring_attention(strategies):
    contiguous = strategies.config["checks"]["CP contiguous"]["score_elements"]
    zigzag = strategies.config["checks"]["CP zigzag"]["score_elements"]
    assert len(set(zigzag)) == 1 and contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]


def test_tiny_model_on_two_ranks(two_ranks_tiny):
    tiny = dataclasses.asdict(TINY)
    tp, pp = ([r[i] for r in two_ranks_tiny] for i in range(2))
    assert verify.tensor_parallel(tp, tiny, 3, 10)["gradients_checked"] == len(list(Decoder(TINY).parameters()))
    assert verify.pipeline(pp, tiny, "1f1b", 3, 1, 3, 10)["stashed"] == [2, 1]
    shape = planner.ModelShape.of(TINY)
    assert tp[0]["activation_link_bytes"] == pytest.approx(planner.tensor_parallel_bytes(shape, 30, 2, FP32))


def test_verification_catches_a_wrong_gradient(two_ranks_tiny):
    tiny = dataclasses.asdict(TINY)
    tp = [dict(r[0], grads=dict(r[0]["grads"])) for r in two_ranks_tiny]
    dim, shard = tp[1]["grads"]["blocks.1.mlp.down.weight"]
    tp[1]["grads"]["blocks.1.mlp.down.weight"] = (dim, shard * 1.01)
    with pytest.raises(AssertionError, match="blocks.1.mlp.down.weight"):
        verify.tensor_parallel(tp, tiny, 3, 10)
    pp = [dict(r[1]) for r in two_ranks_tiny]
    pp[0] = dict(pp[0], peak_in_flight=3)  # as if rank 0 had run GPipe
    with pytest.raises(AssertionError, match="stashed"):
        verify.pipeline(pp, tiny, "1f1b", 3, 1, 3, 10)
