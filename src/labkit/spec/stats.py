"""Pearson's chi-square goodness-of-fit test, for "these samples come from that distribution".

Cells whose expected count is below ``min_expected`` are pooled into one, which joins the
smallest other cell if it is still below (the usual rule that keeps the statistic close to
its chi-square law); the p-value comes from the
regularised upper incomplete gamma function, ``P(X >= stat) = Q(dof / 2, stat / 2)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    cells: int


def chi_square_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> ChiSquare:
    """Test observed ``counts`` ``[cells]`` against the distribution ``probs`` ``[cells]``."""
    if not isinstance(counts, torch.Tensor) or not isinstance(probs, torch.Tensor):
        raise TypeError("counts and probs must be 1-D tensors")
    if counts.ndim != 1 or counts.shape != probs.shape:
        raise ValueError(f"counts and probs must be 1-D and of one shape, got {tuple(counts.shape)} "
                         f"and {tuple(probs.shape)}")
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("counts are empty: nothing to test")
    p = probs.double() / probs.double().sum()
    expected = p * total
    observed = counts.double()
    if bool((observed[expected == 0] > 0).any()):
        # A sample where the distribution has no mass: no statistic is needed to reject.
        return ChiSquare(float("inf"), 0, 0.0, int(counts.numel()))
    small = expected < min_expected
    if bool(small.any()):
        pooled_observed, pooled_expected = observed[small].sum(), expected[small].sum()
        observed, expected = observed[~small], expected[~small]
        if pooled_expected >= min_expected or expected.numel() == 0:
            observed = torch.cat([observed, pooled_observed.view(1)])
            expected = torch.cat([expected, pooled_expected.view(1)])
        else:  # the pool is itself too small: it joins the smallest cell left
            smallest = int(expected.argmin())
            observed[smallest] += pooled_observed
            expected[smallest] += pooled_expected
    dof = int(expected.numel()) - 1
    if dof < 1:
        raise ValueError("fewer than two cells have enough expected count: draw more samples")
    stat = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquare(stat, dof, p_value, int(expected.numel()))
