"""Timing: CUDA events on a GPU; labelled wall-clock under the interpreter.

On a GPU a kernel launch returns before the kernel finishes, so host clocks time the
launch, not the work. CUDA events are recorded into the stream around each call and
read after a synchronize. We report the median over many repetitions after a warm-up
(which absorbs compilation and autotuning) and, by default, empty the L2 cache between
repetitions: otherwise a 16 MB input that fits in the 50-60 MB L2 is "read" at L2
speed and the kernel looks faster than HBM allows. Benchmarks that *want* cache effects
(the L2 knee in chapter 1) pass ``flush_l2=False``, or rotate among several inputs.

The flush *reads* a buffer several times the L2 (a sum over it) rather than writing
one. A write leaves the L2 full of dirty lines, and the timed kernel's first reads must
write them back to HBM before they can use the space: in one unrecorded test on an H200
that added several microseconds to every call, a large share of a batch-1 GEMV. Summing int32 into int64 is slow (about 0.4 ms of GPU time for the
256 MB), and that helps: the host has that long to enqueue the timed call, so Python
launch overhead shorter than the flush stays out of the timing, as it stays out of a
server's captured CUDA graph. These benchmarks time kernels, not launches.

Without a flush, nothing would hold the GPU while the host prepares the next call: the
start event would fire at once and the timing would include Python's launch overhead
(tens of microseconds for a Triton launch, which made every small copy look the same
length). So with ``flush_l2=False`` a spin-wait kernel (``torch.cuda._sleep``, which
touches no memory and leaves the L2 as it was) runs before each start event instead,
long enough for the host to enqueue the timed call behind it.

On the CPU the same call times the interpreter with a wall clock. That number says how
long the notebook waits; it says nothing about GPU speed, and is labelled so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import backend

CUDA_EVENTS = "cuda-events"
INTERPRETER_WALL_CLOCK = "interpreter-wall-clock"

_L2_FLUSH_BYTES = 256 * 2**20  # several times any current GPU's L2
# GPU clock cycles the spin-wait runs when there is no flush: 2**18 cycles is over a
# hundred microseconds at any clock up to the H200's 1.98 GHz maximum (nvidia-smi), longer
# than a Triton launch from Python takes on the host.
_HEAD_START_CYCLES = 2**18


@dataclass(frozen=True)
class Timing:
    """Median and spread of repeated runs, in milliseconds, and how they were taken."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    method: str

    @property
    def is_performance(self) -> bool:
        return self.method == CUDA_EVENTS

    @property
    def seconds(self) -> float:
        return self.median_ms / 1e3

    def __str__(self) -> str:
        label = "" if self.is_performance else " (interpreter wall-clock, not GPU performance)"
        return f"{self.median_ms:.4g} ms median of {self.reps}{label}"


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _summarize(samples_ms: list[float], method: str) -> Timing:
    s = sorted(samples_ms)
    return Timing(statistics.median(s), _quantile(s, 0.2), _quantile(s, 0.8), len(s), method)


def measure(
    fn: Callable[..., object],
    *arg_sets: tuple,
    warmup: int = 5,
    reps: int | None = None,
    target_ms: float = 200.0,
    flush_l2: bool = True,
) -> Timing:
    """Time ``fn``; with ``arg_sets`` given, call ``fn(*args)`` rotating through them.

    Rotation lets a benchmark defeat caches without flushing: pass enough copies of the
    inputs that together they exceed the L2. With no ``arg_sets``, ``fn()`` is called.
    On a GPU the number of repetitions is chosen to fill about ``target_ms`` (at least 10,
    at most 1000) unless ``reps`` is given; under the interpreter it is 3 unless given.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for i, args in enumerate(arg_sets):
        if not isinstance(args, tuple):
            raise TypeError(f"arg_sets[{i}] must be a tuple of arguments, got {type(args).__name__}")
    calls = [(lambda a=a: fn(*a)) for a in arg_sets] or [fn]
    if backend.on_gpu():
        return _measure_cuda(calls, warmup, reps, target_ms, flush_l2)
    return _measure_wall(calls, reps if reps is not None else 3)


def _measure_wall(calls: list[Callable[[], object]], reps: int) -> Timing:
    calls[0]()  # the first call of a kernel pays for tracing; keep it out of the numbers
    samples = []
    for i in range(reps):
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarize(samples, INTERPRETER_WALL_CLOCK)


def _measure_cuda(
    calls: list[Callable[[], object]],
    warmup: int,
    reps: int | None,
    target_ms: float,
    flush_l2: bool,
) -> Timing:
    flush = torch.zeros(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    for i in range(max(warmup, 1)):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    if reps is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(3):
            calls[i % len(calls)]()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 3, 1e-3)
        reps = int(min(1000, max(10, target_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.sum()  # a read: the L2 is left holding clean lines of this buffer
        else:
            torch.cuda._sleep(_HEAD_START_CYCLES)  # the host's head start, without touching the L2
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return _summarize([s.elapsed_time(e) for s, e in zip(starts, ends)], CUDA_EVENTS)


def bandwidth_tbps(bytes_moved: float, timing: Timing) -> float:
    """Bytes read plus bytes written per second, in TB/s (1e12), over the median time."""
    return bytes_moved / timing.seconds / 1e12


def tflops(flops: float, timing: Timing) -> float:
    return flops / timing.seconds / 1e12


# GPU clock cycles the spin-wait holds the GPU for while host_ms issues its calls: 2**27 is
# about 68 ms at the H200's 1.98 GHz maximum clock, longer than the host takes to issue the
# few calls host_ms asks for of anything it times.
_HOLD_CYCLES = 2**27


def host_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """The host's milliseconds to issue one ``fn()``: Python, the framework's dispatch, the
    launchers, with the GPU held busy by a spin-wait queued first, so that no call waits for
    the GPU and the GPU's own time stays out. Where this exceeds the GPU time of the same call
    (:func:`measure`), the host bounds it: the GPU waits for launches. Raises if the spin-wait
    ended before the host had issued every call (``fn`` waited for the GPU: it synchronizes,
    or reads a value back). Under the interpreter, the wall time of a call (there is no
    asynchrony to separate)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be a positive int, got {reps!r}")
    fn()  # compilation, autotuning and caches stay out
    if not backend.on_gpu():
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize()
    torch.cuda._sleep(_HOLD_CYCLES)
    held = torch.cuda.Event()
    held.record()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    waited = held.query()  # the spin-wait already over: a call may have waited for the GPU
    torch.cuda.synchronize()
    if waited:
        raise RuntimeError(f"the GPU's spin-wait ended before the host had issued {reps} calls "
                           f"({elapsed * 1e3:.1f} ms): fn waits for the GPU (a synchronize or a read-back), "
                           "or reps is too many to issue under the hold")
    return elapsed * 1e3 / reps


def timed_call(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()``'s result and its wall milliseconds, the device idle before and drained after: for
    work that reads back to the host as it goes (a whole generation), where events add nothing."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if backend.on_gpu():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if backend.on_gpu():
        torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3
