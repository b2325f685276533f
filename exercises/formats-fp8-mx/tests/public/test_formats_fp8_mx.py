"""Public tests of formats-fp8-mx: what check() runs in the notebook.

Expected codes are written out by hand from the E2M1 table (magnitudes 0, 0.5, 1, 1.5, 2,
3, 4, 6 are codes 0-7; negative adds 8) and the OCP MX scale rule; the hidden tests hold
the reference implementation.
"""

import torch

FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def expect_codes(out, expected, name):
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8:
        raise AssertionError(f"{name}: expected a uint8 tensor of codes, got {out!r}")
    if out.tolist() != expected:
        raise AssertionError(f"{name}: expected codes {expected}, got {out.tolist()}")


def test_fp4_encodes_every_value_exactly(submission):
    """The 16 FP4 values, +0 to -6, encode to codes 0 to 15."""
    values = torch.tensor([*FP4_MAGNITUDES, *(-v for v in FP4_MAGNITUDES)])
    values[8] = -0.0
    expect_codes(submission.call("fp4_e2m1_encode", values), list(range(16)), "the 16 FP4 values")


def test_fp4_ties_go_to_even(submission):
    """Midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: each to the neighbour with an even code."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    # 0.25 -> 0 (code 0), 0.75 -> 1 (2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6)
    expect_codes(submission.call("fp4_e2m1_encode", ties), [0, 2, 2, 4, 4, 6, 6, 10, 14], "midpoints")


def test_fp4_rounds_to_nearest_and_saturates(submission):
    """Off-midpoint values round to the nearest; beyond 6 saturates; a tiny negative keeps its sign."""
    x = torch.tensor([0.26, 0.74, 2.49, 4.9, 5.1, 6.5, 1e9, -1e9, -0.1])
    expect_codes(submission.call("fp4_e2m1_encode", x), [1, 1, 4, 6, 7, 7, 7, 15, 8], "nearest and saturated")


def block_with_max(amax, seed):
    """One [1, 32] block of small values with one element equal to amax."""
    x = torch.rand(1, 32, generator=torch.Generator().manual_seed(seed)) * 0.1
    x[0, 5] = amax
    return x


def test_mx_scale_byte(submission):
    """amax 5.0: floor(log2 5) = 2, so the E8M0 byte is 127 + 2 - 8 for E4M3 and 127 + 2 - 2 for E2M1."""
    for elem, expected in (("e4m3", 121), ("e2m1", 127)):
        codes, scales = submission.call("mx_quantize", block_with_max(5.0, seed=1), elem)
        expect_codes(scales, [[expected]], f"{elem} scale of a block whose max is 5.0")


def test_mx_representable_values_come_back_exactly(submission):
    """Blocks made of FP4 values times 2^k (k differs by block) survive MXFP4 exactly; same for MXFP8."""
    gen = torch.Generator().manual_seed(2)
    table = torch.tensor(FP4_MAGNITUDES)
    values = table[torch.randint(0, 8, (3, 96), generator=gen)] * torch.where(torch.rand(3, 96, generator=gen) < .5, -1, 1)
    values[:, ::32] = 6.0  # every block reaches FP4's maximum, so its scale is exactly 2^k
    x = values * torch.exp2(torch.tensor([[-3.0, 0.0, 5.0]])).repeat_interleave(32, 1)
    for elem in ("e2m1", "e4m3"):
        codes, scales = submission.call("mx_quantize", x, elem)
        out = submission.call("mx_dequantize", codes, scales, elem)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not torch.equal(out, x):
            raise AssertionError(f"{elem}: exactly representable blocks did not come back exactly: got {out!r}")


def test_fp8_1x128_scales_map_each_tile_max_to_448(submission):
    """x [4, 256]: 8 tiles of 1 x 128; each tile's max |x| lands on 448, and dequantizing is within E4M3's rounding."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)) * torch.tensor([1.0, 100.0]).repeat_interleave(128)
    q, scales = submission.call("fp8_quantize_1x128", x)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or tuple(q.shape) != (4, 256):
        raise AssertionError(f"the codes must be a uint8 tensor of shape (4, 256), got {q!r}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (4, 2):
        raise AssertionError(f"scales must be float32 of shape (4, 2), got {scales!r}")
    tile_max = q.view(torch.float8_e4m3fn).float().abs().reshape(4, 2, 128).amax(-1)
    if not torch.equal(tile_max, torch.full((4, 2), 448.0)):
        raise AssertionError(f"each tile's largest |q| should be 448, got {tile_max.tolist()}")
    out = submission.call("fp8_dequantize_1x128", q, scales)
    rel = ((out - x).abs() / x.abs().reshape(4, 2, 128).amax(-1).repeat_interleave(128, 1)).max()
    if not rel <= 2.0**-4:
        raise AssertionError(f"dequantized values should be within 1/16 of their tile's max, worst {float(rel):.3g}")
