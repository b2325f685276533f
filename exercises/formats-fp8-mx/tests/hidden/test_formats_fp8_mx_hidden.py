"""Hidden tests of formats-fp8-mx: a reference built differently from the solution
(nearest value by search over the table; scale exponents from fp32 bit fields), random
values over many binades, odd shapes, all-zero blocks, saturation inside a block."""

import torch

from labkit.grade.harness import public_module

_public = public_module(__file__, "test_formats_fp8_mx.py")
FP4_MAGNITUDES, expect_codes = _public.FP4_MAGNITUDES, _public.expect_codes
EMAX = {"e4m3": 8, "e2m1": 2}


def reference_fp4(x):
    """Nearest of the 8 magnitudes by distance; of two equally near, the even code."""
    table = torch.tensor(FP4_MAGNITUDES, dtype=torch.float64)
    distance = (x.double().abs()[..., None] - table).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = torch.where(distance == best, torch.arange(8), 99)
    even_first = torch.where(candidates % 2 == 0, candidates, candidates + 100)
    index = even_first.min(-1).values % 100
    return (index + 8 * torch.signbit(x).long()).to(torch.uint8)


def reference_mx(x, elem):
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2) of a normal fp32
    shared = torch.where(amax > 0, exponent - EMAX[elem], -127)
    scaled = blocks.double() * torch.exp2(-shared.double())[..., None]
    if elem == "e2m1":
        codes = reference_fp4(scaled)
    else:
        codes = scaled.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(x.shape), (shared + 127).to(torch.uint8)


def many_binades(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())


def test_fp4_random_values_over_many_binades(submission):
    """5000 values from 2^-20 to 2^20 times a normal: each code as the reference gives it."""
    x = many_binades((5000,), seed=10) / 2**10
    # and, built in: both zeros, the extremes, values just off a midpoint, and midpoints times a random sign
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * torch.where(torch.rand(7) < 0.5, -1.0, 1.0)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 6.0, -6.0, 5.999, 0.2500001, 0.2499999]), ties])
    out = submission.call("fp4_e2m1_encode", x)
    expected = reference_fp4(x)
    if not isinstance(out, torch.Tensor) or not torch.equal(out, expected):
        bad = (out != expected).nonzero()[:5].flatten().tolist() if isinstance(out, torch.Tensor) else []
        raise AssertionError(f"codes differ from the reference, e.g. at x = {[float(x[i]) for i in bad]}")


def expect_mx(submission, x, elem, name):
    codes, scales = submission.call("mx_quantize", x, elem)
    ref_codes, ref_scales = reference_mx(x, elem)
    expect_codes(scales, ref_scales.tolist(), f"{name}: scales")
    if not torch.equal(codes, ref_codes):
        raise AssertionError(f"{name}: element codes differ from the reference in {int((codes != ref_codes).sum())} places")
    out = submission.call("mx_dequantize", ref_codes, ref_scales, elem)
    ref_blocks = (torch.tensor(FP4_MAGNITUDES)[(ref_codes & 7).long()] * (1 - 2 * (ref_codes >> 3).float())
                  if elem == "e2m1" else ref_codes.view(torch.float8_e4m3fn).float())
    expected = ref_blocks * torch.exp2(ref_scales.float() - 127).repeat_interleave(32, -1)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not torch.equal(out, expected):
        raise AssertionError(f"{name}: dequantized values differ from elements x 2^(scale - 127)")


def test_mxfp4_random_blocks_of_3d_tensors(submission):
    """[3, 5, 96] values over many binades, MXFP4."""
    expect_mx(submission, many_binades((3, 5, 96), seed=11), "e2m1", "MXFP4 [3, 5, 96]")


def test_mxfp8_random_blocks(submission):
    """[7, 160] values over many binades, MXFP8 (E4M3)."""
    expect_mx(submission, many_binades((7, 160), seed=12), "e4m3", "MXFP8 [7, 160]")


def test_mx_zero_blocks_and_saturating_maxima(submission):
    """An all-zero block (scale byte 0), and blocks whose max rounds past the element maximum."""
    x = torch.zeros(3, 64)
    x[1, :32] = 7.75          # FP4: scale 2^0, 7.75 saturates to 6
    x[1, 32:] = 1.0
    x[2, :32] = 510.0         # E4M3: scale 2^0, 510 saturates to 448
    x[2, 32:] = -0.001
    expect_mx(submission, x, "e2m1", "zero and saturating blocks, MXFP4")
    expect_mx(submission, x, "e4m3", "zero and saturating blocks, MXFP8")


def test_fp8_1x128_matches_the_reference_on_odd_rows(submission):
    """x [5, 384] with an all-zero tile: codes and scales exactly as max|tile| / 448 gives them."""
    x = many_binades((5, 384), seed=13)
    x[2, 128:256] = 0
    q, scales = submission.call("fp8_quantize_1x128", x)
    tiles = x.float().reshape(5, 3, 128)
    ref_scales = (tiles.abs().amax(-1) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    ref_q = (tiles / ref_scales[..., None]).to(torch.float8_e4m3fn).reshape(5, 384)
    if not isinstance(scales, torch.Tensor) or not torch.equal(scales, ref_scales):
        raise AssertionError(f"scales differ from max|tile| / 448: got {scales!r}")
    if not isinstance(q, torch.Tensor) or not torch.equal(q, ref_q.view(torch.uint8)):
        raise AssertionError("E4M3 codes differ from (tile / scale) cast to float8_e4m3fn")
    out = submission.call("fp8_dequantize_1x128", ref_q.view(torch.uint8), ref_scales)
    expected = (ref_q.float().reshape(5, 3, 128) * ref_scales[..., None]).reshape(5, 384)
    if not isinstance(out, torch.Tensor) or not torch.equal(out, expected):
        raise AssertionError("dequantized values differ from q x its tile's scale")
