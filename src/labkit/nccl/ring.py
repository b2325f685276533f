"""A sliced, pipelined ring all-reduce, as a schedule and as a timeline.

NCCL runs a ring all-reduce as one kernel. The buffer is split across **channels** (each a
thread block with its own ring and its own buffers); each channel walks its part in
**rounds** of ``world_size * slice_bytes`` bytes, and each round is a whole ring all-reduce
of ``world_size`` small chunks: ``n - 1`` reduce-scatter steps and ``n - 1`` all-gather steps
(``runRing`` in NCCL's ``src/device/all_reduce.h``). Each step's chunk is cut again into
**slices** that go through a FIFO of a few slots per connection: a rank forwards slice 0 of
a step as soon as it arrives, while slice 1 is still on the wire, so the hop latency hides
behind the next slice instead of being paid at every step.

The naive ring of the collectives chapter moves each step's whole chunk (``numel / n``),
one host-driven send/receive after another, reducing in a separate pass. Both are
simulated here with the same event model, so the difference is the schedule alone.
Which chunk a rank sends at each step is :mod:`labkit.collectives.schedule`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..collectives.schedule import all_gather_step, chunk_bounds, reduce_scatter_step
from ..validate import check_positive_int


# NCCL's connection FIFO has NCCL_STEPS = 8 slots; a Simple all-reduce chunk takes
# ALLREDUCE_CHUNKSTEPS = 4 of them and a slice ALLREDUCE_SLICESTEPS = 2
# (src/include/collectives.h): two slices per chunk, four slices in flight.
FIFO_SLICES = 4
SLICES_PER_CHUNK = 2
# A Simple chunk is 4 of the 8 slots of NCCL_BUFFSIZE (4 MiB by default): 2 MiB.
SIMPLE_CHUNK_BYTES = 4 * (4 << 20) // 8


@dataclass(frozen=True)
class Send:
    """One transfer: ``src`` sends bytes ``[start, stop)`` of the buffer to ``dst`` (a slice; may be empty)."""

    channel: int
    round: int
    step: int
    slice: int
    src: int
    dst: int
    chunk: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def _check_sizes(world_size: int, nbytes: int, channels: int, chunk_bytes: int, slices_per_chunk: int) -> None:
    check_positive_int(world_size, "world_size")
    check_positive_int(nbytes, "nbytes")
    check_positive_int(channels, "channels")
    check_positive_int(chunk_bytes, "chunk_bytes")
    check_positive_int(slices_per_chunk, "slices_per_chunk")


def steps_per_round(world_size: int) -> int:
    """``2(n - 1)``: reduce-scatter then all-gather, one chunk per rank per step."""
    return 2 * (check_positive_int(world_size, "world_size") - 1)


def pipelined_ring_sends(world_size: int, nbytes: int, channels: int, chunk_bytes: int,
                         slices_per_chunk: int = SLICES_PER_CHUNK) -> list[Send]:
    """Every send of a sliced, pipelined ring all-reduce of ``nbytes``, in the order each rank issues them.

    Channel ``c`` owns the ``c``-th of ``channels`` contiguous parts (``tensor_split``'s cut);
    it processes its part in rounds of ``world_size * chunk_bytes`` bytes, each round cut into
    ``world_size`` chunks (``tensor_split`` again), and runs the ring's ``2(n - 1)`` steps on each
    round; at each step a rank sends its chunk as ``slices_per_chunk`` slices, in order.
    """
    _check_sizes(world_size, nbytes, channels, chunk_bytes, slices_per_chunk)
    n = world_size
    sends = []
    for channel, (part_start, part_stop) in enumerate(chunk_bounds(nbytes, channels)):
        round_bytes = n * chunk_bytes
        for round_index, round_start in enumerate(range(part_start, part_stop, round_bytes)):
            round_stop = min(round_start + round_bytes, part_stop)
            chunks = [(round_start + a, round_start + b) for a, b in chunk_bounds(round_stop - round_start, n)]
            for step in range(steps_per_round(n)):
                for src in range(n):
                    chunk = (reduce_scatter_step(src, step, n)[0] if step < n - 1
                             else all_gather_step(src, step - (n - 1), n)[0])
                    chunk_start, chunk_stop = chunks[chunk]
                    for piece, (a, b) in enumerate(chunk_bounds(chunk_stop - chunk_start, slices_per_chunk)):
                        sends.append(Send(channel, round_index, step, piece, src, (src + 1) % n, chunk,
                                          chunk_start + a, chunk_start + b))
    return sends


def bytes_per_link(sends: list[Send], world_size: int) -> list[int]:
    """Bytes each link ``r -> r+1`` carries, summed over channels: ``2(n-1)/n`` of the buffer each."""
    check_positive_int(world_size, "world_size")
    totals = [0] * world_size
    for s in sends:
        totals[s.src] += s.nbytes
    return totals


@dataclass(frozen=True)
class LinkModel:
    """The modelled hardware of one ring: every rank's link to its successor is alike.

    ``bandwidth_gbps`` is one direction of the link (GB/s); ``hop_latency_us`` the time from a
    send's last byte to the receiver seeing its flag; ``channel_gbps`` the most one channel (one
    thread block) drives, or ``None`` for no cap (a copy engine's transfer).
    """

    bandwidth_gbps: float
    hop_latency_us: float
    channel_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbps", "hop_latency_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    name == "bandwidth_gbps" and value == 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'bandwidth_gbps' else 'non-negative'} "
                                 f"number, got {value!r}")
        if self.channel_gbps is not None and (isinstance(self.channel_gbps, bool)
                                              or not isinstance(self.channel_gbps, (int, float))
                                              or self.channel_gbps <= 0):
            raise ValueError(f"channel_gbps must be a positive number or None, got {self.channel_gbps!r}")

    def per_channel_gbps(self, channels: int) -> float:
        """Channels share the link; each is also held to its own cap."""
        share = self.bandwidth_gbps / channels
        return share if self.channel_gbps is None else min(share, self.channel_gbps)


@dataclass(frozen=True)
class Timed:
    send: Send
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Timeline:
    sends: list[Timed]
    finish_us: float
    max_in_flight: int  # the most sends of one connection sent and not yet consumed by the receiver

    def busy_fraction(self, world_size: int) -> float:
        """How much of ``finish_us`` the busiest link spends sending (1.0: never idle)."""
        busy: dict[tuple[int, int], float] = {}
        for t in self.sends:  # channels share the link, each at its share of the bandwidth
            key = (t.send.channel, t.send.src)
            busy[key] = busy.get(key, 0.0) + t.end_us - t.start_us
        return max(busy.values(), default=0.0) / self.finish_us if self.finish_us else 0.0


def simulate(sends: list[Send], world_size: int, link: LinkModel, *, channels: int = 1,
             fifo_depth: int = FIFO_SLICES, step_overhead_us: float = 0.0,
             reduce_gbps: float | None = None) -> Timeline:
    """Time ``sends`` (from :func:`pipelined_ring_sends`) on ``link``: an event model.

    A slice starts when its link (of its channel) is free, its data is ready and the receiver
    has a free FIFO slot. Data is ready at once at step 0, else when the predecessor's same
    slice of the step before has arrived (plus, with ``reduce_gbps``, an unfused reduction pass
    over it in the reduce-scatter steps; ``None``: the reduction is fused into the copy, as in
    NCCL). The FIFO holds ``fifo_depth`` slices; a slot frees when the receiver forwards the
    slice it holds, or at once at the last step. ``step_overhead_us`` is paid before each
    step: a host-driven ring launches and syncs every step; NCCL's one kernel does not.
    """
    check_positive_int(world_size, "world_size")
    check_positive_int(channels, "channels")
    if reduce_gbps is not None and (isinstance(reduce_gbps, bool) or not isinstance(reduce_gbps, (int, float))
                                    or reduce_gbps <= 0):
        raise ValueError(f"reduce_gbps must be a positive number or None (reduction fused), got {reduce_gbps!r}")
    n, last_step = world_size, steps_per_round(world_size) - 1
    m = max((s.slice for s in sends), default=0) + 1  # slices per chunk
    if isinstance(fifo_depth, bool) or not isinstance(fifo_depth, int) or fifo_depth <= m:
        raise ValueError(f"fifo_depth must be an int above the {m} slices of a chunk (with fewer slots, every rank "
                         f"waits for its successor to forward, all around the ring: a deadlock), got {fifo_depth!r}")
    # Per (channel, rank): the sends in issue order, (round, step, slice); index k - m is the same
    # slice one step earlier, k + m the same slice one step later.
    queues: dict[tuple[int, int], list[Send]] = {}
    for s in sends:
        if not 0 <= s.src < n or s.dst != (s.src + 1) % n:
            raise ValueError(f"a send must go from a rank in [0, {n}) to its ring successor, got {s}")
        queues.setdefault((s.channel, s.src), []).append(s)
    used_channels = sorted({c for c, _ in queues})
    lengths = {len(q) for q in queues.values()}
    if len(lengths) > 1 or len(queues) != n * len(used_channels):
        raise ValueError("every rank of every channel must issue the same number of sends")
    sends_per_rank = lengths.pop() if lengths else 0
    gbps = link.per_channel_gbps(channels)
    start: dict[tuple[int, int, int], float] = {}
    arrive: dict[tuple[int, int, int], float] = {}
    freed: dict[tuple[int, int, int], float] = {}  # when the receiver gives back the slot of send k
    timed = []
    for channel in used_channels:
        link_free = [0.0] * n
        for k in range(sends_per_rank):
            for r in range(n):
                s, pred = queues[(channel, r)][k], (r - 1) % n
                ready = 0.0
                if s.step > 0:
                    ready = arrive[(channel, pred, k - m)]
                    if reduce_gbps is not None and s.step <= n - 1:  # what just came in is reduced first
                        ready += queues[(channel, pred)][k - m].nbytes / (reduce_gbps * 1e3)
                slot = freed[(channel, r, k - fifo_depth)] if k >= fifo_depth else 0.0
                begin = max(link_free[r], ready, slot) + (step_overhead_us if s.slice == 0 else 0.0)
                end = begin + s.nbytes / (gbps * 1e3)
                start[(channel, r, k)], arrive[(channel, r, k)] = begin, end + link.hop_latency_us
                link_free[r] = end
                timed.append(Timed(s, begin, end))
            for r in range(n):  # the predecessor's slices are consumed as this rank forwards them
                pred = (r - 1) % n
                if queues[(channel, pred)][k].step == last_step:
                    freed[(channel, pred, k)] = arrive[(channel, pred, k)]
                if k >= m:
                    freed[(channel, pred, k - m)] = start[(channel, r, k)]
    in_flight = max((sum(1 for j in range(max(0, k - fifo_depth), k + 1)
                         if start[(c, r, j)] <= start[(c, r, k)] < freed[(c, r, j)])
                     for (c, r, k) in start), default=0)
    return Timeline(timed, max(arrive.values(), default=0.0), in_flight)


def naive_ring(world_size: int, nbytes: int, link: LinkModel, *, step_overhead_us: float,
               reduce_gbps: float, fifo_depth: int = FIFO_SLICES) -> Timeline:
    """The host-driven ring: one round of whole chunks, a launch per step, reduction unfused."""
    whole = -(-nbytes // world_size)
    return simulate(pipelined_ring_sends(world_size, nbytes, 1, whole, slices_per_chunk=1), world_size,
                    LinkModel(link.bandwidth_gbps, link.hop_latency_us), channels=1, fifo_depth=fifo_depth,
                    step_overhead_us=step_overhead_us, reduce_gbps=reduce_gbps)


def pipelined_ring(world_size: int, nbytes: int, link: LinkModel, *, channels: int, chunk_bytes: int,
                   slices_per_chunk: int = SLICES_PER_CHUNK, fifo_depth: int = FIFO_SLICES) -> Timeline:
    """NCCL's way: one kernel (no per-step host cost), slices through a FIFO, reduction fused into the copy."""
    return simulate(pipelined_ring_sends(world_size, nbytes, channels, chunk_bytes, slices_per_chunk), world_size,
                    link, channels=channels, fifo_depth=fifo_depth)
