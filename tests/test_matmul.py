"""labkit.matmul: the kernels on odd shapes and three dtypes, grouped tile order, split-K,
the FP8 kernel, the references and tile arithmetic, CuTe's layout algebra, the compiled
code for sm_90, and the errors on bad input. Mirrors src/labkit/matmul/."""

import pytest
import torch
from labkit import backend, check
from labkit import matmul as mm
from labkit.matmul import cute_layout as cute
from labkit.matmul import kernels

DEV = backend.device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, N, K), none a multiple of a tile: one row, a ragged everything, a K of several steps.
ODD_SHAPES = [(1, 40, 24), (37, 48, 72), (19, 70, 100)]
# The persistent kernel needs rows of whole 16-byte lines: N and K multiples of 8 (fp16/bf16), of 4 (fp32).
TMA_SHAPES = [(1, 40, 24), (37, 48, 72), (50, 72, 40)]
SMALL = mm.config(16, 32, 32, 4, 1, group_m=2)


def _operands(m, n, k, dtype, seed=0):
    a = check.randn(m, k, dtype=dtype, device=DEV, seed=seed)
    b = check.randn(k, n, dtype=dtype, device=DEV, seed=seed + 1)
    return a, b


def _poisoned(m, n, dtype):
    return check.empty_poisoned((m, n), dtype, DEV)


# --- kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_naive_and_tiled_kernels_match_float64(shape, dtype):
    m, n, k = shape
    a, b = _operands(m, n, k, dtype, seed=sum(shape))
    ref = mm.matmul_reference(a, b)
    check.assert_close(kernels.naive_launch(a, b, _poisoned(m, n, dtype), block_n=32, block_k=32), ref,
                       dtype=dtype, name=f"naive {shape}")
    check.assert_close(kernels.tiled_launch(a, b, _poisoned(m, n, dtype), cfg=SMALL), ref, dtype=dtype,
                       name=f"tiled {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=str)
def test_persistent_tma_kernel_matches_float64(shape, dtype):
    m, n, k = shape
    a, b = _operands(m, n, k, dtype, seed=sum(shape))
    out = kernels.persistent_launch(a, b, _poisoned(m, n, dtype), cfg=SMALL)
    check.assert_close(out, mm.matmul_reference(a, b), dtype=dtype, name=f"persistent {shape}")


@pytest.mark.parametrize("split_k", [1, 2, 3, 5])
def test_split_k_adds_every_split_once(split_k):
    # K = 100 in steps of 32 is four steps: five splits leave one split with no work at all.
    a, b = _operands(9, 40, 100, torch.float32, seed=split_k)
    cfg = mm.config(16, 32, 32, 4, 1, group_m=1, split_k=split_k)
    for dtype in (torch.float32, torch.bfloat16):
        out = kernels.split_k_launch(a.to(dtype), b.to(dtype), _poisoned(9, 40, dtype), cfg=cfg)
        check.assert_close(out, mm.matmul_reference(a.to(dtype), b.to(dtype)), dtype=dtype, name=f"split {split_k}")
    # the tickets are back at zero, so a second launch reduces again (and gives the same bits)
    again = kernels.split_k_launch(a.to(dtype), b.to(dtype), _poisoned(9, 40, dtype), cfg=cfg)
    assert torch.equal(again, out)


def test_split_k_takes_one_row():
    """A decode step's single token: Triton passes M == 1 as a Python int (it specializes
    ones), which once broke the split kernel's compile for sm_90."""
    a, b = _operands(1, 40, 100, torch.float32, seed=0)
    for dtype in (torch.float32, torch.bfloat16):
        out = kernels.split_k_launch(a.to(dtype), b.to(dtype), _poisoned(1, 40, dtype),
                                     cfg=mm.config(16, 32, 32, 4, 1, group_m=1, split_k=3))
        check.assert_close(out, mm.matmul_reference(a.to(dtype), b.to(dtype)), dtype=dtype, name="split_k, M = 1")


@pytest.mark.parametrize("cfg", kernels.SPLIT_K_CONFIGS, ids=mm.config_name)
def test_each_split_k_candidate_matches_float64(cfg):
    """Every tile and split the autotuner may choose, forced, at a decode step's few rows against
    a transposed weight (how the models' split-K linears call it) and at a ragged shape: the
    autotuner returns only its winner's output, so a wrong but slower candidate would go unseen."""
    for m, n, k in ((40, 200, 700), (3, 72, 130)):
        w = check.randn(n, k, dtype=torch.bfloat16, device=DEV, seed=m)
        x = check.randn(m, k, dtype=torch.bfloat16, device=DEV, seed=n)
        out = kernels.split_k_launch(x, w.t(), _poisoned(m, n, torch.bfloat16), cfg=cfg)
        check.assert_close(out, mm.matmul_reference(x, w.t()), dtype=torch.bfloat16, name=f"{m}x{n}x{k}")


def test_split_k_candidates_fit_the_launch():
    """The autotuner times 128-row tiles only past 64 rows, and never more splits than K has steps."""
    def names(m, k):
        args = {"M": m, "K": k, "a_ptr": torch.empty(0, dtype=torch.bfloat16)}
        kept = kernels._prune_split_k(kernels.SPLIT_K_CONFIGS, args)
        return {(c.kwargs["BLOCK_M"], c.kwargs["SPLIT_K"]) for c in kept}

    assert names(64, 4096) == {(64, s) for s in (1, 2, 4, 8)}
    assert names(65, 4096) == {(bm, s) for bm in (64, 128) for s in (1, 2, 4, 8)}
    assert names(1, 3 * 64) == {(64, 1), (64, 2)}  # three K steps of 64


def test_split_k_refuses_too_many_splits():
    a, b = _operands(9, 40, 100, torch.float32)
    with pytest.raises(ValueError, match="at most 8"):
        kernels.split_k_launch(a, b, _poisoned(9, 40, torch.float32), cfg=mm.config(16, 32, 32, 4, 1, split_k=9))


def test_tiled_kernel_reads_strided_operands():
    a_big, b_big = _operands(40, 60, 50, torch.float32, seed=7)
    a = a_big[::2, 1:]  # rows 100 apart, starting one element in
    b = b_big[1:, ::2]  # columns 2 apart
    out = mm.matmul(a, b, kernel="tiled")
    check.assert_close(out, mm.matmul_reference(a, b), dtype=torch.float32, name="strided")


@pytest.mark.parametrize("kernel", mm.KERNELS)
def test_public_matmul_runs_each_kernel(kernel):
    a, b = _operands(21, 32, 48, torch.bfloat16, seed=3)
    out = mm.matmul(a, b, kernel=kernel)
    assert out.dtype == torch.bfloat16 and out.shape == (21, 32)
    check.assert_close(out, mm.matmul_reference(a, b), dtype=torch.bfloat16, name=kernel)


def test_choose_kernel_by_shape_and_alignment():
    a, b = _operands(64, 64, 64, torch.bfloat16)
    assert mm.choose_kernel(a, b) == "persistent"
    a_odd, b_odd = _operands(64, 63, 61, torch.bfloat16)
    assert mm.choose_kernel(a_odd, b_odd) == "tiled"  # 61 * 2 bytes: rows TMA cannot copy
    assert mm.choose_kernel(*_operands(8, 16, 2048, torch.bfloat16)) == "split_k"  # skinny M, long K
    assert mm.choose_kernel(*_operands(300, 16, 2048, torch.bfloat16)) == "persistent"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 32, 48), (37, 48, 80), (20, 64, 128)], ids=str)
