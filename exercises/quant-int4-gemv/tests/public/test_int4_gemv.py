"""Public tests of quant-int4-gemv: what check() runs in the notebook."""

import torch

from labkit.grade.harness import poisoned


def random_int4(n, k, group, *, seed=0):
    """Codes [n, k] in [0, 15], scales and integer zero points [n, k / group], and x [k]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    x = torch.randn(k, generator=gen)
    return codes, scales, zeros, x


def packed_reference(codes):
    """Byte j of a row: element 2j in bits 0-3, element 2j + 1 in bits 4-7."""
    c = codes.to(torch.int32)
    return (c[:, 0::2] + 16 * c[:, 1::2]).to(torch.uint8)


def expected_gemv(codes, scales, zeros, x):
    """y_n = sum_k x_k (u_nk - z_n,g(k)) s_n,g(k), in float64."""
    group = codes.shape[1] // scales.shape[1]
    s = scales.double().repeat_interleave(group, dim=1)
    z = zeros.double().repeat_interleave(group, dim=1)
    return ((codes.double() - z) * s) @ x.double()


def expect_gemv(submission, codes, scales, zeros, x, name):
    out = submission.call("int4_gemv", x, packed_reference(codes), scales, zeros,
                          poisoned((codes.shape[0],), torch.float32))
    submission.expect_close(out, expected_gemv(codes, scales, zeros, x), dtype=torch.float32, name=name)


def test_pack_puts_even_elements_in_the_low_nibble(submission):
    """Codes [1, 2, 15, 0] pack to bytes [0x21, 0x0f]."""
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    out = submission.call("pack_int4", codes)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (1, 2):
        raise AssertionError(f"expected a uint8 tensor of shape (1, 2), got {out!r}")
    if out.tolist() != [[0x21, 0x0F]]:
        raise AssertionError(f"expected bytes [0x21, 0x0f], got {[hex(b) for b in out[0].tolist()]}")


def expect_packed(submission, n, k, seed):
    codes = random_int4(n, k, 32, seed=seed)[0]
    out = submission.call("pack_int4", codes)
    if not isinstance(out, torch.Tensor) or not torch.equal(out, packed_reference(codes)):
        raise AssertionError(f"packed bytes of a [{n}, {k}] input differ from the reference "
                             "(element 2j in the low nibble, 2j+1 in the high)")


def test_pack_random_codes(submission):
    """Random codes [8, 64]: every byte as the reference packs it."""
    expect_packed(submission, 8, 64, seed=1)


def test_gemv_one_group(submission):
    """16 rows, K = 32 in one group."""
    expect_gemv(submission, *random_int4(16, 32, 32, seed=2), name="16 x 32, group 32")


def test_gemv_several_groups_with_zero_points(submission):
    """32 rows, K = 128 in four groups of 32, each with its own scale and zero point."""
    expect_gemv(submission, *random_int4(32, 128, 32, seed=3), name="32 x 128, group 32")
