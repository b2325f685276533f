"""The hardware's limits, measured in the same run as the benchmark they bound.

Datasheet peaks are promises (4.8 TB/s, 989 dense bf16 TFLOP/s for the H200); what a
program can actually reach on this card today is lower and is what our kernels should be
held to. So every benchmark measures its ceiling beside itself:

- copy bandwidth: ``torch``'s device-to-device copy of a buffer far larger than L2,
  counting bytes read plus bytes written;
- read bandwidth: :func:`labkit.memory.read_sum` streaming a buffer far larger than L2,
  counting bytes read (the few partial sums it writes are left out). A kernel that only
  reads is held to this rather than to the copy, half of whose bytes are writes;
- matmul rate: the best bf16 ``torch.mm`` (cuBLAS) over a few large shapes, on random
  data (zeros flatter it: the tensor cores draw less power and clock higher), timed with
  the same L2 flush between calls as the benchmarks it bounds.

All are cached per process. Under the interpreter they are measured too, on small
sizes, so the code path is the same; those values are not performance.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import backend, check, timing


@lru_cache(maxsize=None)
def copy_bandwidth_tbps() -> float:
    """Measured device-to-device copy bandwidth in TB/s (read + write)."""
    n_bytes = backend.pick(cpu=2**24, gpu=2**31)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=backend.device()).random_()
    dst = torch.empty_like(src)
    t = timing.measure(lambda: dst.copy_(src), flush_l2=False)
    return timing.bandwidth_tbps(2 * n_bytes, t)


@lru_cache(maxsize=None)
def read_bandwidth_tbps() -> float:
    """Measured read-only bandwidth in TB/s (bytes read), one pass over a buffer beyond L2."""
    # Imported here, not at the top: labkit.memory is a topic package, and the grader's
    # sandbox holds labkit's core (this module, for the copy ceiling) without the topics.
    from . import memory

    n_bytes = backend.pick(cpu=2**16, gpu=2**31)
    src = check.randn(n_bytes // 4, dtype=torch.float32, device=backend.device(), seed=3)
    partials = memory.read_sum(src)  # allocates the partial sums once, outside the timing
    t = timing.measure(lambda: memory.read_sum(src, out=partials), flush_l2=False)
    return timing.bandwidth_tbps(n_bytes, t)


@lru_cache(maxsize=None)
def read_bandwidth_at_tbps(n_bytes: int) -> float:
    """The read bandwidth one pass over ``n_bytes`` reaches, in TB/s: the rate a short call can hope for.

    :func:`read_bandwidth_tbps` streams 2 GiB, so a launch's start and its last, partial wave
    of programs are a sliver of its time. A call that reads tens of MB pays the same fixed
    costs over far fewer bytes; timed as benchmarks time their kernels (L2 flushed before
    each call, nothing else queued), a bare read of the same bytes is the fair bound for it.
    """
    from . import memory  # (see read_bandwidth_tbps)

    if not isinstance(n_bytes, int) or n_bytes < 4:
        raise ValueError(f"n_bytes must be an int of at least 4 (one float32), got {n_bytes!r}")
    src = check.randn(n_bytes // 4, dtype=torch.float32, device=backend.device(), seed=3)
    partials = memory.read_sum(src)
    return timing.bandwidth_tbps(src.nbytes, timing.measure(lambda: memory.read_sum(src, out=partials)))


@lru_cache(maxsize=None)
def copy_bandwidth_at_tbps(n_bytes: int) -> float:
    """The copy bandwidth (read + write) a device copy moving ``n_bytes`` in all reaches, in TB/s.

    The counterpart of :func:`read_bandwidth_at_tbps` for kernels that write as much as they
    read: half the bytes copied from one buffer to another, timed as benchmarks time their
    kernels (L2 flushed before each call). :func:`copy_bandwidth_tbps` copies 2 GiB each way.
    """
    if not isinstance(n_bytes, int) or n_bytes < 2:
        raise ValueError(f"n_bytes must be an int of at least 2 (one byte each way), got {n_bytes!r}")
    src = torch.empty(n_bytes // 2, dtype=torch.uint8, device=backend.device()).random_()
    dst = torch.empty_like(src)
    return timing.bandwidth_tbps(2 * src.numel(), timing.measure(lambda: dst.copy_(src)))


# (m, n, k) of the matmuls whose best rate is the ceiling: the cubes everyone quotes, and
# the 8192-wide linear layers the roofline benchmark runs at its largest batches.
MATMUL_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (1024, 8192, 8192), (2048, 8192, 8192), (4096, 8192, 8192))
MATMUL_SHAPES_CPU = ((256, 256, 256), (128, 256, 256))


@lru_cache(maxsize=None)
def matmul_tflops(dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured dense matmul rate in TFLOP/s: the best over :data:`MATMUL_SHAPES`.

    Timed as the benchmarks time their kernels, with the L2 flushed between calls, so the
    ceiling and what it bounds run under the same duty cycle. That matters: a GPU held at
    full tensor-core load draws its power limit and lowers its clock, and the flush's gap
    between calls lets it run faster, so a ceiling timed back to back would sit below
    rates the benchmarks reach. Under the interpreter: float32 at small sizes.
    """
    shapes = backend.pick(cpu=MATMUL_SHAPES_CPU, gpu=MATMUL_SHAPES)
    dt = dtype if backend.on_gpu() else torch.float32
    best = 0.0
    for m, n, k in shapes:
        a = check.randn(m, k, dtype=dt, device=backend.device(), seed=1)
        b = check.randn(k, n, dtype=dt, device=backend.device(), seed=2)
        best = max(best, timing.tflops(2 * m * n * k, timing.measure(lambda: a @ b)))
    return best


def limits() -> dict[str, float]:
    """The ceilings, keyed as benchmarks record them."""
    return {"copy_tbps": copy_bandwidth_tbps(), "read_tbps": read_bandwidth_tbps(),
            "matmul_bf16_tflops": matmul_tflops()}