def test_fp8_rowwise_kernel_matches_float64(shape, out_dtype):
    m, n, k = shape
    # rows of very different magnitudes: per-row scales must keep them all
    x = check.randn(m, k, device=DEV, seed=m) * torch.logspace(-3, 3, m, device=DEV)[:, None]
    w = check.randn(n, k, device=DEV, seed=n)
    a8, sa = mm.quantize_rowwise(x)
    w8, sw = mm.quantize_rowwise(w)
    assert sa.shape == (m,) and sw.shape == (n,)
    out = kernels.fp8_launch(a8, w8, sa, sw, _poisoned(m, n, out_dtype), cfg=SMALL)
    check.assert_close(out, mm.fp8_matmul_reference(a8, sa, w8, sw), dtype=out_dtype, name=f"fp8 {shape}")
    # and the quantization itself is close to the input, row by row (E4M3: 3 mantissa bits)
    error = check.rel_error(a8.float() * sa[:, None], x)
    assert error < 2**-4, f"E4M3 keeps 3 mantissa bits; per-row round trip error {error}"


# --- tile order and arithmetic -----------------------------------------------------------

@pytest.mark.parametrize("tiles_m, tiles_n, group_m", [(5, 3, 2), (4, 4, 1), (7, 2, 8), (1, 6, 4)])
def test_tile_order_visits_every_tile_once_and_stays_in_its_band(tiles_m, tiles_n, group_m):
    order = mm.tile_order(tiles_m, tiles_n, group_m).tolist()
    assert sorted(map(tuple, order)) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]
    for pid, (i, _) in enumerate(order):
        assert i // group_m == pid // (group_m * tiles_n)  # band after band
    if group_m == 1:
        assert order == [[i, j] for i in range(tiles_m) for j in range(tiles_n)]


