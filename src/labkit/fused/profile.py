"""Where the time of one model step goes: ``torch.profiler``'s kernels, sorted into kinds.

:func:`kernel_breakdown` runs a step under the profiler (:func:`labkit.profiling.kernels_run`)
and sums each kernel's device time into a category chosen by the kernel's name: the cuBLAS
matmuls, SDPA's attention kernel, labkit's fused Triton kernels, the embedding gather, and the rest, which in an
eager model is the long tail of elementwise kernels, reductions and copies that the
fused kernels replace. Without a GPU the same code sums the CPU time of torch's
operators instead (labelled as such; it says nothing about a GPU).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .. import profiling

# First match wins; the names are those of CUDA kernels (and, on the CPU, of aten ops).
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE)) for name, pattern in (
        ("fused Triton (labkit)", r"rms_norm_(fwd|bwd)_kernel|rope_kernel|swiglu_(fwd|bwd)_kernel"),
        ("attention (SDPA)", r"flash|fmha|sdpa|scaled_dot_product|attention"),
        ("matmul (cuBLAS)", r"gemm|nvjet|xmma|cutlass|cublas|aten::(mm|addmm|bmm)$"),
        ("embedding", r"embedding|index_?select"),
    )
)
REST = "elementwise, reductions, copies"


def category(kernel_name: str) -> str:
    """The kind of work a kernel (or, on the CPU, an aten op) does, judged by its name."""
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return REST


@dataclass(frozen=True)
class Share:
    category: str
    ms: float       # summed device time of the category's kernels in one step
    kernels: int    # how many kernels it launched


def kernel_breakdown(step: Callable[[], object], *, warmup: int = 2) -> list[Share]:
    """Profile one call of ``step`` (after ``warmup`` calls) and sum its kernels by category."""
    for _ in range(warmup):
        step()
    totals: dict[str, list[float]] = {}
    for kernel in profiling.kernels_run(step):
        entry = totals.setdefault(category(kernel.name), [0.0, 0])
        entry[0] += kernel.us
        entry[1] += kernel.launches
    order = [name for name, _ in CATEGORIES] + [REST]
    return [Share(name, totals[name][0] / 1e3, int(totals[name][1])) for name in order if name in totals]
