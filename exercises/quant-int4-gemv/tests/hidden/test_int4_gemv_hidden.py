"""Hidden tests of quant-int4-gemv: odd sizes, other group sizes, a real quantized weight."""

import torch

from labkit.grade.harness import poisoned, public_module

_public = public_module(__file__, "test_int4_gemv.py")
expect_gemv, expect_packed, packed_reference, random_int4 = (
    _public.expect_gemv, _public.expect_packed, _public.packed_reference, _public.random_int4)


def test_pack_odd_rows_and_wide_rows(submission):
    """Packing 7 rows of 256 codes."""
    expect_packed(submission, 7, 256, seed=10)


def test_gemv_tail_rows_are_masked(submission):
    """37 rows: the last strip of rows is partial and must still be computed."""
    expect_gemv(submission, *random_int4(37, 64, 32, seed=11), name="37 x 64 (tail rows)")


def test_gemv_scales_differ_by_row_and_group(submission):
    """Scales of very different sizes per row and per group: a transposed index shows."""
    codes, _, zeros, x = random_int4(24, 96, 32, seed=12)
    scales = (10.0 ** torch.arange(24)[:, None].remainder(4)) * torch.tensor([1.0, 0.01, 100.0])[None, :]
    expect_gemv(submission, codes, scales.float(), zeros, x, name="24 x 96, scales 1e-2..1e5")


def test_gemv_group_sizes(submission):
    """Groups of 16 and of 64, and per-channel (one group of K = 128)."""
    for n, k, g, seed in [(19, 64, 16, 13), (21, 192, 64, 14), (9, 128, 128, 15)]:
        expect_gemv(submission, *random_int4(n, k, g, seed=seed), name=f"{n} x {k}, group {g}")


def test_gemv_on_a_real_quantized_weight(submission):
    """A Gaussian weight quantized asymmetrically per group of 32: y close to x @ W^T."""
    gen = torch.Generator().manual_seed(16)
    w = torch.randn(33, 128, generator=gen)
    groups = w.view(33, 4, 32)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = (hi - lo) / 15
    zeros = torch.round(-lo / scales)
    codes = torch.clamp(torch.round(groups / scales[..., None]) + zeros[..., None], 0, 15).to(torch.uint8).view(33, 128)
    x = torch.randn(128, generator=gen)
    expect_gemv(submission, codes, scales, zeros, x, name="asymmetric INT4 of a Gaussian weight")
    out = submission.call("int4_gemv", x, packed_reference(codes), scales, zeros,
                          poisoned((33,), torch.float32))
    err = (out.double() - w.double() @ x.double()).norm() / (w.double() @ x.double()).norm()
    if not err < 0.2:
        raise AssertionError(f"against the unquantized weight the error is {err:.3f}, expected INT4's ~0.1")
