"""Cost models of collectives: the alpha-beta model, bus bandwidth, and fitting both.

A message of ``N`` bytes over one link costs ``alpha + N * beta``: ``alpha`` the fixed
latency of a transfer (launch, synchronisation, the wire's first byte), ``beta`` the
seconds per byte (one over the link's bandwidth). A collective algorithm is a sequence
of steps, so its time is ``steps * alpha + bytes_per_rank * beta`` (Hockney's model;
NCCL's own tuner predicts times this way, see ``src/graph/tuning.cc``).

Bandwidths follow nccl-tests' convention (its ``doc/PERFORMANCE.md``): *algorithm
bandwidth* is ``N / t``; *bus bandwidth* multiplies it by the fraction of ``N`` each rank
must move over its links, ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for reduce-scatter
and all-gather, so it is comparable with the link's speed whatever ``n`` is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..validate import check_choice, check_positive_int

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")
ALGORITHMS = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
              "recursive_doubling_all_reduce", "tree_all_reduce", "point_to_point")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``n`` ranks (0 for ``n = 1``)."""
    check_choice(collective, "collective", COLLECTIVES)
    check_positive_int(n, "n")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw_gbps(n_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth, nccl-tests' ``algbw``: the tensor's size over the time, GB/s."""
    return n_bytes / seconds / 1e9


def busbw_gbps(collective: str, n_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth, nccl-tests' ``busbw``: what each rank's links carried, GB/s."""
    return algbw_gbps(n_bytes, seconds) * bus_factor(collective, n)


def steps_and_bytes(algorithm: str, n: int) -> tuple[float, float]:
    """``(steps, bytes per rank per byte of tensor)`` of an algorithm on ``n`` ranks.

    - ring all-reduce: ``2(n-1)`` steps, ``2(n-1)/n``; ring reduce-scatter or all-gather:
      half of that each;
    - recursive doubling: ``ceil(log2 n)`` steps of the whole tensor (two more, folding the
      extra ranks in and out, when ``n`` is not a power of two);
    - pipelined double binary tree (NCCL's tree): ``2 log2 n`` hops of latency, and each
      rank sends the tensor about twice (up the reduce tree and down the broadcast);
    - point to point (one message over one link, a copy or a send): one step of the whole
      tensor, whatever ``n`` is beyond 1.
    """
    check_choice(algorithm, "algorithm", ALGORITHMS)
    check_positive_int(n, "n")
    if n == 1:
        return 0.0, 0.0
    if algorithm == "ring_all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if algorithm in ("ring_reduce_scatter", "ring_all_gather"):
        return float(n - 1), (n - 1) / n
    if algorithm == "point_to_point":
        return 1.0, 1.0
    log_n = math.ceil(math.log2(n))
    if algorithm == "recursive_doubling_all_reduce":
        extra = 0 if n & (n - 1) == 0 else 2
        return float(log_n + extra), float(log_n + extra)
    return 2.0 * log_n, 2.0


def predicted_seconds(algorithm: str, n_bytes: float, n: int, *, alpha_s: float, bandwidth_gbps: float) -> float:
    """The alpha-beta time of ``algorithm`` on ``n`` ranks for a tensor of ``n_bytes``."""
    if bandwidth_gbps <= 0 or alpha_s < 0 or n_bytes < 0:
        raise ValueError(f"need alpha_s >= 0, bandwidth_gbps > 0, n_bytes >= 0; got "
                         f"{alpha_s}, {bandwidth_gbps}, {n_bytes}")
    steps, per_byte = steps_and_bytes(algorithm, n)
    return steps * alpha_s + per_byte * n_bytes / (bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class AlphaBetaFit:
    """``t = fixed_s + n_bytes * per_byte_s``, least squares on relative residuals.

    ``alpha_s`` and ``bandwidth_gbps`` translate the line into the algorithm's per-step
    latency and per-link bandwidth (``None`` when there is no link: one rank). The line was
    fitted to the points at or above ``fit_from_bytes``; ``rel_errors`` covers every point.
    """

    algorithm: str
    n: int
    fixed_s: float
    per_byte_s: float
    alpha_s: float | None
    bandwidth_gbps: float | None
    rel_errors: tuple[float, ...]
    fit_from_bytes: float = 0.0

    def predict(self, n_bytes: float) -> float:
        return self.fixed_s + self.per_byte_s * n_bytes

    def max_rel_error(self, sizes: Sequence[float], min_bytes: float = 0.0) -> float:
        """The worst ``|model - measured| / measured`` over the points at or above ``min_bytes``."""
        errs = [e for s, e in zip(sizes, self.rel_errors) if s >= min_bytes]
        return max(errs) if errs else math.nan


def _weighted_line(sizes: Sequence[float], times: Sequence[float], use_fixed: bool, use_slope: bool):
    import numpy as np

    x, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    # Dividing each row by its measured time makes the residuals relative: a microsecond
    # off at 4 KB counts as much as a millisecond off at 4 MB.
    columns = ([1.0 / t] if use_fixed else []) + ([x / t] if use_slope else [])
    coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), np.ones_like(t), rcond=None)
    coef = list(coef)
    fixed = coef.pop(0) if use_fixed else 0.0
    slope = coef.pop(0) if use_slope else 0.0
    return float(fixed), float(slope)


def fit_alpha_beta(algorithm: str, n: int, sizes_bytes: Sequence[float], seconds: Sequence[float],
                   fit_from_bytes: float = 0.0) -> AlphaBetaFit:
    """Fit the alpha-beta line to the measured ``(size, time)`` points at or above ``fit_from_bytes``.

    Every point is still scored (``rel_errors``), so the line can be judged where it was
    not fitted too. The least-squares line is refitted without its intercept (or slope)
    if noise drives that one negative: a negative latency or bandwidth has no meaning.
    """
    check_choice(algorithm, "algorithm", ALGORITHMS)
    check_positive_int(n, "n")
    if len(sizes_bytes) != len(seconds):
        raise ValueError(f"need one time per size, got {len(sizes_bytes)} sizes and {len(seconds)} times")
    if any(t <= 0 or not math.isfinite(t) for t in seconds) or any(s <= 0 for s in sizes_bytes):
        raise ValueError("sizes and times must be positive and finite")
    fitted = [(s, t) for s, t in zip(sizes_bytes, seconds) if s >= fit_from_bytes]
    if len(fitted) < 2:
        raise ValueError(f"need at least two (size, time) points at or above {fit_from_bytes:.0f} bytes "
                         f"to fit a line, got {len(fitted)}")
    xs, ts = [s for s, _ in fitted], [t for _, t in fitted]
    fixed, slope = _weighted_line(xs, ts, True, True)
    if fixed < 0:
        fixed, slope = _weighted_line(xs, ts, False, True)
    elif slope < 0:
        fixed, slope = _weighted_line(xs, ts, True, False)
    steps, per_byte = steps_and_bytes(algorithm, n)
    alpha = fixed / steps if steps else None
    bandwidth = per_byte / slope / 1e9 if steps and slope > 0 else None
    errors = tuple(abs(fixed + slope * s - t) / t for s, t in zip(sizes_bytes, seconds))
    return AlphaBetaFit(algorithm, n, fixed, slope, alpha, bandwidth, errors, float(fit_from_bytes))
