"""labkit.collectives: schedules, cost models, the launcher, and the collectives on real
gloo processes (world sizes 1 to 4) against torch.distributed and a float64 sum."""

from __future__ import annotations

import math
import operator
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import labkit  # noqa: F401  (sets the mode before anything else)
from labkit.collectives import (
    SUPPORTED_DTYPES, bench, cost, figures, launch, programs, recursive_doubling_all_reduce, ring_all_gather,
    ring_all_reduce, ring_reduce_scatter, schedule, shard_numel,
)

NUMELS = [1, 7, 60, 4099]  # fewer elements than ranks, odd, divisible by 1..4 (torch's tensor forms), prime
DTYPE_NAMES = list(programs.DTYPES)
ROWS_PER_CASE = 4  # all-reduce twice (ring, recursive doubling), reduce-scatter, all-gather


# --- the schedules -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 64, 4099])
def test_chunk_bounds_cut_like_tensor_split(numel, n):
    bounds = schedule.chunk_bounds(numel, n)
    sizes = [stop - start for start, stop in bounds]
    assert sizes == [c.numel() for c in torch.arange(numel).tensor_split(n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_steps_pass_on_what_was_received(n):
    for r in range(n):
        for s in range(1, n - 1):
            # the chunk sent at step s is the one received (and reduced, or stored) at step s-1
            assert schedule.reduce_scatter_step(r, s, n)[0] == schedule.reduce_scatter_step(r, s - 1, n)[1]
            assert schedule.all_gather_step(r, s, n)[0] == schedule.all_gather_step(r, s - 1, n)[1]
        for s in range(n - 1):  # what rank r sends is what rank r+1 expects
            assert schedule.reduce_scatter_step(r, s, n)[0] == schedule.reduce_scatter_step((r + 1) % n, s, n)[1]
            assert schedule.all_gather_step(r, s, n)[0] == schedule.all_gather_step((r + 1) % n, s, n)[1]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_simulated_ring_all_reduce(n):
    states = schedule.simulate_ring_all_reduce(n)
    everyone = frozenset(range(n))
    assert len(states) == 1 + 2 * (n - 1)
    assert states[0] == [[frozenset({r})] * n for r in range(n)]
    after_reduce_scatter = states[n - 1]
    assert all(after_reduce_scatter[r][r] == everyone for r in range(n)), "rank r must own chunk r"
    assert all(chunk == everyone for row in states[-1] for chunk in row)
    transfers = schedule.ring_all_reduce_transfers(n)
    assert len(transfers) == 2 * (n - 1) and all(len(step) == n for step in transfers)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_recursive_doubling_partners_are_mutual(n):
    active = [r for r in range(n) if not schedule.doubling_role(r, n).folded]
    p = schedule.largest_power_of_two_at_most(n)
    assert len(active) == p
    for r in active:
        role = schedule.doubling_role(r, n)
        mask = 1
        while mask < p:
            partner = schedule.doubling_partner(role.virtual, mask, role.extra)
            assert partner in active and partner != r
            back = schedule.doubling_role(partner, n)
            assert schedule.doubling_partner(back.virtual, mask, back.extra) == r
            mask <<= 1


# --- cost models ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_bus_bandwidth_factors_follow_nccl_tests(n):
    assert cost.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert cost.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert cost.bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert cost.bus_factor("broadcast", n) == 1.0
    t, size = 1e-3, 2**20
    assert cost.busbw_gbps("all_reduce", size, t, n) == pytest.approx(cost.algbw_gbps(size, t) * 2 * (n - 1) / n)


def test_ring_all_reduce_is_reduce_scatter_plus_all_gather_in_the_model():
    for n in (2, 3, 8, 64):
        args = dict(alpha_s=3e-6, bandwidth_gbps=450.0)
        both = cost.predicted_seconds("ring_reduce_scatter", 2**26, n, **args) + \
            cost.predicted_seconds("ring_all_gather", 2**26, n, **args)
        assert cost.predicted_seconds("ring_all_reduce", 2**26, n, **args) == pytest.approx(both)


def test_recursive_doubling_beats_ring_only_for_small_messages():
    args = dict(n=16, alpha_s=5e-6, bandwidth_gbps=50.0)
    small, large = 2**10, 2**30
    assert cost.predicted_seconds("recursive_doubling_all_reduce", small, **args) < \
        cost.predicted_seconds("ring_all_reduce", small, **args)
    assert cost.predicted_seconds("recursive_doubling_all_reduce", large, **args) > \
        cost.predicted_seconds("ring_all_reduce", large, **args)


@pytest.mark.parametrize("n", [1, 4])
def test_fit_recovers_a_model_it_was_given(n):
    alpha, bandwidth = 7e-6, 123.0
    sizes = [2**k for k in range(10, 28, 2)]
    times = [cost.predicted_seconds("ring_all_reduce", s, max(n, 2), alpha_s=alpha, bandwidth_gbps=bandwidth)
             for s in sizes]
    fit = cost.fit_alpha_beta("ring_all_reduce", n, sizes, times)
    assert max(fit.rel_errors) < 1e-9
    if n == 1:  # no link to translate into: the line is all there is
        assert fit.alpha_s is None and fit.bandwidth_gbps is None
    else:
        assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert fit.bandwidth_gbps == pytest.approx(bandwidth, rel=1e-6)


def test_fit_never_reports_a_negative_latency():
    sizes = [2**k for k in range(10, 20)]
    times = [1e-9 * s * (1.0 + 0.3 * (-1) ** i) for i, s in enumerate(sizes)]  # noisy, through the origin
    fit = cost.fit_alpha_beta("ring_all_reduce", 4, sizes, times)
    assert fit.fixed_s >= 0 and fit.per_byte_s > 0


def test_cost_errors():
    with pytest.raises(ValueError, match="collective"):
        cost.bus_factor("allreduce", 4)
    with pytest.raises(ValueError, match="positive"):
        cost.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="algorithm"):
        cost.steps_and_bytes("butterfly", 4)
    with pytest.raises(ValueError, match="bandwidth_gbps > 0"):
        cost.predicted_seconds("ring_all_reduce", 1e6, 4, alpha_s=1e-6, bandwidth_gbps=0)
    with pytest.raises(ValueError, match="two"):
        cost.fit_alpha_beta("ring_all_reduce", 4, [1e6], [1e-3])
    with pytest.raises(ValueError, match="positive and finite"):
        cost.fit_alpha_beta("ring_all_reduce", 4, [1e6, 2e6], [1e-3, math.nan])


def test_fit_from_a_size_scores_every_point():
    """Cache-speed small sizes below 1 MB break the line there; fitted from 1 MB it holds above."""
    alpha, bandwidth = 50e-6, 2.0
    sizes = [2**k for k in range(14, 24)]
    times = [cost.predicted_seconds("ring_all_gather", s, 2, alpha_s=alpha, bandwidth_gbps=bandwidth * (3 if s < 2**20 else 1))
             for s in sizes]
    fit = cost.fit_alpha_beta("ring_all_gather", 2, sizes, times, fit_from_bytes=2**20)
    assert fit.fit_from_bytes == 2**20 and len(fit.rel_errors) == len(sizes)
    assert fit.alpha_s == pytest.approx(alpha) and fit.bandwidth_gbps == pytest.approx(bandwidth)
    assert fit.max_rel_error(sizes, 2**20) < 1e-9 < fit.max_rel_error(sizes)
    everywhere = cost.fit_alpha_beta("ring_all_gather", 2, sizes, times)
    assert everywhere.max_rel_error(sizes, 2**20) > 0.1, "one line through both regimes fits neither"
    with pytest.raises(ValueError, match="at least two .* at or above 8388608 bytes.*got 1"):
        cost.fit_alpha_beta("ring_all_gather", 2, sizes, times, fit_from_bytes=2**23)


def _model_rows(world_size: int, sizes: list[int]) -> list[dict]:
    rows = []
    for impl, bw in (("ours: ring", 50.0), ("torch.distributed", 100.0)):
        for s in sizes:
            t = cost.predicted_seconds("ring_all_reduce", s, max(world_size, 2), alpha_s=2e-6, bandwidth_gbps=bw)
            rows.append({"collective": "all_reduce", "impl": impl, "bytes": s, "world_size": world_size,
                         "time_ms": t * 1e3, "algbw_gbps": cost.algbw_gbps(s, t)})
    return rows


def test_benchmark_annotation_uses_its_own_fits():
    rows = _model_rows(4, [2**k for k in range(12, 24, 2)])
    fits = bench.fit_rows(rows)
    assert {f.fit_from_bytes for f in fits.values()} == {bench.FIT_ABOVE_BYTES}
    annotated = bench.annotate(rows, fits)
    assert all(r["model_rel_error"] < 1e-9 for r in annotated)
    ours = [r for r in annotated if r["impl"] == "ours: ring"]
    assert all(0 < r["ours/torch"] < 1 for r in ours) and "ours/torch" not in annotated[-1]
    assert "copy/limit" not in ours[0], "across ranks the limit is the link, which is not measured"
    one_rank = [{**r, "world_size": 1} for r in rows]
    copies = bench.annotate(one_rank, bench.fit_rows(one_rank), copy_tbps=1.0)
    assert all(r["copy/limit"] == pytest.approx(r["copy_tbps"]) for r in copies), "ours and torch's alike"
    short = [r for r in rows if r["bytes"] < 2**20]
    assert {f.fit_from_bytes for f in bench.fit_rows(short).values()} == {0}, "short of 1 MB: fit every size"


def test_goals_hold_the_fit_across_ranks_and_the_copy_ceiling_on_one():
    sizes = [2**k for k in range(14, 30, 3)]
    rows = _model_rows(4, sizes)
    rows[-1] = {**rows[-1], "time_ms": rows[-1]["time_ms"] * 3}  # torch's largest size, far off the line
    goals = bench.goals(bench.annotate(rows, bench.fit_rows(rows)))
    assert [g.name.split(": alpha")[0] for g in goals] == ["all_reduce ours: ring", "all_reduce torch.distributed"]
    assert all(g.op == "<=" and g.threshold == bench.FIT_GOAL for g in goals)
    assert goals[0].met and not goals[1].met and goals[1].value > bench.FIT_GOAL
    short = [r for r in rows if r["bytes"] < 2**20]
    assert bench.goals(bench.annotate(short, bench.fit_rows(short))) == [], "no size to judge the fit by"

    one_rank = [{**r, "world_size": 1} for r in _model_rows(1, sizes)]
    copy_tbps = max(2 * r["bytes"] / (r["time_ms"] / 1e3) / 1e12 for r in one_rank)
    limits = bench.goals(bench.annotate(one_rank, bench.fit_rows(one_rank), copy_tbps))
    assert len(limits) == 2 and all(g.op == ">=" and g.threshold == bench.LIMIT_GOAL for g in limits)
    worst = [min(2 * r["bytes"] / (r["time_ms"] / 1e3) / 1e12 / copy_tbps for r in one_rank
                 if r["impl"] == impl and r["bytes"] >= bench.LIMIT_FROM_BYTES)
             for impl in ("ours: ring", "torch.distributed")]
    assert [g.value for g in limits] == pytest.approx(worst)
    assert bench.goals(bench.annotate(one_rank, bench.fit_rows(one_rank))) == [], "one rank, no ceiling: no goal"


def test_sweep_sizes_reach_what_the_goals_judge():
    gloo, nccl = programs.default_sweep_sizes("gloo"), programs.default_sweep_sizes("nccl")
    assert sum(s >= bench.FIT_ABOVE_BYTES for s in gloo) >= 4 and min(gloo) < bench.FIT_ABOVE_BYTES
    assert max(nccl) >= bench.LIMIT_FROM_BYTES and min(nccl) <= 2**10
    assert programs.default_rounds("gloo") > 1 and programs.default_rounds("nccl") == 1


def test_a_round_keeps_the_clocks_robust_statistic():
    from labkit import timing

    wall = timing.Timing(median_ms=5.0, p20_ms=1.0, p80_ms=8.0, reps=3, method=timing.INTERPRETER_WALL_CLOCK)
    events = timing.Timing(median_ms=5.0, p20_ms=4.9, p80_ms=5.1, reps=100, method=timing.CUDA_EVENTS)
    assert programs._point_ms(wall) == 1.0, "scheduler stalls only add to a wall clock"
    assert programs._point_ms(events) == 5.0


# --- figures ----------------------------------------------------------------------------

def test_ring_frames_follow_the_schedule():
    n = 4
    frames = figures.ring_all_reduce_frames(n)
    assert len(frames) == 1 + 2 * (n - 1) and all(len(traces) == 3 for traces in frames.values())
    last = list(frames.values())[-1][0]
    assert set(last.text) == {"all"}, "after the last step every cell holds every rank's data"
    moves = [t for t in list(frames.values())[1][1].y if t is not None]
    assert moves == [v for r in range(n) for v in (r, (r + 1) % n)], "step 1: each rank sends to the next"


def test_measured_options_pad_every_collective_to_the_same_trace_count():
    rows = [{"collective": c, "impl": i, "bytes": s, "time_ms": 1.0, "model_ms": 1.0, "busbw_gbps": 1.0,
             "algbw_gbps": 2.0} for c, impls in programs.IMPLEMENTATIONS.items() for i in impls for s in (2**10, 2**20)]
    for y, per_impl in (("time", 2), ("busbw", 1), ("algbw", 1)):
        options = figures.measured_options(rows, y)
        assert set(options) == {"all-reduce", "reduce-scatter", "all-gather"}
        assert {len(t) for t in options.values()} == {3 * per_impl}
    with pytest.raises(ValueError, match="'time', 'busbw' or 'algbw'"):
        figures.measured_options(rows, "latency")


def test_cost_calculator_marks_the_fastest_algorithm():
    rows = figures.cost_table(1024, 50.0, 5.0, 2**10)  # tiny message, many GPUs: latency-bound
    best = min(rows, key=lambda r: r["time_us"])
    assert best["algorithm"] != "ring"
    assert f"<b>{best['algorithm']}</b>" in figures.cost_table_html(rows)
    frames = figures.cost_calculator_frames((2, 8, 16))
    assert len(frames) == 3
    names = {n: [t.name for t in traces] for n, traces in frames.items()}
    nvlink_points = {n: [len(t.x) for t in traces if "NVLink" in t.name] for n, traces in frames.items()}
    assert len(nvlink_points[8]) == 2 and all(nvlink_points[8]) and not any(nvlink_points[16]), \
        "NVLink curves stop at one 8-GPU node"
    assert len({len(traces) for traces in frames.values()}) == 1, "a slider needs the same traces in every frame"
    assert not any("tree" in x and "NVLink" in x for x in names[8]), "inside a node NCCL's tree is a chain"
    assert sum("InfiniBand" in x for x in names[16]) == 3


# --- the collectives on real processes -----------------------------------------------------

@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"world{n}")
def verified(request):
    """Every collective, dtype and awkward size, on n gloo processes: each rank's rows."""
    n = request.param
    return n, launch.run(programs.verify, n, args=(NUMELS, DTYPE_NAMES), backend_name="gloo", timeout_s=240)


