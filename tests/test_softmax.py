"""labkit.softmax: the three kernels, the launch plan, the public function, the torch
references, and the errors on bad input. Mirrors src/labkit/softmax/."""

import pytest
import torch
import triton
from labkit import backend, benchmarks, check, results
from labkit.softmax import kernels, plan_for, softmax
from labkit.softmax.bench import kernel_name, liger_softmax
from labkit.softmax.reference import (
    count_traffic,
    naive_softmax,
    online_softmax,
    online_softmax_steps,
    softmax_reference,
)

DEV = backend.device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Odd sizes, none a multiple of a block: a single column, a ragged tile, a wide row.
SHAPES = [(1, 1), (13, 3), (37, 100), (5, 1000)]


def _launch_poisoned(x, **plan_options):
    """Run one kernel into a NaN-filled buffer, so an element it never writes fails."""
    p = kernels.plan(*x.shape, x.element_size(), **plan_options)
    out = check.empty_poisoned(x.shape, x.dtype, DEV)
    return kernels.launch(p, x, out)


# --- kernels -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_each_kernel_matches_float64(variant, shape, dtype):
    x = check.randn(*shape, dtype=dtype, device=DEV, seed=sum(shape), scale=3.0)
    options = {"block_cols": 64} if variant == "online" else {}  # several blocks, a ragged tail
    out = _launch_poisoned(x, variant=variant, **options)
    check.assert_close(out, softmax_reference(x), dtype=dtype, name=f"{variant} {shape}")


@pytest.mark.parametrize("block_rows", [1, 4, 16])
def test_rows_kernel_with_a_last_tile_past_the_end(block_rows):
    x = check.randn(19, 50, device=DEV, seed=3)  # 19 rows: the last tile is partly empty
    out = _launch_poisoned(x, variant="rows", block_rows=block_rows)
    check.assert_close(out, softmax_reference(x), name=f"rows, {block_rows} a program")


def test_online_kernel_rescales_when_a_later_block_holds_the_max():
    x = check.randn(4, 300, device=DEV, seed=4)
    x[:, 290] = 40.0  # the max arrives in the last block: every earlier sum must be rescaled
    x[1, 0] = 45.0  # ...or in the first, where no rescale may happen afterwards
    out = _launch_poisoned(x, variant="online", block_cols=32)
    check.assert_close(out, softmax_reference(x), name="online, late max")


@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_kernels_are_stable_where_exp_overflows(variant):
    x = check.randn(3, 77, device=DEV, seed=5, scale=200.0)  # exp(200) overflows fp32
    out = _launch_poisoned(x, variant=variant, **({"block_cols": 16} if variant == "online" else {}))
    check.assert_close(out, softmax_reference(x), name=f"{variant}, large inputs")


@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_kernels_follow_the_row_stride(variant):
    base = check.randn(6, 64, device=DEV, seed=6)
    x = base[:, :45]  # rows 64 apart in memory, 45 wide
    out = _launch_poisoned(x, variant=variant, **({"block_cols": 16} if variant == "online" else {}))
    check.assert_close(out, softmax_reference(x), name=f"{variant}, strided rows")


# --- the launch plan ------------------------------------------------------------------

def test_num_warps_follow_the_tile_size():
    assert [kernels.num_warps_for(n) for n in (64, 2048, 4096, 8192, 16384, 65536)] == [4, 4, 8, 16, 16, 16]


def test_auto_picks_the_kernel_by_row_bytes():
    fp32_1k = kernels.plan(16384, 1000, 4)  # 4 KiB rows: one a program
    assert (fp32_1k.variant, fp32_1k.block_cols, fp32_1k.num_warps, fp32_1k.grid) == ("row", 1024, 4, 16384)
    bf16_1k = kernels.plan(16385, 1000, 2)  # 2 KiB rows: two a program, an odd row count
    assert (bf16_1k.variant, bf16_1k.block_rows, bf16_1k.block_cols, bf16_1k.grid) == ("rows", 2, 1024, 8193)
    narrow = kernels.plan(2**20, 100, 4)
    assert (narrow.variant, narrow.block_rows, narrow.num_warps) == ("rows", 8, 4)
    headline = kernels.plan(16384, 8192, 2)
    assert (headline.variant, headline.block_cols, headline.num_warps, headline.grid) == ("row", 8192, 16, 16384)
    widest_fused = kernels.plan(64, kernels.MAX_FUSED_COLS, 4)
    assert (widest_fused.variant, widest_fused.num_warps) == ("row", 16)
    wide = kernels.plan(64, kernels.MAX_FUSED_COLS + 1, 4)
    assert (wide.variant, wide.block_cols, wide.num_warps) == ("online", kernels.ONLINE_BLOCK_COLS, 16)
    assert kernels.plan(1, 100, 4).variant == "row"  # one row: nothing to tile together


