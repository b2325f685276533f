"""labkit.memory: the kernels against their references, every input check, the work and
occupancy arithmetic, and the benchmarks at CPU sizes."""

import types

import labkit  # noqa: F401  (before triton)
import pytest
import torch
import triton.language as tl
from labkit import backend, benchmarks, check, memory, results
from labkit.memory import bench, kernels, reference
from labkit.memory.occupancy import occupancy
from labkit.memory.roofline import attainable_tflops, copy_work, matmul_work, softmax_work, vector_add_work

DEV = backend.device()
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
DTYPES = FLOATS + (torch.int32, torch.int8)
SIZES = (1, 1000, 4097)
LAUNCHES = ({}, {"block_size": 128, "num_warps": 2})  # default: one program; 128: many, with a tail


def _input(shape, dtype, seed):
    x = check.randn(*shape, dtype=torch.float32, device=DEV, seed=seed)
    return x.to(dtype) if dtype.is_floating_point else (x * 20).to(dtype)  # ints in about [-60, 60]


def _check(out, ref, dtype, name):
    # Integers must match exactly; floats to the book's tolerance for their dtype.
    tol = None if dtype.is_floating_point else 0.0
    check.assert_close(out, ref, dtype=dtype if dtype.is_floating_point else None, tol=tol, name=name)


