"""Hidden tests of matmul-grouped-tiled: thin shapes, long K, strides, half precision, the
grouped order, and TFLOP/s on a GPU."""

import torch

from labkit import check
from labkit.grade.harness import Randn, public_module, require_gpu

_public = public_module(__file__, "test_matmul_tiled.py")


def test_single_row_and_single_column(submission):
    """1 x 40 times 40 x 70, and 70 x 40 times 40 x 1: one tile row or column, mostly masked."""
    _public.expect_matmul(submission, check.randn(1, 40, seed=10), check.randn(40, 70, seed=11), "matmul(1x40, 40x70)")
    _public.expect_matmul(submission, check.randn(70, 40, seed=12), check.randn(40, 1, seed=13), "matmul(70x40, 40x1)")


def test_long_ragged_k(submission):
    """K = 300: many K steps, the last one partial (its loads must be masked with zeros)."""
    _public.expect_matmul(submission, check.randn(20, 300, seed=20), check.randn(300, 33, seed=21),
                          "matmul(20x300, 300x33)")


def test_strided_and_transposed_operands(submission):
    """a = every other row of a matrix, b = a transposed matrix: the strides are not (K, 1), (N, 1)."""
    a = check.randn(50, 45, seed=30)[::2]
    b = check.randn(35, 45, seed=31).t()
    _public.expect_matmul(submission, a, b, "matmul(x[::2], y.t())")


def test_half_precision(submission):
    """bfloat16 and float16 in, the same dtype out, accumulated in fp32."""
    for dtype, seed in ((torch.bfloat16, 40), (torch.float16, 41)):
        _public.expect_matmul(submission, check.randn(33, 96, dtype=dtype, seed=seed),
                              check.randn(96, 40, dtype=dtype, seed=seed + 1), f"matmul {dtype}")


def test_allocates_its_output(submission):
    """Without out, matmul returns a new (M, N) tensor in a's dtype."""
    a, b = check.randn(21, 34, seed=50), check.randn(34, 17, seed=51)
    c = submission.call("matmul", a, b)
    submission.expect_close(c, a.double() @ b.double(), dtype=torch.float32, name="matmul(a, b)")


def _grouped_order(tiles_m: int, tiles_n: int, group_m: int) -> list[list[int]]:
    order = []
    for first_row in range(0, tiles_m, group_m):
        height = min(group_m, tiles_m - first_row)
        order += [[first_row + i, j] for j in range(tiles_n) for i in range(height)]
    return order


def test_grouped_order(submission):
    """tile_order follows bands of GROUP_M tile rows, column by column, the last band short."""
    for tiles_m, tiles_n, group_m in ((5, 3, 2), (7, 4, 3), (4, 6, 4), (3, 5, 8), (6, 2, 1)):
        got = submission.call("tile_order", tiles_m, tiles_n, group_m)
        want = _grouped_order(tiles_m, tiles_n, group_m)
        if not isinstance(got, torch.Tensor) or got.tolist() != want:
            shown = got.tolist() if isinstance(got, torch.Tensor) else got
            raise AssertionError(f"tile_order({tiles_m}, {tiles_n}, group_m={group_m}): expected {want}, got {shown}")


def test_tflops(submission, credit):
    """On a GPU, bf16 8001 x 8000 times 8000 x 7992: full points at 60% of the best cuBLAS rate
    measured in the same run (labkit.ceilings.matmul_tflops), pro rata below."""
    require_gpu()
    from labkit import ceilings

    m, k, n = 8001, 8000, 7992  # M odd, N not a multiple of the tile: the edges cost their share
    sets = [[Randn((m, k), torch.bfloat16, seed=s), Randn((k, n), torch.bfloat16, seed=s + 10)] for s in range(2)]
    bytes_moved = 2 * (m * k + k * n + m * n)
    result = submission.measure("matmul", lambda a, b: a @ b, sets, bytes_moved=bytes_moved)
    tflops = 2 * m * n * k * result.tbps / bytes_moved
    ceiling = ceilings.matmul_tflops()
    credit.award(tflops / (0.6 * ceiling), f"{tflops:.0f} TFLOP/s, {tflops / ceiling:.0%} of cuBLAS's best "
                                           f"measured in this run ({ceiling:.0f} TFLOP/s)")