def test_rows_plan_never_tiles_more_rows_than_there_are():
    p = kernels.plan(3, 16, 4, "rows")
    assert p.block_rows == 4 and p.grid == 1


# --- the public function --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_over_the_last_dim_of_any_shape(dtype):
    x = check.randn(3, 5, 41, dtype=dtype, device=DEV, seed=7)
    out = softmax(x)
    assert out.shape == x.shape and out.dtype == dtype
    check.assert_close(out, softmax_reference(x), dtype=dtype, name="3-D")
    check.assert_close(softmax(x[0, 0]), softmax_reference(x[0, 0]), dtype=dtype, name="1-D")


def test_softmax_accepts_strided_leading_dims():
    x = check.randn(4, 6, 30, device=DEV, seed=8).transpose(0, 1)  # last dim still unit-stride
    check.assert_close(softmax(x), softmax_reference(x), name="transposed leading dims")


@pytest.mark.parametrize("variant", ["auto", *kernels.VARIANTS])
def test_softmax_every_variant(variant):
    x = check.randn(9, 130, device=DEV, seed=9)
    check.assert_close(softmax(x, variant=variant), softmax_reference(x), name=variant)


def test_plan_for_reports_the_launch_softmax_uses():
    x = check.randn(10, 200, device=DEV)
    assert plan_for(x) == kernels.plan(10, 200, 4)
    assert plan_for(x, "online", block_cols=64, num_warps=2).num_warps == 2


@pytest.mark.parametrize(("arg", "kwargs", "error", "match"), [
    ("list", {}, TypeError, "must be a torch.Tensor"),
    ("int", {}, TypeError, "dtype"),
    ("float64", {}, TypeError, "dtype"),
    ("scalar", {}, ValueError, "at least one dimension"),
    ("empty", {}, ValueError, "must not be empty"),
    ("ok", {"variant": "fast"}, ValueError, "variant must be one of"),
    ("ok", {"variant": 1}, TypeError, "variant must be a string"),
    ("ok", {"num_warps": 3}, ValueError, "power of two"),
    ("ok", {"num_warps": 64}, ValueError, "at most 32"),
    ("ok", {"num_warps": 4.0}, TypeError, "must be an int"),
    ("ok", {"block_rows": 4}, ValueError, "variant 'rows' only"),
    ("ok", {"variant": "rows", "block_cols": 64}, ValueError, "variant 'online' only"),
    ("ok", {"variant": "online", "block_cols": 100}, ValueError, "power of two"),
    ("wide", {"variant": "row"}, ValueError, "use variant 'online'"),
    ("wide", {"variant": "rows"}, ValueError, "use variant 'online'"),
    ("column", {}, ValueError, "unit stride along its last dimension"),
    ("meta", {}, ValueError, "must be on"),
])
def test_softmax_rejects_bad_input(arg, kwargs, error, match):
    inputs = {
        "list": lambda: [[1.0, 2.0]],
        "int": lambda: torch.ones(2, 3, dtype=torch.int32, device=DEV),
        "float64": lambda: torch.ones(2, 3, dtype=torch.float64, device=DEV),
        "scalar": lambda: torch.tensor(1.0, device=DEV),
        "empty": lambda: torch.ones(2, 0, device=DEV),
        "ok": lambda: torch.ones(2, 3, device=DEV),
        "wide": lambda: torch.ones(1, kernels.MAX_FUSED_COLS + 1, device=DEV),
        "column": lambda: torch.ones(3, 4, device=DEV).t(),
        "meta": lambda: torch.ones(2, 3, device="meta"),
    }
    with pytest.raises(error, match=match):
        softmax(inputs[arg](), **kwargs)


# --- the torch references -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_naive_softmax_matches_float64(dtype):
    x = check.randn(7, 333, dtype=dtype, seed=10)
    check.assert_close(naive_softmax(x.float()).to(dtype), softmax_reference(x), dtype=dtype, name="naive")


def test_naive_softmax_makes_five_passes_over_eight_matrices():
    m, n = 6, 50
    ops = count_traffic(naive_softmax, torch.randn(m, n))
    assert [o.op for o in ops] == ["amax", "sub", "exp", "sum", "div"]
    assert sum(o.bytes_read for o in ops) == 4 * (5 * m * n + 2 * m)
    assert sum(o.bytes_written for o in ops) == 4 * (3 * m * n + 2 * m)


def test_torch_softmax_is_one_pass():
    ops = count_traffic(torch.softmax, torch.randn(6, 50), -1)
    assert len(ops) == 1 and ops[0].bytes_read == ops[0].bytes_written == 4 * 300


