"""Counting the work of an operation: the FLOPs it does and the bytes it must move.

The roofline model :cite:`williams2009roofline` bounds a kernel's rate by two ceilings:

    attainable FLOP/s = min(peak FLOP/s, arithmetic intensity x memory bandwidth),

where the arithmetic intensity is FLOPs per byte moved between the GPU and its memory.
The bytes here are the *compulsory* traffic: every input read once and every output
written once. A kernel that re-reads its inputs moves more than this and sits below its
point; no kernel can move less, so the bound holds for all of them.

FLOPs count additions, multiplications, comparisons, divisions and exponentials as one
each. That is the convention of the roofline papers; an ``exp`` costs the special-function
unit more than an add, which matters only for kernels that are compute-bound on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import validate


@dataclass(frozen=True)
class Work:
    """What one call of an operation costs: ``flops`` and compulsory ``bytes``."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


def _dims(itemsize: int, **dims: int) -> None:
    validate.check_positive_int(itemsize, "itemsize")
    for name, value in dims.items():
        validate.check_positive_int(value, name)


def copy_work(n: int, itemsize: int) -> Work:
    """``dst = src``: no arithmetic; ``n`` elements read and ``n`` written."""
    _dims(itemsize, n=n)
    return Work(flops=0.0, bytes=2.0 * n * itemsize)


def vector_add_work(n: int, itemsize: int) -> Work:
    """``out = x + y``: one add per element; two reads and one write."""
    _dims(itemsize, n=n)
    return Work(flops=float(n), bytes=3.0 * n * itemsize)


def softmax_work(rows: int, cols: int, itemsize: int) -> Work:
    """Row-wise softmax: per element a max, a subtract, an exp, a sum and a divide."""
    _dims(itemsize, rows=rows, cols=cols)
    return Work(flops=5.0 * rows * cols, bytes=2.0 * rows * cols * itemsize)


def matmul_work(m: int, n: int, k: int, itemsize: int) -> Work:
    """``C[m, n] = A[m, k] @ B[k, n]``: a multiply and an add per (i, j, l); A, B read, C written.

    With ``m = 1`` (or ``n = 1``) this is a matrix-vector product (GEMV): the ``k x n``
    matrix is read once for ``2kn`` FLOPs, an intensity near one FLOP per *element*,
    which is why decoding one token at a time is memory-bound.
    """
    _dims(itemsize, m=m, n=n, k=k)
    return Work(flops=2.0 * m * n * k, bytes=float(m * k + k * n + m * n) * itemsize)


def attainable_tflops(intensity: float, *, peak_tflops: float, peak_tbps: float) -> float:
    """The roof at ``intensity`` FLOP/byte: ``min(peak_tflops, intensity * peak_tbps)``."""
    if intensity < 0:
        raise ValueError(f"intensity must be non-negative, got {intensity}")
    if peak_tflops <= 0 or peak_tbps <= 0:
        raise ValueError(f"ceilings must be positive, got {peak_tflops} TFLOP/s and {peak_tbps} TB/s")
    return min(peak_tflops, intensity * peak_tbps)