@pytest.mark.parametrize("launch", LAUNCHES, ids=["default", "block128"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_matches_reference(dtype, n, launch):
    x = _input((n,), dtype, seed=n)
    out = memory.copy(x, out=check.empty_poisoned(x.shape, dtype, DEV), **launch)
    _check(out, reference.copy(x), dtype, "copy")
    _check(memory.copy(x, **launch), reference.copy(x), dtype, "copy (allocated)")


@pytest.mark.parametrize("launch", LAUNCHES, ids=["default", "block128"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_add_matches_reference(dtype, n, launch):
    x, y = _input((n,), dtype, seed=n), _input((n,), dtype, seed=n + 1)
    out = memory.vector_add(x, y, out=check.empty_poisoned(x.shape, dtype, DEV), **launch)
    ref = x.double() + y.double() if dtype.is_floating_point else reference.vector_add(x, y)
    _check(out, ref, dtype, "vector_add")


@pytest.mark.parametrize("stride", (1, 2, 3, 64))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int32), ids=str)
def test_strided_read_matches_reference(dtype, n, stride):
    x = _input((n,), dtype, seed=stride)
    ref = reference.strided_read(x, stride)
    out = memory.strided_read(x, stride, out=check.empty_poisoned(ref.shape, dtype, DEV), block_size=64)
    _check(out, ref, dtype, f"strided_read(stride={stride})")


@pytest.mark.parametrize("passes", (1, 3))
@pytest.mark.parametrize("n", SIZES + (300,))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_read_sum_reads_every_element_passes_times(dtype, n, passes):
    x = _input((n,), dtype, seed=n + passes)
    # Block 64 with 2 programs: several blocks per program (a grid-stride loop) and a tail.
    partials = memory.read_sum(x, passes=passes, out=check.empty_poisoned((2,), torch.float32, DEV), block_size=64)
    check.assert_close(partials, reference.read_sum(x, passes, 2, 64), dtype=torch.float32,
                       name=f"read_sum(passes={passes})")


def test_read_sum_allocates_no_more_programs_than_blocks():
    x = _input((300,), torch.float32, seed=5)
    assert memory.read_sum(x, block_size=256).numel() == 2  # 2 blocks, fewer than the resident programs
    many = memory.read_sum(_input((4096,), torch.float32, seed=6), block_size=64)
    assert many.numel() == memory.resident_programs(torch.float32, 64, memory.DEFAULT_NUM_WARPS)


def test_elementwise_ops_keep_the_shape_of_a_matrix():
    x, y = _input((33, 65), torch.float32, 1), _input((33, 65), torch.float32, 2)
    check.assert_close(memory.copy(x, block_size=256), x, name="copy 2-D")
    check.assert_close(memory.vector_add(x, y, block_size=256), x.double() + y.double(),
                       dtype=torch.float32, name="vector_add 2-D")


def test_a_kernel_that_skips_the_tail_is_caught():
    # The poison is what makes the tests above able to fail: a launch that covers only
    # whole blocks leaves the tail unwritten, and the check reports NaN.
    x = _input((1000,), torch.float32, 3)
    out = check.empty_poisoned(x.shape, torch.float32, DEV)
    kernels.copy_kernel[(1000 // 128,)](x, out, 1000, BLOCK_SIZE=128)
    with pytest.raises(check.CheckFailed, match="NaN"):
        check.assert_close(out, reference.copy(x), name="copy")


def test_compute_dtype_widens_only_16_bit_floats():
    assert kernels.compute_dtype(torch.bfloat16) == tl.float32
    assert kernels.compute_dtype(torch.float16) == tl.float32
    assert kernels.compute_dtype(torch.float32) is None and kernels.compute_dtype(torch.int8) is None


X = torch.ones(8, device=DEV)
BAD_CALLS = [
    ("copy of a list", lambda: memory.copy([1.0, 2.0]), TypeError, "must be a torch.Tensor"),
    ("copy of bool", lambda: memory.copy(X.bool()), TypeError, "dtype"),
    ("copy non-contiguous", lambda: memory.copy(torch.ones(4, 4, device=DEV).t()), ValueError, "contiguous"),
    ("copy empty", lambda: memory.copy(torch.ones(0, device=DEV)), ValueError, "empty"),
    ("copy on meta", lambda: memory.copy(torch.ones(8, device="meta")), ValueError, f"must be on {DEV.type}"),
    ("block not power of 2", lambda: memory.copy(X, block_size=100), ValueError, "power of two"),
    ("block zero", lambda: memory.copy(X, block_size=0), ValueError, "positive"),
    ("block float", lambda: memory.copy(X, block_size=128.0), TypeError, "must be an int"),
    ("block too big", lambda: memory.copy(X, block_size=2**17), ValueError, "at most"),
    ("warps 3", lambda: memory.copy(X, num_warps=3), ValueError, "num_warps must be one of"),
    ("warps str", lambda: memory.copy(X, num_warps="4"), TypeError, "num_warps must be an int"),
    ("out wrong shape", lambda: memory.copy(X, out=torch.empty(9, device=DEV)), ValueError, "shape"),
    ("out wrong dtype", lambda: memory.copy(X, out=torch.empty(8, device=DEV, dtype=torch.float16)), TypeError, "dtype"),
    ("out non-contiguous", lambda: memory.copy(X, out=torch.empty(16, device=DEV)[::2]), ValueError, "contiguous"),
    ("add shape", lambda: memory.vector_add(X, torch.ones(9, device=DEV)), ValueError, "shape"),
    ("add dtype", lambda: memory.vector_add(X, X.half()), TypeError, "dtype of x"),
    ("add y not tensor", lambda: memory.vector_add(X, 1.0), TypeError, "y must be a torch.Tensor"),
    ("add bad block", lambda: memory.vector_add(X, X, block_size=3), ValueError, "power of two"),
    ("read ints", lambda: memory.read_sum(X.int()), TypeError, "dtype"),
    ("read passes zero", lambda: memory.read_sum(X, passes=0), ValueError, "positive"),
    ("read out fp16", lambda: memory.read_sum(X, out=torch.empty(2, device=DEV).half()), TypeError, "out must have dtype"),
    ("read out 2-D", lambda: memory.read_sum(X, out=torch.empty(2, 2, device=DEV)), ValueError, "1 dimensions"),
    ("read bad block", lambda: memory.read_sum(X, block_size=6), ValueError, "power of two"),
    ("cycle ragged", lambda: memory.random_cycle(1000, node_bytes=128), ValueError, "multiple of node_bytes"),
    ("cycle tiny node", lambda: memory.random_cycle(64, node_bytes=4), ValueError, "at least 8"),
    ("chase int32 table", lambda: memory.pointer_chase(X.int(), torch.zeros(1, dtype=torch.int64, device=DEV), 1),
     TypeError, "table must have dtype"),
    ("chase two states", lambda: memory.pointer_chase(torch.zeros(8, dtype=torch.int64, device=DEV),
                                                      torch.zeros(2, dtype=torch.int64, device=DEV), 1),
     ValueError, "exactly one index"),
    ("chase zero hops", lambda: memory.pointer_chase(torch.zeros(8, dtype=torch.int64, device=DEV),
                                                     torch.zeros(1, dtype=torch.int64, device=DEV), 0),
     ValueError, "positive"),
    ("strided 2-D", lambda: memory.strided_read(torch.ones(4, 4, device=DEV), 2), ValueError, "1 dimensions"),
    ("stride zero", lambda: memory.strided_read(X, 0), ValueError, "positive"),
    ("stride float", lambda: memory.strided_read(X, 1.5), TypeError, "stride must be an int"),
    ("strided out shape", lambda: memory.strided_read(X, 3, out=torch.empty(4, device=DEV)), ValueError, r"shape \(3,\)"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_work_counts():
    add = vector_add_work(1000, 4)
    assert (add.flops, add.bytes) == (1000, 12000) and add.intensity == pytest.approx(1 / 12)
    assert copy_work(10, 2).bytes == 40 and copy_work(10, 2).intensity == 0
    assert softmax_work(4, 8, 4).intensity == pytest.approx(5 / 8)
    gemv = matmul_work(1, 64, 32, 2)  # x[1, 32] @ W[32, 64]
    assert (gemv.flops, gemv.bytes) == (2 * 64 * 32, 2 * (32 + 32 * 64 + 64))
    square = matmul_work(300, 300, 300, 2)
    assert square.intensity == pytest.approx(300 / 3)  # 2n^3 FLOPs over 3 n^2 two-byte values
    with pytest.raises(ValueError, match="positive"):
        matmul_work(0, 1, 1, 2)
    with pytest.raises(TypeError, match="itemsize"):
        vector_add_work(4, 2.0)


def test_attainable_tflops_is_the_lower_ceiling():
    assert attainable_tflops(1.0, peak_tflops=700.0, peak_tbps=4.0) == 4.0
    assert attainable_tflops(1000.0, peak_tflops=700.0, peak_tbps=4.0) == 700.0
    with pytest.raises(ValueError, match="non-negative"):
        attainable_tflops(-1.0, peak_tflops=700.0, peak_tbps=4.0)
    with pytest.raises(ValueError, match="positive"):
        attainable_tflops(1.0, peak_tflops=0.0, peak_tbps=4.0)


def test_occupancy_by_each_limit():
    light = occupancy(16, 4)  # 16 blocks of 4 warps fill all 64 warp slots
    assert (light.blocks_per_sm, light.warps_per_sm, light.limited_by) == (16, 64, "warp slots")
    tiny = occupancy(16, 1)  # 1-warp blocks hit the 32-block cap at half the warps
    assert (tiny.warps_per_sm, tiny.limited_by, tiny.fraction) == (32, "block slots", 0.5)
    heavy = occupancy(255, 4)  # 255 regs -> 8192 per warp -> 8 warps' worth of the file
    assert (heavy.blocks_per_sm, heavy.warps_per_sm, heavy.limited_by) == (2, 8, "registers")
    shared = occupancy(16, 4, shared_bytes=64 * 1024)  # 228 KB of shared memory holds 3 such blocks
    assert (shared.blocks_per_sm, shared.limited_by) == (3, "shared memory")
    with pytest.raises(ValueError, match="shared_bytes"):
        occupancy(16, 4, shared_bytes=-1)
    with pytest.raises(ValueError, match="at most 32 warps"):
        occupancy(32, 64)
    with pytest.raises(ValueError, match="positive"):
        occupancy(0, 4)


def test_strided_traffic_model():
    assert bench.strided_traffic_model(100, 1, 4) == 800  # contiguous: read and write once
    assert bench.strided_traffic_model(100, 2, 4) == 400 + 800  # half of every sector wasted
    assert bench.strided_traffic_model(100, 8, 4) == bench.strided_traffic_model(100, 64, 4) == 400 + 3200


def test_size_label():
    assert [bench.size_label(b) for b in (100, 4096, 3 * 2**20, 2**30)] == ["100 B", "4 KiB", "3 MiB", "1 GiB"]


MEMORY_BENCHMARKS = ["memory.size_sweep", "memory.latency", "memory.access_patterns", "memory.block_size",
                     "memory.roofline"]
# On a GPU the benchmarks run at full size (about a minute each); there they are exercised
# by `python -m labkit.bench memory-hierarchy`, whose records are validated when saved.
cpu_sizes_only = pytest.mark.skipif(backend.on_gpu(), reason="GPU sizes: run python -m labkit.bench memory-hierarchy")


@cpu_sizes_only
@pytest.mark.parametrize("name", MEMORY_BENCHMARKS)
def test_benchmark_runs_and_makes_a_valid_record(name):
    rec = benchmarks.run(name, record=False)
    d = rec.to_dict()
    assert results.validate(d) == []
    assert d["chapter"] == "memory-hierarchy" and d["rows"]
    # The latency ladder is bounded by no bandwidth; every other benchmark carries all three ceilings.
    assert set(d["limits"]) == (set() if name == "memory.latency" else {"copy_tbps", "read_tbps", "matmul_bf16_tflops"})
    rate = {"memory.roofline": "tflops", "memory.access_patterns": "useful_tbps",
            "memory.latency": "ns_per_hop"}.get(name, "ours_tbps")
    assert all(r[rate] > 0 for r in d["rows"]), f"{name}: every row has a positive {rate}"


@cpu_sizes_only
def test_size_sweep_compares_each_op_with_torch_and_sets_the_goals():
    rec = benchmarks.run("memory.size_sweep", record=False)
    assert {r["op"] for r in rec.rows} == {"read", "copy", "vector add"}
    for r in rec.rows:
        limit = rec.limits["read_tbps" if r["op"] == "read" else "copy_tbps"]
        assert r["ours/torch"] == pytest.approx(r["ours_tbps"] / r["torch_tbps"])
        assert r["ours/limit"] == pytest.approx(r["ours_tbps"] / limit)
        assert r["footprint_bytes"] == {"read": 1, "copy": 2, "vector add": 3}[r["op"]] * r["buffer_bytes"]
        assert r["passes"] == (bench.read_passes(r["buffer_bytes"]) if r["op"] == "read" else 1)
    assert [g.threshold for g in rec.goals] == [0.9, 0.9, 0.9]  # the L2 goal is a GPU's only
    assert [g.name.split(" at")[0] for g in rec.goals] == ["read", "copy", "vector add"]


def test_read_passes_fill_the_target_and_stop_at_the_cap():
    target = bench.read_passes(1)  # capped
    assert target == bench.MAX_READ_PASSES
    assert bench.read_passes(2**40) == 1  # a buffer beyond the target is read once
    big = 2**12 * bench.MAX_READ_PASSES
    assert bench.read_passes(big) * big <= max(big, backend.pick(cpu=2**16, gpu=bench.READ_TARGET_BYTES))


@cpu_sizes_only
def test_latency_ladder_times_every_working_set():
    rec = benchmarks.run("memory.latency", record=False)
    assert [r["working_set_bytes"] for r in rec.rows] == [2**12, 2**14]
    assert all(r["nodes"] * bench.LATENCY_NODE_BYTES == r["working_set_bytes"] for r in rec.rows)


def test_random_cycle_is_one_cycle_through_every_node():
    table = memory.random_cycle(64 * 128, node_bytes=128, seed=3)
    assert table.dtype == torch.int64 and table.numel() == 64 * 16
    index, visited = 0, set()
    for _ in range(64):
        visited.add(index)
        index = int(table[index])
    assert index == 0 and visited == {16 * i for i in range(64)}  # back at the start after all 64 nodes


def test_pointer_chase_matches_reference_and_continues_from_its_state():
    table = memory.random_cycle(40 * 64, node_bytes=64, seed=4)
    state = torch.zeros(1, dtype=torch.int64, device=DEV)
    memory.pointer_chase(table, state, 13)
    assert int(state) == reference.pointer_chase(table.cpu(), 0, 13)
    memory.pointer_chase(table, state, 30)  # on from where the first call stopped
    assert int(state) == reference.pointer_chase(table.cpu(), 0, 43)


def test_roof_peaks_take_the_best_of_ceiling_and_rows():
    limits = {"matmul_bf16_tflops": 700.0, "copy_tbps": 4.0}
    assert bench.roof_peaks([{"tflops": 800.0, "tbps": 1.0}, {"tflops": 1.0, "tbps": 4.2}], limits) == (800.0, 4.2)
    assert bench.roof_peaks([{"tflops": 600.0, "tbps": 3.0}], limits) == (700.0, 4.0)


@cpu_sizes_only
def test_block_size_rows_carry_occupancy_when_the_kernel_reports_registers(monkeypatch):
    # Under the interpreter a launch returns no compiled kernel; on a GPU it returns one
    # with a register count. Stand in for that kernel to check the wiring of the GPU path.
    real_launch = bench.launch_copy

    def launch_reporting_registers(*args):
        real_launch(*args)
        return types.SimpleNamespace(n_regs=40, n_spills=0)

    monkeypatch.setattr(bench, "launch_copy", launch_reporting_registers)
    rows = bench.block_size().rows
    for r in rows:
        expected = occupancy(40, r["num_warps"])
        assert r["registers_per_thread"] == 40 and r["spilled_registers"] == 0
        assert (r["resident_warps_per_sm"], r["occupancy_limited_by"]) == (expected.warps_per_sm, expected.limited_by)
