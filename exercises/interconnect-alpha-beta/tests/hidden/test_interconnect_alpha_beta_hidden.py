"""Hidden tests of interconnect-alpha-beta: noisy sweeps against a float64 reference, units,
the clamped intercept, degenerate inputs, order.

The reference (least squares on relative residuals, rows divided by the measured time) lives
here, not in the public tests: there it would be the solution.
"""

import random

import torch

from labkit import check
from labkit.grade.harness import public_module

pub = public_module(__file__, "test_interconnect_alpha_beta.py")


def reference(sizes, seconds):
    x = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    a = torch.stack([1 / t, x / t], dim=1)
    coef = torch.linalg.lstsq(a, torch.ones(len(t), 1, dtype=torch.float64)).solution[:, 0]
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0:
        r = x / t
        alpha, beta = 0.0, float(r.sum() / (r * r).sum())
    return alpha, beta


def noisy_sweep(seed, alpha, gbps, noise=0.05):
    sizes = [4.0 ** k for k in range(1, 15)]
    wobble = check.randn(len(sizes), dtype=torch.float64, seed=seed)
    seconds = [(alpha + n / (gbps * 1e9)) * (1 + noise * float(w)) for n, w in zip(sizes, wobble.clamp(-3, 3))]
    return sizes, seconds


def test_noisy_sweep_matches_the_relative_fit(submission):
    """Three sweeps with 5% noise (alpha 2-20 us, 10-400 GB/s): the fit equals the relative least squares."""
    for seed, alpha, gbps in ((11, 2e-6, 400.0), (12, 8e-6, 55.0), (13, 20e-6, 10.0)):
        sizes, seconds = noisy_sweep(seed, alpha, gbps)
        want_alpha, want_beta = reference(sizes, seconds)
        got_alpha, got_beta = pub.fit(submission, sizes, seconds)
        pub.close(got_beta, want_beta, 1e-6, f"beta for a sweep of alpha {alpha:g} s, {gbps:g} GB/s")
        pub.close(got_alpha, want_alpha, 1e-5, f"alpha for a sweep of alpha {alpha:g} s, {gbps:g} GB/s")


def test_units_are_seconds_and_seconds_per_byte(submission):
    """An exact line of 1 ms + bytes / 1 GB/s: alpha 1e-3 s, beta 1e-9 s/byte (not microseconds, not a bandwidth)."""
    sizes = [1e3, 1e5, 1e7]
    alpha, beta = pub.fit(submission, sizes, [1e-3 + n * 1e-9 for n in sizes])
    pub.close(alpha, 1e-3, 1e-6, "alpha (seconds)")
    pub.close(beta, 1e-9, 1e-6, "beta (seconds per byte)")


def test_negative_intercept_is_clamped(submission):
    """Times below a line through the origin at small sizes: no negative latency; alpha 0, beta refitted."""
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    seconds = [n * 1e-10 for n in sizes]
    seconds[0] *= 0.5  # the smallest copy 'faster than free': the unclamped intercept goes negative
    seconds[1] *= 0.8
    want_alpha, want_beta = reference(sizes, seconds)
    assert want_alpha == 0.0
    alpha, beta = pub.fit(submission, sizes, seconds)
    assert alpha >= 0.0, f"alpha must not be negative, got {alpha:.6g}"
    assert abs(alpha) <= 1e-15, f"alpha must be clamped to 0, got {alpha:.6g}"
    pub.close(beta, want_beta, 1e-6, "beta refitted through the origin")


def test_equal_sizes_are_rejected(submission):
    """Every point at one size leaves the slope undetermined: a ValueError, not a guess."""
    pub.expect_value_error(submission, [4096.0] * 5, [1e-5, 1.1e-5, 0.9e-5, 1e-5, 1.05e-5], "all sizes equal")
    pub.expect_value_error(submission, [-4096.0, 8192.0], [1e-5, 2e-5], "a negative size")


def test_order_of_the_points_does_not_matter(submission):
    """The same noisy sweep, shuffled: the same alpha and beta."""
    sizes, seconds = noisy_sweep(21, 6e-6, 100.0)
    order = list(range(len(sizes)))
    random.Random(5).shuffle(order)
    want_alpha, want_beta = reference(sizes, seconds)
    alpha, beta = pub.fit(submission, [sizes[i] for i in order], [seconds[i] for i in order])
    pub.close(beta, want_beta, 1e-6, "beta of the shuffled sweep")
    pub.close(alpha, want_alpha, 1e-5, "alpha of the shuffled sweep")