def test_every_case_matches_torch_and_float64(verified):
    n, per_rank = verified
    assert len(per_rank) == n
    for rows in per_rank:
        assert len(rows) == len(NUMELS) * len(DTYPE_NAMES) * ROWS_PER_CASE
        assert {(r["collective"], r["algorithm"]) for r in rows} == {
            ("all_reduce", "ring"), ("all_reduce", "recursive doubling"),
            ("reduce_scatter", "ring"), ("all_gather", "ring")}
        assert all(r["world_size"] == n for r in rows)
        # the ranks checked these themselves; the rows say how close they came
        assert all(r["err_vs_torch"] <= r["tolerance"] and r["err_vs_float64"] <= r["tolerance"] for r in rows)


def test_results_are_bitwise_identical_across_ranks(verified):
    n, per_rank = verified
    for i, row in enumerate(per_rank[0]):
        if row["collective"] in ("all_reduce", "all_gather"):
            assert {rows[i]["digest"] for rows in per_rank} == {row["digest"]}, row


def test_integer_sums_and_gathers_are_exact(verified):
    _, per_rank = verified
    exact = [r for rows in per_rank for r in rows if r["dtype"] == "int64" or r["collective"] == "all_gather"]
    assert exact and all(r["tolerance"] == 0.0 and r["err_vs_torch"] == 0.0 for r in exact)


