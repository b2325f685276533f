"""What each rank runs: the checks and the timing sweeps, as module-level functions.

:func:`labkit.collectives.launch.run` starts new processes that import the function they
run, so the programs live here (a function defined in a notebook cannot be imported by
another process). The same functions serve the tests, the chapter, the benchmarks and
the torchrun command line.
"""

from __future__ import annotations

import hashlib
import statistics

import torch
import torch.distributed as dist

from .. import backend, check, timing
from ..validate import dtype_name
from . import (cost, launch, recursive_doubling_all_reduce, reference, ring_all_gather, ring_all_reduce,
               ring_reduce_scatter, schedule, shard_numel)

DTYPES = {dtype_name(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)}


def _device() -> torch.device:
    return launch.device_for(dist.get_backend())


def rank_input(numel: int, dtype: torch.dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: fresh random numbers (integers for integer dtypes), on the CPU.

    Every rank can build every other rank's input, so each computes the float64 sum itself.
    """
    if numel == 0:  # a shard of fewer elements than ranks
        return torch.empty(0, dtype=dtype)
    if dtype.is_floating_point:
        return check.randn(numel, dtype=dtype, seed=1000 * seed + rank)
    gen = check.make_generator(1000 * seed + rank, "cpu")
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)


def digest(t: torch.Tensor) -> str:
    """A fingerprint of a tensor's bits: ranks that agree bit for bit have equal digests."""
    return hashlib.sha1(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _compare(collective: str, algorithm: str, numel: int, ours: torch.Tensor, peer: torch.Tensor,
             exact: torch.Tensor, conditioning: float | None) -> dict:
    """Check ``ours`` against torch's result and the float64 one.

    Sums are checked at the dtype's tolerance times the sum's condition number
    ``||sum |x_i| || / ||sum x_i||``: when the ranks' values cancel, rounding errors of
    the partial sums are large against the result, whoever adds them up in whichever
    order. Integer sums and all-gathers (copies) must match exactly
    (``conditioning=None``).
    """
    dtype = ours.dtype
    exact_match = conditioning is None or not dtype.is_floating_point
    tol = 0.0 if exact_match else check.tolerance(dtype) * max(1.0, conditioning)
    label = f"{collective} ({algorithm}) numel={numel} {dtype_name(dtype)} rank {dist.get_rank()}"
    vs_torch = check.assert_close(ours.cpu(), peer.cpu(), tol=tol, name=f"{label} vs torch.distributed")
    vs_exact = check.assert_close(ours.cpu(), exact, tol=tol, name=f"{label} vs float64")
    return {"collective": collective, "algorithm": algorithm, "numel": numel, "dtype": dtype_name(dtype),
            "world_size": dist.get_world_size(), "tolerance": tol, "err_vs_torch": vs_torch.rel_error,
            "err_vs_float64": vs_exact.rel_error, "digest": digest(ours)}


def _conditioning(inputs: list[torch.Tensor], part: slice = slice(None)) -> float:
    stacked = torch.stack([x.to(torch.float64) for x in inputs])[:, part]
    if stacked.numel() == 0:  # an empty shard: nothing to round
        return 1.0
    denom = torch.linalg.vector_norm(stacked.sum(0)).item()
    return torch.linalg.vector_norm(stacked.abs().sum(0)).item() / denom if denom else float("inf")


def verify(numels: list[int], dtype_names: list[str], seed: int = 0) -> list[dict]:
    """Check every collective against torch.distributed's and a float64 sum; one row per case.

    Raises :class:`labkit.check.CheckFailed` on the first mismatch. Outputs of
    reduce-scatter and all-gather start poisoned, so an element never written fails.
    """
    n, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    rows = []
    for name in dtype_names:
        dtype = DTYPES[name]
        for numel in numels:
            inputs = [rank_input(numel, dtype, seed, r) for r in range(n)]
            exact = reference.sum_float64(inputs)
            mine = inputs[rank].to(device)
            peer = reference.torch_all_reduce(mine.clone())
            for algorithm, fn in ALL_REDUCES.items():
                rows.append(_compare("all_reduce", algorithm, numel, fn(mine.clone()), peer, exact,
                                     _conditioning(inputs)))
            empty = check.empty_poisoned
            shard = (shard_numel(numel, n, rank),)
            out = empty(shard, dtype, device)
            peer_out = torch.empty(shard, dtype=dtype, device=device)
            ring_reduce_scatter(out, mine)
            reference.torch_reduce_scatter(peer_out, mine)
            assert torch.equal(mine.cpu(), inputs[rank]), "reduce-scatter must leave its input as it was"
            start, stop = schedule.chunk_bounds(numel, n)[rank]
            rows.append(_compare("reduce_scatter", "ring", numel, out, peer_out, exact[start:stop],
                                 _conditioning(inputs, slice(start, stop))))

            shards = [rank_input(shard_numel(numel, n, r), dtype, seed + 1, r) for r in range(n)]
            out = empty((numel,), dtype, device)
            peer_out = torch.empty((numel,), dtype=dtype, device=device)
            ring_all_gather(out, shards[rank].to(device))
            reference.torch_all_gather(peer_out, shards[rank].to(device))
            rows.append(_compare("all_gather", "ring", numel, out, peer_out, torch.cat(shards).to(torch.float64),
                                 None))
    return rows


ALL_REDUCES = {"ring": ring_all_reduce, "recursive doubling": recursive_doubling_all_reduce}


def all_reduce_results(numel: int, dtype: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each of our all-reduces of this rank's :func:`rank_input`, returned for the caller to check."""
    x = rank_input(numel, DTYPES[dtype], seed, dist.get_rank()).to(_device())
    return {name: fn(x.clone()) for name, fn in ALL_REDUCES.items()}


def reduce_scatter_bitmasks(numel: int) -> list[int]:
    """Ring reduce-scatter of ``1 << rank`` everywhere: each element of the result is the set
    of ranks whose data reached it, as bits (the tests compare it with the schedule's simulation)."""
    rank, device = dist.get_rank(), _device()
    x = torch.full((numel,), 1 << rank, dtype=torch.int64, device=device)
    out = torch.empty(shard_numel(numel, dist.get_world_size(), rank), dtype=torch.int64, device=device)
    return ring_reduce_scatter(out, x).cpu().tolist()


IMPLEMENTATIONS = {
    "all_reduce": {
        "ours: ring": lambda out, inp: ring_all_reduce(out),
        "ours: recursive doubling": lambda out, inp: recursive_doubling_all_reduce(out),
        "torch.distributed": lambda out, inp: reference.torch_all_reduce(out),
    },
    "reduce_scatter": {
        "ours: ring": lambda out, inp: ring_reduce_scatter(out, inp),
        "torch.distributed": lambda out, inp: reference.torch_reduce_scatter(out, inp),
    },
    "all_gather": {
        "ours: ring": lambda out, inp: ring_all_gather(out, inp),
        "torch.distributed": lambda out, inp: reference.torch_all_gather(out, inp),
    },
}
ALGORITHM_OF = {("all_reduce", "ours: ring"): "ring_all_reduce",
                ("all_reduce", "ours: recursive doubling"): "recursive_doubling_all_reduce",
                ("all_reduce", "torch.distributed"): "ring_all_reduce",
                ("reduce_scatter", "ours: ring"): "ring_reduce_scatter",
                ("reduce_scatter", "torch.distributed"): "ring_reduce_scatter",
                ("all_gather", "ours: ring"): "ring_all_gather",
                ("all_gather", "torch.distributed"): "ring_all_gather"}


def _buffers_numel(n_bytes: int, n: int) -> int:
    # float32, with the element count a multiple of n so torch's tensor forms apply as they are
    return max(n, (n_bytes // 4) // n * n)


def _buffers(collective: str, n_bytes: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Zeros, not random data: all-reduce is in place, and repeated sums of random data
    # overflow; the time of moving bytes does not depend on their values.
    numel = _buffers_numel(n_bytes, n)
    full = torch.zeros(numel, dtype=torch.float32, device=device)
    shard = torch.zeros(numel // n, dtype=torch.float32, device=device)
    if collective == "all_reduce":
        return full, full
    if collective == "reduce_scatter":
        return shard, full
    return full, shard


def _point_ms(t: timing.Timing) -> float:
    """One round's time. A wall clock on shared cores also counts the slices a rank sat
    descheduled (whole scheduler ticks, milliseconds), which only ever add: there the
    round keeps its 20th percentile. CUDA events time the GPU, and keep the median."""
    return t.median_ms if t.method == timing.CUDA_EVENTS else t.p20_ms


def sweep(sizes_bytes: list[int], reps: int | None = None, rounds: int | None = None) -> list[dict]:
    """Time every implementation of every collective at each size; one row per (collective, impl, size).

    The sweep runs ``rounds`` times over every (collective, size, impl) in turn, each time
    with :func:`labkit.timing.measure` (CUDA events on a GPU, a wall clock on the CPU), and a
    point is the median over rounds. Interleaving matters on shared CPU cores, where
    scheduler stalls come in runs of many consecutive calls: a run then spoils one round
    of a point instead of all of its repetitions. The row keeps the
    slowest rank's time: a collective is done when its last rank is. Rows are the same on
    every rank. With one rank, reduce-scatter and all-gather are copies and all-reduce is
    nothing at all, so it is left out.
    """
    n, device = dist.get_world_size(), _device()
    rounds = default_rounds(dist.get_backend()) if rounds is None else rounds
    if reps is None and n > 1:
        reps = backend.pick(cpu=3, gpu=100)  # measure would size it from each rank's own estimate: ranks that differ hang
    points = [(collective, n_bytes, impl) for collective, impls in IMPLEMENTATIONS.items()
              if not (n == 1 and collective == "all_reduce")  # nothing to move or add: no time to measure
              for n_bytes in sizes_bytes for impl in impls]
    per_round: dict[tuple, list[float]] = {p: [] for p in points}
    for _ in range(rounds):
        for collective, n_bytes, impl in points:
            out, inp = _buffers(collective, n_bytes, n, device)
            fn = IMPLEMENTATIONS[collective][impl]
            t = timing.measure(lambda: fn(out, inp), reps=reps, flush_l2=False)
            per_round[(collective, n_bytes, impl)].append(_point_ms(t))
            method = t.method  # every point is timed the same way
    medians = torch.tensor([statistics.median(per_round[p]) for p in points], dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    rows = []
    for (collective, n_bytes, impl), ms in zip(points, medians.tolist()):
        if ms <= 0:
            continue  # below the timer's resolution: no honest bandwidth to report
        size, seconds = _buffers_numel(n_bytes, n) * 4, ms / 1e3
        rows.append({"collective": collective, "impl": impl, "bytes": size, "world_size": n,
                     "time_ms": ms, "algbw_gbps": cost.algbw_gbps(size, seconds),
                     "busbw_gbps": cost.busbw_gbps(collective, size, seconds, n),
                     "timing": method})
    return rows


def default_rounds(backend_name: str) -> int:
    """Rounds of a sweep: five on gloo, whose wall clock counts scheduler stalls; one under
    NCCL, whose CUDA events do not (and which times many repetitions a point)."""
    return 5 if backend_name == "gloo" else 1


def default_sweep_sizes(backend_name: str | None = None) -> list[int]:
    """The sizes to sweep for ranks on ``backend_name`` (default: the device's backend).

    gloo (CPU processes): 16 KB and 128 KB, then 1 MB to 8 MB by twos, so that four sizes
    fall where the fit goal holds the model and a sweep takes seconds. NCCL: 1 KB to 1 GB
    by twos.
    """
    backend_name = launch.default_backend() if backend_name is None else backend_name
    if backend_name == "gloo":
        return [2**k for k in (14, 17, 20, 21, 22, 23)]
    return [2**k for k in range(10, 31)]
