"""Correctness: compare against a higher-precision reference, by dtype-aware tolerances.

The measure is the relative error ``||out - ref|| / ||ref||`` in float64. It is a single
number that does not blow up where the reference is near zero (an elementwise relative
error does), and it scales with the format's precision: a bf16 result with fp32
accumulation lands near 1e-3, fp32 near 1e-7. NaN or inf in the output never passes.

Inputs are fresh random numbers (never zeros, which hide missing scale factors and
unwritten elements), and outputs can be *poisoned* with NaN before a kernel runs, so an
element the kernel forgot to write fails the check instead of passing by luck.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .validate import check_tensor, dtype_name

# Relative-error tolerances for results *computed in* a dtype (inputs rounded to it,
# accumulation in fp32 where the format is narrower). Wide enough for reordered sums,
# tight enough that a missing rescale or a wrong mask (errors of order 1) always fails.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}
TF32_TOLERANCE = 3e-4


def tolerance(dtype: torch.dtype) -> float:
    """The book's relative-error tolerance for a result in ``dtype``."""
    if dtype not in TOLERANCES:
        known = ", ".join(dtype_name(d) for d in TOLERANCES)
        raise ValueError(f"no tolerance defined for {dtype_name(dtype)}; known: {known}")
    return TOLERANCES[dtype]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; ``inf`` if ``out`` has a NaN or an inf."""
    check_tensor(out, "out", nonempty=False)
    check_tensor(ref, "ref", nonempty=False)
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but ref has {tuple(ref.shape)}")
    o = out.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(o).all():
        return float("inf")
    denom = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


class CheckFailed(AssertionError):
    """A result differs from its reference by more than the tolerance."""


@dataclass(frozen=True)
class CheckReport:
    name: str
    shape: tuple[int, ...]
    dtype: str
    rel_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.rel_error <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (
            f"{self.name}: {verdict}, relative error {self.rel_error:.2e} "
            f"(tolerance {self.tolerance:.0e}, {self.dtype}, shape {self.shape})"
        )


def worst_elements(out: torch.Tensor, ref: torch.Tensor, k: int = 5) -> str:
    """A small table of the elements where ``out`` and ``ref`` differ most."""
    o = out.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    diff = (o - r).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    flat = diff.flatten()
    k = min(k, flat.numel())
    values, flat_idx = torch.topk(flat, k)
    lines = [f"{'index':>24}  {'got':>14}  {'expected':>14}  {'|diff|':>10}"]
    for v, i in zip(values.tolist(), flat_idx.tolist()):
        index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), o.shape))
        lines.append(f"{str(index):>24}  {o.flatten()[i].item():>14.6g}  {r.flatten()[i].item():>14.6g}  {v:>10.3g}")
    return "\n".join(lines)


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    tol: float | None = None,
    name: str = "output",
) -> CheckReport:
    """Check ``out`` against ``ref``; return a report, or raise ``CheckFailed`` that explains.

    The tolerance is ``tol`` if given, else the book's tolerance for ``dtype`` (default: the
    dtype of ``out``). The error message names the shapes, the number of NaNs (unwritten
    elements of a poisoned output show up here), the error, and the worst elements.
    """
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"{name}: expected a tensor, got {type(out).__name__}")
    check_tensor(ref, "ref", nonempty=False)
    if tuple(out.shape) != tuple(ref.shape):
        raise CheckFailed(f"{name}: expected shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    limit = tol if tol is not None else tolerance(dtype or out.dtype)
    err = rel_error(out, ref)
    report = CheckReport(name, tuple(out.shape), dtype_name(out.dtype), err, limit)
    if report.passed:
        return report
    lines = [str(report)]
    n_nan = int(torch.isnan(out.detach()).sum().item()) if out.is_floating_point() else 0
    n_inf = int(torch.isinf(out.detach()).sum().item()) if out.is_floating_point() else 0
    if n_nan or n_inf:
        lines.append(
            f"{n_nan} NaN and {n_inf} inf of {out.numel()} elements "
            "(NaN in a poisoned output means those elements were never written)"
        )
    lines.append("worst elements:")
    lines.append(worst_elements(out, ref))
    raise CheckFailed("\n".join(lines))


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def randn(
    *shape: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    scale: float = 1.0,
) -> torch.Tensor:
    """Fresh normal random numbers, reproducible by ``seed``, in ``dtype`` on ``device``."""
    if not shape or any((not isinstance(s, int)) or s <= 0 for s in shape):
        raise ValueError(f"shape must be positive ints, got {shape}")
    gen = make_generator(seed, device)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return (x * scale).to(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no correct kernel writes (NaN, or the int max)."""
    check_tensor(t, "t", nonempty=False)
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def empty_poisoned(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """An output buffer filled with poison, so unwritten elements fail the check."""
    return poison(torch.empty(tuple(shape), dtype=dtype, device=device))