def test_reduce_scatter_leaves_each_rank_its_own_fully_reduced_shard():
    n, numel = 3, 10  # shards of 4, 3, 3 elements
    per_rank = launch.run(programs.reduce_scatter_bitmasks, n, args=(numel,), backend_name="gloo", timeout_s=120)
    final = schedule.simulate_ring_all_reduce(n)[n - 1]
    for r, values in enumerate(per_rank):
        assert len(values) == shard_numel(numel, n, r)
        assert set(values) == {sum(1 << q for q in final[r][r])} == {2**n - 1}


def test_sweep_on_one_rank_times_copies_only():
    rows = launch.run(programs.sweep, 1, args=([2**12, 2**14], 1, 2), backend_name="gloo", timeout_s=120)[0]
    assert {r["collective"] for r in rows} == {"reduce_scatter", "all_gather"}, "one rank's all-reduce does nothing"
    assert len(rows) == 2 * 2 * 2 and all(r["time_ms"] > 0 and r["busbw_gbps"] == 0.0 for r in rows)


def test_torchrun_command_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LABKIT_MODE": "cpu"}  # gloo, even on a GPU machine
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    done = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "-m", "labkit.collectives.cli", "--skip-check",
         "--max-bytes", "131072", "--reps", "2", "--rounds", "1"],
        capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ours: ring" in done.stdout and "fit all_reduce / torch.distributed" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: NCCL, one process per GPU")
