"""Public tests of interconnect-alpha-beta: what check() runs in the notebook.

They check properties and values worked out by hand (an exact line must come back exactly),
never against a function that computes the fit: that function would be the solution. The
hidden tests have their own reference, on fresh noisy sweeps.
"""

from labkit.grade.sandbox import SubmissionFailed

SIZES = [4.0 ** k for k in range(2, 14)]  # 16 B .. 64 MiB, as a copy sweep


def fit(submission, sizes, seconds):
    out = submission.call("fit_alpha_beta", list(sizes), list(seconds))
    assert isinstance(out, (list, tuple)) and len(out) == 2, \
        f"fit_alpha_beta must return (alpha_s, beta_s_per_byte), got {out!r}"
    alpha, beta = (float(v) for v in out)
    return alpha, beta


def close(got, want, rel, what):
    assert abs(got - want) <= rel * abs(want), f"{what}: expected {want:.6g}, got {got:.6g}"


def expect_value_error(submission, sizes, seconds, why):
    try:
        out = submission.call("fit_alpha_beta", list(sizes), list(seconds))
    except SubmissionFailed as failure:
        assert "ValueError" in str(failure), f"{why}: expected a ValueError, got: {str(failure)[-300:]}"
        return
    raise AssertionError(f"{why}: expected a ValueError, got the result {out!r}")


def test_exact_line_is_recovered(submission):
    """Times exactly 5 us + bytes / 50 GB/s: the fit returns alpha = 5e-6 s and beta = 2e-11 s/byte."""
    seconds = [5e-6 + n / 50e9 for n in SIZES]
    alpha, beta = fit(submission, SIZES, seconds)
    close(alpha, 5e-6, 1e-6, "alpha (seconds)")
    close(beta, 2e-11, 1e-6, "beta (seconds per byte)")


def test_bad_inputs_are_value_errors(submission):
    """Lengths that differ, a single point, and a time of zero are ValueErrors."""
    expect_value_error(submission, SIZES, [1e-5] * (len(SIZES) - 1), "one time fewer than sizes")
    expect_value_error(submission, [4096.0], [1e-5], "a single point")
    expect_value_error(submission, [4096.0, 8192.0], [1e-5, 0.0], "a time of zero")