def test_tiled_torch_loop_matches_float64():
    a, b = _operands(30, 21, 50, torch.float32, seed=9)
    check.assert_close(mm.tiled_matmul(a, b, 8, 16, 12), mm.matmul_reference(a, b), dtype=torch.float32,
                       name="torch tiles")


def test_tile_arithmetic():
    assert mm.tile_intensity(128, 128, 2) == pytest.approx(64.0)  # 2*128*128 / (256 * 2)
    assert mm.tile_intensity(128, 256, 2) > mm.tile_intensity(128, 128, 2)
    # one tile covering everything reads A and B exactly once
    assert mm.tiled_traffic_bytes(64, 64, 32, 64, 64, 2) == mm.minimum_traffic_bytes(64, 64, 32, 2)
    assert mm.tiled_traffic_bytes(64, 64, 32, 16, 16, 2) == 2 * (64 * 32 * 4 + 32 * 64 * 4 + 64 * 64)


def test_shared_memory_of_a_config():
    cfg = mm.config(128, 256, 64, 8, 3)
    assert kernels.shared_memory_bytes(cfg, 2) == 3 * 2 * 64 * (128 + 256)
    assert kernels.shared_memory_bytes(cfg, 2, 2) == 3 * 2 * 64 * 384 + 2 * 128 * 256
    assert all(kernels.shared_memory_bytes(c, 2, 2) <= kernels.HOPPER_SHARED_MEMORY
               for c in kernels.PERSISTENT_CONFIGS)


# --- what the compiler emits for sm_90 ---------------------------------------------------

def test_hopper_kernels_use_wgmma_and_tma():
    persistent = mm.instruction_counts(mm.compile_sm90("persistent", mm.config(128, 128, 64, 8, 3)))
    assert persistent["ptx wgmma.mma_async"] > 0 and persistent["sass HGMMA"] > 0
    assert persistent["ptx cp.async.bulk.tensor"] > 0 and persistent["sass UTMALDG"] > 0 and persistent["sass UTMASTG"] > 0
    assert persistent["ptx mma.sync"] == 0 and persistent["sass HMMA"] == 0
    fp8_ptx = mm.compile_sm90("fp8", mm.config(128, 128, 128, 8, 3)).asm["ptx"]
    assert "e4m3" in fp8_ptx and "wgmma.mma_async" in fp8_ptx


def test_two_warps_fall_back_to_warp_mma():
    # wgmma needs a warpgroup of four warps; two warps get Ampere's mma.sync fed by cp.async
    counts = mm.instruction_counts(mm.compile_sm90("tiled", mm.config(64, 64, 32, 2, 3)))
    assert counts["ptx mma.sync"] > 0 and counts["sass HMMA"] > 0 and counts["ptx wgmma.mma_async"] == 0
    assert counts["ptx cp.async.cg"] > 0 and counts["sass LDGSTS"] > 0


# --- CuTe's layout algebra ---------------------------------------------------------------

def test_layout_maps_coordinates_by_strides():
    row_major = cute.Layout((4, 8), (8, 1))
    assert [row_major(i) for i in range(4)] == [0, 8, 16, 24]  # colexicographic: i runs down the first mode
    assert row_major((2, 3)) == 19 and row_major.size == 32 and row_major.cosize == 32
    nested = cute.Layout(((2, 2), 4), ((1, 8), 2))
    assert [nested(i) for i in range(5)] == [0, 1, 8, 9, 2]


def test_coalesce_and_composition():
    assert cute.coalesce(cute.Layout((2, 4), (1, 2))) == cute.Layout(8, 1)
    a = cute.Layout((6, 2), (8, 2))
    b = cute.Layout((4, 3), (3, 1))
    c = cute.composition(a, b)
    assert all(c(i) == a(b(i)) for i in range(b.size))
    assert c == cute.Layout(((2, 2), 3), ((24, 2), 8))  # CuTe's documented result