@pytest.mark.parametrize("block_cols", [1, 7, 64, 1000])
def test_online_softmax_is_exact_up_to_rounding(block_cols):
    x = check.randn(5, 301, dtype=torch.float64, seed=11, scale=4.0)
    check.assert_close(online_softmax(x, block_cols), softmax_reference(x), name=f"online, {block_cols}")


def test_online_steps_hold_the_invariant_at_every_block():
    x = check.randn(3, 100, dtype=torch.float64, seed=12)
    steps = list(online_softmax_steps(x, 16))
    assert [s.end_col for s in steps] == [16, 32, 48, 64, 80, 96, 100]
    for s in steps:  # after each block: the max and sum of exp(x - max) of the prefix
        prefix = x[:, :s.end_col]
        torch.testing.assert_close(s.running_max, prefix.amax(dim=1))
        torch.testing.assert_close(s.running_sum, torch.exp(prefix - s.running_max[:, None]).sum(dim=1))
    assert (steps[0].rescale == 0).all()  # the first block rescales the empty sum
    for prev, s in zip(steps, steps[1:]):
        held = s.running_max == prev.running_max
        assert (s.rescale[held] == 1).all() and (s.rescale[~held] < 1).all()


def test_references_reject_bad_input():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        softmax_reference([1.0])
    with pytest.raises(TypeError, match="dtype"):
        naive_softmax(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="2 dimensions"):
        online_softmax(torch.ones(5), 2)
    with pytest.raises(ValueError, match="must be positive"):
        online_softmax(torch.ones(2, 5), 0)
    with pytest.raises(TypeError, match="must be callable"):
        count_traffic("naive_softmax", torch.ones(2))


# --- benchmarks -----------------------------------------------------------------------

def test_benchmarks_are_registered_for_the_chapter():
    registry = benchmarks.discover()
    for name in ("softmax.headline", "softmax.sweep", "softmax.warps", "softmax.tiles", "softmax.torch_kernels"):
        assert registry[name].chapter == "triton-softmax"


@pytest.mark.skipif(backend.on_gpu(), reason="the CPU path of the benchmark")
def test_warp_and_tile_sweeps_record_each_launch_they_time():
    warps = benchmarks.run("softmax.warps", record=False)
    assert results.validate(warps.to_dict()) == []
    for r in warps.rows:  # one default launch per dtype and width, and the values a thread holds
        assert r["values_per_thread"] * 32 * r["num_warps"] == triton.next_power_of_2(r["n_cols"])
    assert sum(r["default"] for r in warps.rows) == 2 * len({r["n_cols"] for r in warps.rows})
    tiles = benchmarks.run("softmax.tiles", record=False)
    assert results.validate(tiles.to_dict()) == []
    for r in tiles.rows:
        itemsize = {"fp32": 4, "bf16": 2}[r["dtype"]]
        assert r["tile_bytes"] == r["block_rows"] * triton.next_power_of_2(r["n_cols"]) * itemsize
        assert r["programs"] == -(-r["n_rows"] // r["block_rows"])


@pytest.mark.skipif(backend.on_gpu(), reason="the CPU path of the benchmark")
def test_torch_kernels_profile_names_what_ran():
    rec = benchmarks.run("softmax.torch_kernels", record=False)
    assert results.validate(rec.to_dict()) == []
    assert all("softmax" in r["kernels"] for r in rec.rows)  # on the CPU, the aten op itself
    assert isinstance(rec.config["inductor_online_softmax"], bool)


def test_kernel_name_strips_namespaces_and_templates():
    key = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 7, false, false>(float*, int)"
    assert kernel_name(key) == "softmax_warp_forward"
    assert kernel_name("triton_per_fused__softmax_0") == "triton_per_fused__softmax_0"
    assert kernel_name("aten::_softmax") == "_softmax"


@pytest.mark.skipif(backend.on_gpu(), reason="the CPU path of the benchmark")
def test_headline_benchmark_runs_and_records_validly():
    rec = benchmarks.run("softmax.headline", record=False)
    assert results.validate(rec.to_dict()) == []
    assert [r["dtype"] for r in rec.rows] == ["fp32", "bf16"]
    assert all(r["ours"] > 0 and r["torch"] > 0 and r["liger"] is None for r in rec.rows)
    assert rec.goals == []  # goals are about GPU speed
    assert liger_softmax()[0] is None and "GPU" in liger_softmax()[1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2048, 8192), (4099, 1000), (33, 100_003), (70_001, 24)], ids=str)
def test_real_sizes_on_the_gpu(shape, dtype):
    x = check.randn(*shape, dtype=dtype, device=DEV, seed=13, scale=3.0)
    for variant in ("auto", "online"):
        out = softmax(x, variant=variant)
        check.assert_close(out, softmax_reference(x), dtype=dtype, name=f"{variant} {shape}")