def test_nccl_on_every_gpu():
    n = torch.cuda.device_count()
    per_rank = launch.run(programs.verify, n, args=([1, 7, 4099], ["float32", "bfloat16", "int64"]),
                          backend_name="nccl", timeout_s=300)
    assert len(per_rank) == n and all(len(rows) == 3 * 3 * ROWS_PER_CASE for rows in per_rank)
    for i, row in enumerate(per_rank[0]):
        if row["collective"] in ("all_reduce", "all_gather"):
            assert {rows[i]["digest"] for rows in per_rank} == {row["digest"]}, row


# --- clear errors --------------------------------------------------------------------------

def test_errors_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match="torch.Tensor"):
        ring_all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype"):
        ring_all_reduce(torch.zeros(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype"):
        recursive_doubling_all_reduce(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(torch.zeros(4, 4).t())
    with pytest.raises(RuntimeError, match="no process group"):
        ring_all_reduce(torch.zeros(4))
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.init_from_torchrun()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_errors_inside_a_group(one_rank_group):
    x = torch.randn(10)
    with pytest.raises(ValueError, match="output must hold rank 0's shard of the 10 elements of input.*got 9"):
        ring_reduce_scatter(torch.empty(9), x)
    with pytest.raises(ValueError, match="input must hold rank 0's shard of the 10 elements of output.*got 3"):
        ring_all_gather(torch.empty(10), torch.empty(3))
    with pytest.raises(TypeError, match="output has dtype float64 but input has float32"):
        ring_reduce_scatter(torch.empty(10, dtype=torch.float64), x)
    with pytest.raises(TypeError, match="ProcessGroup"):
        ring_all_reduce(x, group="world")
    buf = torch.randn(20)
    with pytest.raises(ValueError, match="overlaps input"):  # partial sums would clobber unsent data
        ring_reduce_scatter(buf[5:15], buf[:10])
    assert set(SUPPORTED_DTYPES) >= {torch.float32, torch.bfloat16, torch.int64}
    # one rank: every collective is a copy, and a good one
    assert torch.equal(ring_all_reduce(x.clone()), x)
    out = torch.empty(10)
    assert torch.equal(ring_all_gather(out, x), x) and torch.equal(ring_reduce_scatter(out, x), x)


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        launch.run(programs.verify, 0)
    with pytest.raises(TypeError, match="int"):
        launch.run(programs.verify, "4")
    with pytest.raises(ValueError, match="backend_name"):
        launch.run(programs.verify, 2, backend_name="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        launch.run(programs.verify, 2, timeout_s=0, backend_name="gloo")
    with pytest.raises(ValueError, match="module-level"):
        launch.run(lambda: 1, 2, backend_name="gloo")
    with pytest.raises(TypeError, match="tuple"):
        launch.run(programs.verify, 2, args=[1], backend_name="gloo")
    with pytest.raises(TypeError, match="picklable"):
        launch.run(programs.verify, 2, args=(lambda: 1,), backend_name="gloo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="one process per GPU"):
            launch.run(programs.verify, 1, backend_name="nccl")


def test_launcher_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="(?s)rank . of 2 failed.*ZeroDivisionError"):
        launch.run(operator.truediv, 2, args=(1, 0), backend_name="gloo", timeout_s=120)


def test_launcher_reports_a_rank_that_dies():
    with pytest.raises(RuntimeError, match="died with exit code 3"):
        launch.run(os._exit, 1, args=(3,), backend_name="gloo", timeout_s=120)


def test_launcher_bounds_a_hang():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        launch.run(time.sleep, 2, args=(600,), backend_name="gloo", timeout_s=3)
    assert time.monotonic() - start < 60, "the hung ranks must be terminated, not waited for"


def test_cpu_ranks_are_forked_from_one_server_that_imported_torch():
    """Off a GPU every rank is a fork of multiprocessing's fork server (torch imported once),
    the same for every call, and never of this process; on a GPU each rank is spawned."""
    if labkit.on_gpu():
        assert launch._context().get_start_method() == "spawn"
        return
    first, second = launch.run(os.getppid, 2), launch.run(os.getppid, 2)
    assert len(set(first + second)) == 1 and first[0] != os.getpid()