def test_complement_and_logical_divide():
    tile = cute.Layout(4, 2)
    comp = cute.complement(tile, 24)
    assert sorted(tile(i) + comp(j) for i in range(tile.size) for j in range(comp.size)) == list(range(24))
    divided = cute.logical_divide(cute.Layout(24, 1), tile)
    assert [divided(i) for i in range(24)] == [tile(i % 4) + comp(i // 4) for i in range(24)]


def test_swizzle_spreads_a_column_over_all_banks():
    # 8 rows of 64 bf16 (128 bytes): a column read hits one 16-byte chunk per row. Unswizzled
    # they share one bank group; Swizzle<3,4,3> moves each row's chunk to a different one.
    swizzle = cute.Swizzle(3, 4, 3)
    offsets = [swizzle(row * 128) for row in range(8)]
    assert sorted(o % 128 // 16 for o in offsets) == list(range(8))
    assert all(swizzle(swizzle(x)) == x for x in range(1024))  # an involution


# --- bad input ---------------------------------------------------------------------------

def test_matmul_rejects_bad_input():
    a, b = _operands(8, 8, 8, torch.float32)
    with pytest.raises(TypeError, match="torch.Tensor"):
        mm.matmul(a.tolist(), b)
    with pytest.raises(ValueError, match="agree on K"):
        mm.matmul(a, b[:4])
    with pytest.raises(TypeError, match="share a dtype"):
        mm.matmul(a, b.to(torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        mm.matmul(a.to(torch.int32), b.to(torch.int32))
    with pytest.raises(ValueError, match="dimensions"):
        mm.matmul(a[0], b)
    with pytest.raises(ValueError, match="kernel"):
        mm.matmul(a, b, kernel="fast")
    with pytest.raises(ValueError, match="TMA"):
        mm.matmul(*_operands(8, 8, 7, torch.float16), kernel="persistent")
    with pytest.raises(ValueError, match="naive"):
        mm.matmul(a, b, kernel="naive", cfg=SMALL)
    with pytest.raises(TypeError, match="triton.Config"):
        mm.matmul(a, b, kernel="tiled", cfg={"BLOCK_M": 16})


def test_fp8_matmul_rejects_bad_input():
    a8, sa = mm.quantize_rowwise(check.randn(8, 32, device=DEV, seed=1))
    w8, sw = mm.quantize_rowwise(check.randn(16, 32, device=DEV, seed=2))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mm.fp8_matmul(a8.float(), sa, w8, sw)
    with pytest.raises(ValueError, match="multiples of 16"):
        mm.fp8_matmul(a8[:, :24].contiguous(), sa, w8[:, :24].contiguous(), sw)
    with pytest.raises(ValueError, match="a_scale"):
        mm.fp8_matmul(a8, sa[:4].contiguous(), w8, sw)
    with pytest.raises(ValueError, match="out_dtype"):
        mm.fp8_matmul(a8, sa, w8, sw, torch.float32)


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="same profile"):
        cute.Layout((2, 3), (1,))
    with pytest.raises(ValueError, match="out of range"):
        cute.Layout((2, 3), (1, 2))(6)


@pytest.mark.gpu
def test_autotuned_kernels_on_the_gpu_at_real_sizes():
    for m, n, k in [(1000, 1030, 520), (4096, 4096, 4096), (128, 8192, 4096)]:
        a, b = _operands(m, n, k, torch.bfloat16, seed=m)
        rows = torch.arange(min(m, 128), device=DEV)
        for kernel in ("auto", "tiled", "split_k") + (("persistent",) if n % 8 == 0 and k % 8 == 0 else ()):
            out = mm.matmul(a, b, kernel=kernel)
            check.assert_close(out[rows], mm.matmul_reference(a[rows], b), dtype=torch.bfloat16,
                               name=f"{kernel} {m}x{n}x{k}")


def test_the_autotuners_timings_are_kept_for_every_key():
    """Triton's autotuner keeps only its last tuning's timings; the wrapper keeps each key's,
    by configuration label, and none for a launch that tuned nothing."""
    configs = kernels.PERSISTENT_CONFIGS[:2]

    class FakeTuner:  # what the wrapper reads of triton's Autotuner: cache, configs_timings, run
        def __init__(self):
            self.cache = {}

        def run(self, key):
            if key not in self.cache:
                self.configs_timings = {c: [float(i + key), 0.0, 0.0] for i, c in enumerate(configs)}
                self.cache[key] = configs[0]
            return key

    tuner = FakeTuner()
    kernels._keep_timings(tuner)
    assert tuner.run(1) == 1 and tuner.run(2) == 2 and tuner.run(1) == 1
    labels = [kernels.config_name(c) for c in configs]
    assert tuner.timings_by_key == {1: {labels[0]: 1.0, labels[1]: 2.0}, 2: {labels[0]: 2.0, labels[1]: 3.0}}
