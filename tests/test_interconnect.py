"""labkit.interconnect: the link table, topology parsing, copy fits, the placement calculator, the benchmark."""

import math

import pytest

from labkit import benchmarks, interconnect as ic
from labkit.collectives import cost
from labkit.parallel import planner

# nvidia-smi topo -m as an 8-GPU HGX node with two NICs prints it (made up for the test,
# in the tool's layout: tab-separated cells, extra columns after the devices).
TOPO = (
    "\tGPU0\tGPU1\tGPU2\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tNV18\tPIX\tSYS\t0-47\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tNV18\tPXB\tSYS\t0-47\t0\t\tN/A\n"
    "GPU2\tNV18\tNV18\t X \tSYS\tPHB\t48-95\t1\t\tN/A\n"
    "NIC0\tPIX\tPXB\tSYS\t X \tSYS\n"
    "NIC1\tSYS\tSYS\tPHB\tSYS\t X \n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)

SHAPE = planner.ModelShape(4, 256, 8, 2, 32, 512, 1000, False)
WORK = planner.Workload(seq=256, micro_batch=2, global_batch=64)
FAST = ic.LinkModel("NVLink", 450.0, 2e-6, "test")
SLOW = ic.LinkModel("network", 50.0, 10e-6, "test")


# --- links ----------------------------------------------------------------------------------

def test_pcie_gbps_follows_rate_lanes_and_encoding():
    assert ic.pcie_gbps(5) == pytest.approx(32 * 16 * 128 / 130 / 8)
    assert ic.pcie_gbps(4, 8) == pytest.approx(ic.pcie_gbps(5, 16) / 4)
    assert ic.pcie_gbps(6) == pytest.approx(128.0)


def test_pcie_gbps_rejects_unknown_generations_and_lanes():
    with pytest.raises(ValueError, match="generation"):
        ic.pcie_gbps(7)
    with pytest.raises(ValueError, match="lanes"):
        ic.pcie_gbps(5, 12)


def test_per_direction_conversions():
    assert ic.per_direction_gbps(900, "GB/s both ways") == 450
    assert ic.per_direction_gbps(400, "Gb/s") == 50
    with pytest.raises(ValueError, match="unit"):
        ic.per_direction_gbps(400, "Mb/s")
    with pytest.raises(ValueError, match="positive"):
        ic.per_direction_gbps(0, "Gb/s")


def test_nvlink_to_infiniband_ratio_is_nine_to_eighteen():
    assert ic.bandwidth_ratio("NVLink 4", "InfiniBand NDR") == pytest.approx(9.0)
    assert ic.bandwidth_ratio("NVLink 5", "InfiniBand NDR") == pytest.approx(18.0)
    with pytest.raises(ValueError, match="scale-up"):
        ic.bandwidth_ratio("PCIe 5.0 x16", "InfiniBand NDR")
    with pytest.raises(ValueError, match="name"):
        ic.link("NVLink 9")


def test_every_link_cites_a_source():
    assert all(x.cite and x.gbps > 0 for x in ic.LINKS)


# --- topology -------------------------------------------------------------------------------

def test_parse_topo_matrix_reads_paths_and_extra_columns():
    m = ic.parse_topo_matrix(TOPO)
    assert m.devices == ("GPU0", "GPU1", "GPU2", "NIC0", "NIC1")
    assert m.path("GPU0", "GPU1") == "NV18" and m.nvlinks("GPU0", "GPU2") == 18
    assert m.path("GPU0", "NIC0") == "PIX" and m.nvlinks("GPU0", "NIC0") == 0
    assert m.extra["GPU2"]["CPU Affinity"] == "48-95"
    assert ic.topology.closeness("NV4") < ic.topology.closeness("PIX") < ic.topology.closeness("SYS")


def test_parse_topo_matrix_rejects_text_without_a_matrix():
    with pytest.raises(ValueError, match="header"):
        ic.parse_topo_matrix("no GPUs here")
    with pytest.raises(ValueError, match="not an nvidia-smi"):
        ic.parse_topo_matrix(TOPO.replace("PIX\tSYS\t0-47", "FOO\tSYS\t0-47"))
    with pytest.raises(TypeError):
        ic.parse_topo_matrix(None)


def test_nccl_paths_reads_the_topology_dump():
    lines = ["vm:1:1 [0] NCCL INFO GPU/0-60 :GPU/0-60 (0/5000.0/LOC) CPU/0-ff (1/48.0/PHB) NET/0-0 (3/1.2/PHB) ",
             "vm:1:1 [0] NCCL INFO  0 : GPU/0-60"]
    rows = ic.nccl_paths(lines)
    assert [(r["to"], r["hops"], r["nccl_gbps"], r["type"]) for r in rows] == [
        ("GPU/0-60", 0, 5000.0, "LOC"), ("CPU/0-ff", 1, 48.0, "PHB"), ("NET/0-0", 3, 1.2, "PHB")]


# --- fits -----------------------------------------------------------------------------------

def _rows(alpha_us, gbps, direction="h2d"):
    return [{"direction": direction, "bytes": 4 ** k, "pinned_us": alpha_us + 4 ** k / (gbps * 1e3)}
            for k in range(2, 13)]


def test_copy_fit_recovers_alpha_and_bandwidth():
    fit = ic.copy_fit(_rows(7.0, 55.0), "h2d")
    assert fit.fixed_s == pytest.approx(7e-6, rel=1e-6)
    assert fit.bandwidth_gbps == pytest.approx(55.0, rel=1e-6)
    assert ic.half_bandwidth_bytes(fit) == pytest.approx(7e-6 * 55e9, rel=1e-6)
    assert cost.steps_and_bytes("point_to_point", 2) == (1.0, 1.0)


def test_copy_fit_rejects_missing_rows_and_kinds():
    with pytest.raises(ValueError, match="two pinned rows"):
        ic.copy_fit(_rows(7.0, 55.0), "d2h")
    with pytest.raises(ValueError, match="kind"):
        ic.copy_fit(_rows(7.0, 55.0), "h2d", kind="mapped")
    with pytest.raises(TypeError, match="rows"):
        ic.copy_fit("h2d", "h2d")


def test_copy_step_finds_two_levels_and_the_line_above_them():
    """A level of 3.8 us up to 1 KiB, then a line of 7 us + bytes at 55 GB/s (the H200's
    pinned H2D shape): the step sits between 1 and 4 KiB, and the line from it is exact."""
    rows = [{**r, "pinned_us": 3.8} if r["bytes"] <= 1024 else r for r in _rows(7.0, 55.0)]
    step = ic.copy_step(rows, "h2d")
    assert (step.below_bytes, step.above_bytes) == (1024, 4096)
    assert step.below_us == 3.8 and step.ratio == pytest.approx((7.0 + 4096 / 55e3) / 3.8)
    above = ic.copy_fit(rows, "h2d", fit_from_bytes=step.above_bytes)
    assert above.fixed_s == pytest.approx(7e-6, rel=1e-6)
    assert above.max_rel_error([r["bytes"] for r in rows], step.above_bytes) == pytest.approx(0.0, abs=1e-9)
    # One line through both levels misses both: the reason the fit starts at the step.
    assert ic.copy_fit(rows, "h2d").max_rel_error([r["bytes"] for r in rows]) > 0.2


def test_copy_step_is_none_for_one_line_and_for_large_jumps():
    assert ic.copy_step(_rows(7.0, 55.0), "h2d") is None
    # A jump past STEP_SEARCH_BYTES is bytes, not a change of mechanism; one that leaves too
    # few points above it for a line is not taken either.
    late = [{**r, "pinned_us": r["pinned_us"] * (3 if r["bytes"] >= 65536 else 1)} for r in _rows(7.0, 55.0)]
    assert ic.copy_step(late, "h2d") is None
    short = [r for r in _rows(7.0, 55.0) if r["bytes"] <= 4096]
    short = [{**r, "pinned_us": 3.8} if r["bytes"] <= 1024 else r for r in short]
    assert ic.copy_step(short, "h2d") is None
    with pytest.raises(TypeError, match="rows"):
        ic.copy_step("h2d", "h2d")
    with pytest.raises(ValueError, match="kind"):
        ic.copy_step(_rows(7.0, 55.0), "h2d", kind="mapped")


# --- the calculator -------------------------------------------------------------------------

def test_strategy_traffic_matches_the_planner_formulas():
    tp = ic.strategy_traffic("TP", SHAPE, WORK, 4, 3)
    assert tp["bytes"] == pytest.approx(planner.tensor_parallel_bytes(SHAPE, 3 * 512, 4, 2))
    assert tp["latency_terms"] == 4 * SHAPE.layers * 3 * 6
    dp = ic.strategy_traffic("DP", SHAPE, WORK, 4, 3)
    assert dp["bytes"] == pytest.approx(planner.data_parallel_bytes(SHAPE.params, 4, 2))
    assert ic.strategy_traffic("PP", SHAPE, WORK, 1, 3)["bytes"] == 0.0


def test_strategy_costs_scale_with_the_bandwidth_ratio_when_bandwidth_bound():
    rows = ic.strategy_costs(SHAPE, WORK, 4, 3, fast=ic.LinkModel("NVLink", 450.0, 0.0, "t"),
                             slow=ic.LinkModel("network", 50.0, 0.0, "t"), tflops=100.0)
    assert [r["strategy"] for r in rows] == list(ic.STRATEGIES)
    for r in rows:
        assert r["slow/fast"] == pytest.approx(9.0)
        assert r["network/compute"] == pytest.approx(r["network_s"] / r["compute_s"])


def test_latency_shrinks_the_ratio_for_small_messages():
    rows = ic.strategy_costs(SHAPE, WORK, 4, 3, fast=FAST, slow=SLOW, tflops=100.0)
    tp = next(r for r in rows if r["strategy"] == "TP")
    assert 1.0 < tp["slow/fast"] < 9.0


def test_strategy_calculator_rejects_bad_input():
    with pytest.raises(ValueError, match="strategy"):
        ic.strategy_traffic("ZeRO", SHAPE, WORK, 4, 1)
    with pytest.raises(ValueError, match="layers"):
        ic.strategy_traffic("PP", SHAPE, WORK, 3, 1)
    with pytest.raises(ValueError, match="experts"):
        ic.strategy_traffic("EP", SHAPE, WORK, 3, 1, ic.MoeSpec(experts=64))
    with pytest.raises(ValueError, match="sequence"):
        ic.strategy_traffic("CP", SHAPE, planner.Workload(seq=100, micro_batch=1, global_batch=8), 4, 1)
    with pytest.raises(TypeError, match="ModelShape"):
        ic.strategy_traffic("TP", "8B", WORK, 4, 1)
    with pytest.raises(TypeError, match="LinkModel"):
        ic.strategy_costs(SHAPE, WORK, 4, 1, fast=450.0, slow=SLOW, tflops=100.0)
    with pytest.raises(ValueError, match="mfu"):
        ic.strategy_costs(SHAPE, WORK, 4, 1, fast=FAST, slow=SLOW, tflops=100.0, mfu=1.5)
    with pytest.raises(ValueError, match="gbps"):
        ic.LinkModel("x", 0.0, 0.0, "t")
    with pytest.raises(ValueError, match="top_k"):
        ic.MoeSpec(experts=4, top_k=8)


def test_best_plans_get_no_faster_as_the_network_slows():
    rows = ic.best_plans(SHAPE, WORK, nodes=2, gpus_per_node=4, memory_gb=80.0, nvlink_gbps=450.0,
                         network_gbps=[450.0, 50.0, 10.0], tflops=100.0)
    steps = [r["step_s"] for r in rows]
    assert [r["ratio"] for r in rows] == pytest.approx([1.0, 9.0, 45.0])
    assert steps == sorted(steps)


# --- the benchmark --------------------------------------------------------------------------

def test_host_link_benchmark_runs_on_the_cpu():
    rec = benchmarks.run("interconnect.host_link", record=False)
    assert {r["direction"] for r in rec.rows} == {"h2d", "d2h", "d2d"}
    fits = rec.config["fits"]
    assert all(math.isfinite(fits[d]["alpha_us"]) for d in ("h2d", "d2h", "d2d"))
    assert all(r["pinned_us"] > 0 for r in rec.rows)


def test_pcie_link_reads_the_driver_query(monkeypatch):
    from labkit.interconnect import bench as ic_bench

    monkeypatch.setattr(ic_bench, "_nvidia_smi", lambda *args: "5, 5, 16, 16\n")
    info = ic_bench.pcie_link()
    assert info["gen_max"] == 5 and info["width_current"] == 16
    assert info["gbps_max"] == pytest.approx(ic.pcie_gbps(5, 16))
    monkeypatch.setattr(ic_bench, "_nvidia_smi", lambda *args: None)
    assert ic_bench.pcie_link() == {}
    monkeypatch.setattr(ic_bench, "_nvidia_smi", lambda *args: "[N/A], [N/A], 16, 16\n")
    assert "gbps_max" not in ic_bench.pcie_link()


def test_figures_draw_every_frame():
    from labkit.interconnect import figures

    fig = figures.ladder([{"name": "a", "gbps": 10.0, "measured": True}, {"name": "b", "gbps": 100.0, "measured": False}])
    assert list(fig.data[0].y) == ["a", "b"]
    frames = {f"{g} GB/s": ic.strategy_costs(SHAPE, WORK, 4, 3, fast=FAST, slow=ic.LinkModel("network", g, 1e-5, "t"),
                                             tflops=100.0) for g in (12.5, 50.0)}
    fig = figures.strategy_frames(frames, "NVLink", "network")
    assert len(fig.data) == 4 and len(fig.layout.sliders[0].steps) == 2
    plans = ic.best_plans(SHAPE, WORK, nodes=2, gpus_per_node=4, memory_gb=80.0, nvlink_gbps=450.0,
                          network_gbps=[450.0, 50.0], tflops=100.0)
    fig = figures.plan_figure({"tiny": plans, "again": plans})
    assert len(fig.data) == 2 * len(figures.PARTS)
