"""A simulated symmetric heap: N processing elements (PEs) in one process, with NVSHMEM's semantics.

Every PE owns a heap of the same size; :meth:`World.alloc` hands out the *same offset* on
every PE (``nvshmem_malloc`` is collective for that reason), so a PE names a peer's buffer
by its own symmetric address and the peer's number, and nobody on the other side takes part.

The programs run SPMD, one Python thread per PE, but only one thread runs at a time: a PE
runs until it must wait (``signal_wait_until``, a barrier) or ends, and the scheduler then
hands the baton to the next PE that can go on. So a run is deterministic, and a program that
can never go on fails with :class:`Deadlock` instead of hanging.

The network is where the memory model lives. A put, an atomic or a signal is *issued* at
the call and *delivered* later, in an order NVSHMEM does not promise, except that

- ``fence()`` orders a PE's deliveries to each target: everything issued before it lands
  before anything issued after it, target by target;
- ``quiet()`` delivers everything the PE has issued (remote completion);
- ``put_signal`` delivers its signal after its data;
- ``barrier_all()`` is ``quiet()`` on every PE, then everybody meets.

With ``delivery="adversarial"`` the network delivers as late as it may and, when it must
deliver something, picks signals and atomics before data and the newest first: a program
whose signal is not ordered after its data reads stale data here, as it would sometimes on
a GPU. ``delivery="eager"`` delivers every operation at once, in issue order: the
well-behaved network on which a missing fence goes unnoticed. ``"random"`` picks at random
(seeded) among what may be delivered.

A blocking ``put`` copies its source at the call (NVSHMEM lets the caller reuse the
buffer when ``put`` returns); ``put_nbi`` reads its source when it is delivered, so a
source changed before ``quiet()`` sends the new bytes, as on the real thing.
"""

from __future__ import annotations

import heapq
import queue
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..validate import check_choice, check_positive_int

DELIVERIES = ("adversarial", "eager", "random")
SIGNAL_SET, SIGNAL_ADD = "set", "add"
CMPS = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "gt": lambda a, b: a > b,
        "ge": lambda a, b: a >= b, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b}
ALIGN = 16  # bytes: every allocation starts here, so any dtype can view it
COUNTED = ("put", "put_bytes", "put_signal", "get", "get_bytes", "signal", "atomic", "fence", "quiet", "barrier",
           "wait")


class Deadlock(RuntimeError):
    """Every unfinished PE waits and the network has nothing left to deliver."""


@dataclass(frozen=True)
class SymTensor:
    """A symmetric tensor: the same ``shape``/``dtype`` at byte ``offset`` of every PE's heap."""

    world: World
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    name: str

    def on(self, pe: int) -> torch.Tensor:
        """The tensor as it lies in PE ``pe``'s heap (a view: writing it writes the heap)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        base = self.world.heaps[pe].view(self.dtype)
        return base.as_strided(self.shape, self.stride, self.offset // itemsize)

    def __getitem__(self, index: Any) -> SymTensor:
        """A symmetric view: the same index taken on every PE (``sym[3]``, ``sym[2:5]``)."""
        v = self.on(0)[index]
        offset = v.storage_offset() * v.element_size()  # the heap's storage, counted in this dtype
        return SymTensor(self.world, offset, tuple(v.shape), tuple(v.stride()), self.dtype, self.name)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(eq=False)
class _Op:
    id: int
    kind: str  # "put", "signal", "atomic"
    src: int
    dst: int
    apply: Callable[[], None]
    blockers: int = 0  # in-flight ops this one must land after
    followers: list[_Op] = field(default_factory=list)  # in-flight ops that must land after this one


class World:
    """``n_pes`` PEs, one symmetric heap of ``heap_bytes`` each, and the network between them."""

    def __init__(self, n_pes: int, heap_bytes: int = 1 << 20, *, delivery: str = "adversarial", seed: int = 0):
        check_positive_int(n_pes, "n_pes")
        check_positive_int(heap_bytes, "heap_bytes")
        check_choice(delivery, "delivery", DELIVERIES)
        self.n_pes, self.delivery = n_pes, delivery
        heap_bytes = -(-heap_bytes // ALIGN) * ALIGN
        self.heaps = [torch.zeros(heap_bytes, dtype=torch.uint8) for _ in range(n_pes)]
        self._top = 0
        self._rng = random.Random(seed)
        self._pending: dict[int, _Op] = {}  # in flight, in issue order
        # What may land now (nothing in flight that it must follow), per issuing PE: the ids, and
        # the same ops in a heap ordered by the delivery policy (entries of landed ops are
        # skipped when they surface). Picking from these keeps a run linear in its operations;
        # scanning everything in flight for each delivery made an 8-PE dispatch take half a minute.
        self._ready: list[set[int]] = [set() for _ in range(n_pes)]
        self._ready_heaps: list[list[tuple]] = [[] for _ in range(n_pes)]
        self._in_flight_from = [0] * n_pes
        self._next_id = 0
        self._fenced: list[dict[int, set[int]]] = [dict() for _ in range(n_pes)]  # pe -> dst -> ids before its fence
        self.stats = [Counter() for _ in range(n_pes)]
        self.trace: list[tuple] = []  # (pe, what, target, nbytes), in issue order
        self._arrived = [0] * n_pes
        # Called as watch(event, src, dst, kind) after every delivery ("deliver") and every
        # satisfied wait ("waited"): the chapter's animation takes its snapshots here.
        self.watch: Callable[[str, int, int, str], None] | None = None

    # -- allocation -------------------------------------------------------------------------
    def alloc(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.float32, name: str = "") -> SymTensor:
        """``nvshmem_malloc``: the same offset on every PE; zero-filled."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(s, int) or s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative ints, got {shape}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        nbytes = torch.empty(shape, dtype=dtype, device="meta").numel() * torch.empty((), dtype=dtype).element_size()
        offset = self._top
        if offset + nbytes > self.heaps[0].numel():
            raise MemoryError(f"symmetric heap of {self.heaps[0].numel()} bytes is full: {offset} used, "
                              f"{name or 'an allocation'} wants {nbytes} more")
        self._top = offset + -(-max(nbytes, 1) // ALIGN) * ALIGN
        stride = torch.empty(shape, device="meta").stride()
        return SymTensor(self, offset, shape, tuple(stride), dtype, name)

    # -- the network ------------------------------------------------------------------------
    def _issue(self, kind: str, src: int, dst: int, apply: Callable[[], None], after: set[int] = frozenset()) -> int:
        op = _Op(self._next_id, kind, src, dst, apply)
        self._next_id += 1
        for before in set(after) | self._fenced[src].get(dst, set()):
            if before in self._pending:
                self._pending[before].followers.append(op)
                op.blockers += 1
        self._pending[op.id] = op
        self._in_flight_from[src] += 1
        if self.delivery == "eager":
            self._deliver(op)  # nothing is ever in flight before it
        elif op.blockers == 0:
            self._make_ready(op)
        return op.id

    def _make_ready(self, op: _Op) -> None:
        self._ready[op.src].add(op.id)
        # adversarial: signals and atomics overtake data, newest first; eager: oldest first
        key = (op.kind == "put", -op.id) if self.delivery == "adversarial" else (op.id,)
        heapq.heappush(self._ready_heaps[op.src], (key, op.id))

    def _deliver(self, op: _Op) -> None:
        del self._pending[op.id]
        self._ready[op.src].discard(op.id)
        self._in_flight_from[op.src] -= 1
        op.apply()
        for follower in op.followers:
            follower.blockers -= 1
            if follower.blockers == 0:
                self._make_ready(follower)
        if self.watch is not None:
            self.watch("deliver", op.src, op.dst, op.kind)

    def _deliver_all(self, src: int | None = None) -> None:
        """Deliver everything in flight (from PE ``src`` only, if given), each op only after
        what it must follow; an op it waits for that another PE issued is delivered too."""
        sources = range(self.n_pes) if src is None else (src,)
        while any(self._in_flight_from[s] for s in sources):
            if any(self._ready[s] for s in sources):
                self._deliver_one(sources)
            else:  # what is left waits for another PE's op: one of any PE's lands first
                self._deliver_one()

    def _deliver_one(self, sources: Iterable[int] | None = None) -> bool:
        """Deliver one op that may land, issued by one of ``sources`` (any PE by default), as the
        delivery policy picks it; ``False`` if none may."""
        sources = range(self.n_pes) if sources is None else sources
        if self.delivery == "random":
            ready = sorted(i for s in sources for i in self._ready[s])  # in issue order, as seeded runs expect
            if not ready:
                return False
            self._deliver(self._pending[self._rng.choice(ready)])
            return True
        best = None
        for s in sources:
            heap = self._ready_heaps[s]
            while heap and heap[0][1] not in self._ready[s]:
                heapq.heappop(heap)  # landed already
            if heap and (best is None or heap[0] < self._ready_heaps[best][0]):
                best = s
        if best is None:
            return False
        self._deliver(self._pending[heapq.heappop(self._ready_heaps[best])[1]])
        return True

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- running programs -------------------------------------------------------------------
    def run(self, program: Callable[..., Any], *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``program(pe, *args, **kwargs)`` on every PE; return what each returned, in PE order."""
        ctxs = [PE(self, p) for p in range(self.n_pes)]
        baton = queue.Queue()  # what the running PE says when it stops: ("wait", pe) / ("done", pe) / ("error", ...)
        results: list[Any] = [None] * self.n_pes
        for c in ctxs:
            c._baton = baton

        def main(ctx: PE) -> None:
            ctx._go.wait()
            ctx._go.clear()
            try:
                results[ctx.my_pe] = program(ctx, *args, **kwargs)
                baton.put(("done", ctx.my_pe, None))
            except _Abort:
                pass
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                baton.put(("error", ctx.my_pe, e))

        threads = [threading.Thread(target=main, args=(c,), daemon=True) for c in ctxs]
        for t in threads:
            t.start()
        live = set(range(self.n_pes))
        turn = 0
        try:
            while live:
                runnable = [p for p in sorted(live, key=lambda p: (p - turn) % self.n_pes) if ctxs[p]._can_go()]
                if not runnable:
                    if self._deliver_one():
                        continue
                    waits = "; ".join(f"PE {p}: {ctxs[p]._waiting_for}" for p in sorted(live))
                    raise Deadlock(f"every unfinished PE waits and nothing is in flight: {waits}")
                p = runnable[0]
                turn = p + 1
                ctxs[p]._waiting = None
                ctxs[p]._go.set()
                what, who, err = baton.get(timeout=timeout_s)
                if what == "error":
                    raise err
                if what == "done":
                    live.discard(who)
            # What the PEs issued and nobody waited for lands now (nvshmem_finalize completes it);
            # until here it stayed in flight, so a PE that ended did not flush it early.
            self._deliver_all()
        finally:
            for c in ctxs:  # release any PE still parked, so its thread ends
                c._abort = True
                c._go.set()
            for t in threads:
                t.join(timeout=5)
        return results

    def totals(self) -> Counter:
        """Every PE's counts, summed: puts, bytes put, signals (``put_signal`` counts a put, a signal and
        one ``put_signal``), atomics, fences, quiets, barriers, waits."""
        total = Counter({k: 0 for k in COUNTED})
        for s in self.stats:
            total.update(s)
        return total


class _Abort(BaseException):
    pass


class PE:
    """What a program sees: its PE number, and NVSHMEM's one-sided calls (host-style names)."""

    def __init__(self, world: World, my_pe: int):
        self.world, self.my_pe, self.n_pes = world, my_pe, world.n_pes
        self._go = threading.Event()
        self._waiting: Callable[[], bool] | None = None
        self._waiting_for = ""
        self._abort = False
        self._baton: queue.Queue | None = None

    # -- scheduling -------------------------------------------------------------------------
    def _can_go(self) -> bool:
        return self._waiting is None or self._waiting()

    def _block(self, condition: Callable[[], bool], what: str) -> None:
        if condition():
            return
        self._waiting, self._waiting_for = condition, what
        # hand the baton back to World.run and park until it is ours again
        self._baton.put(("wait", self.my_pe, None))
        self._go.wait()
        self._go.clear()
        if self._abort:
            raise _Abort

    # -- local ------------------------------------------------------------------------------
    def local(self, sym: SymTensor) -> torch.Tensor:
        """This PE's copy of ``sym`` (``nvshmem_ptr`` to oneself): plain loads and stores."""
        return sym.on(self.my_pe)

    def _check(self, sym: object, target: int, name: str = "dest") -> None:
        if not isinstance(sym, SymTensor) or sym.world is not self.world:
            raise TypeError(f"{name} must be a symmetric tensor of this world (World.alloc), got {type(sym).__name__}")
        if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < self.n_pes:
            raise ValueError(f"target PE must be an int in [0, {self.n_pes}), got {target!r}")

    def _count(self, what: str, target: int, nbytes: int = 0) -> None:
        self.world.stats[self.my_pe][what] += 1
        if nbytes and what in ("put", "get"):
            self.world.stats[self.my_pe][f"{what}_bytes"] += nbytes
        self.world.trace.append((self.my_pe, what, target, nbytes))

    # -- one-sided data movement ------------------------------------------------------------
    def _put(self, dest: SymTensor, source: torch.Tensor, target: int, *, copy: bool) -> int:
        self._check(dest, target)
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"source must be a tensor, got {type(source).__name__}")
        if source.numel() != dest.numel:
            raise ValueError(f"put of {source.numel()} elements into a symmetric tensor of {dest.numel}")
        if source.dtype != dest.dtype:
            raise TypeError(f"source is {source.dtype}, dest is {dest.dtype}")
        data = source.detach().clone() if copy else source  # nbi: read at delivery
        self._count("put", target, dest.nbytes)

        def land() -> None:
            dest.on(target).copy_(data.reshape(dest.shape))
        return self.world._issue("put", self.my_pe, target, land)

    def put(self, dest: SymTensor, source: torch.Tensor, target: int) -> None:
        """``nvshmem_put``: ``source`` copied now, delivered into ``dest`` on ``target`` later."""
        self._put(dest, source, target, copy=True)

    def put_nbi(self, dest: SymTensor, source: torch.Tensor, target: int) -> None:
        """``nvshmem_put_nbi``: ``source`` must not change until ``quiet()``."""
        self._put(dest, source, target, copy=False)

    def get(self, source: SymTensor, target: int) -> torch.Tensor:
        """``nvshmem_get``: what ``source`` holds on ``target`` now (what has been delivered there)."""
        self._check(source, target, "source")
        self._count("get", target, source.nbytes)
        return source.on(target).clone()

    # -- atomics and signals ----------------------------------------------------------------
    def _amo(self, kind: str, sym: SymTensor, value: int, op: str, target: int, after: set[int] = frozenset()) -> int:
        self._check(sym, target, "signal")
        if sym.numel != 1:
            raise ValueError(f"a signal or atomic word is one element, got shape {sym.shape}")
        check_choice(op, "op", (SIGNAL_SET, SIGNAL_ADD))
        self._count(kind, target)

        def land() -> None:
            word = sym.on(target).view(-1)
            word += value if op == SIGNAL_ADD else (value - word)
        return self.world._issue(kind, self.my_pe, target, land, after)

    def atomic_add(self, dest: SymTensor, value: int, target: int) -> None:
        """``nvshmem_atomic_add`` (non-fetching): delivered like a put."""
        self._amo("atomic", dest, value, SIGNAL_ADD, target)

    def atomic_fetch_add(self, dest: SymTensor, value: int, target: int) -> int:
        """``nvshmem_atomic_fetch_add``: applied now, returns the old value."""
        self._check(dest, target)
        self._count("atomic", target)
        word = dest.on(target).view(-1)
        old = int(word[0])
        word += value
        return old

    def signal_op(self, sig: SymTensor, value: int, op: str, target: int) -> None:
        """``nvshmem_signal_op``: set or add ``value`` to the word ``sig`` on ``target``."""
        self._amo("signal", sig, value, op, target)

    def put_signal(self, dest: SymTensor, source: torch.Tensor, sig: SymTensor, value: int, op: str,
                   target: int, *, nbi: bool = False) -> None:
        """``nvshmem_putmem_signal``: the data, then the signal, which lands only after the data."""
        data_id = self._put(dest, source, target, copy=not nbi)
        self.world.stats[self.my_pe]["put_signal"] += 1
        self._amo("signal", sig, value, op, target, after={data_id})

    def signal_wait_until(self, sig: SymTensor, cmp: str, value: int) -> int:
        """``nvshmem_signal_wait_until``: wait until this PE's ``sig`` compares true with ``value``."""
        self._check(sig, self.my_pe, "signal")
        check_choice(cmp, "cmp", tuple(CMPS))
        word = sig.on(self.my_pe).view(-1)
        self._count("wait", self.my_pe)
        self._block(lambda: bool(CMPS[cmp](int(word[0]), value)),
                    f"signal {sig.name or sig.offset} {cmp} {value} (now {int(word[0])})")
        if self.world.watch is not None:
            self.world.watch("waited", self.my_pe, self.my_pe, "wait")
        return int(word[0])

    # -- ordering and synchronisation -------------------------------------------------------
    def fence(self) -> None:
        """``nvshmem_fence``: what this PE issued to a target lands before what it issues next to it."""
        self._count("fence", self.my_pe)
        fenced = self.world._fenced[self.my_pe]
        for dst in fenced:  # what has landed no longer holds anything back
            fenced[dst] = {i for i in fenced[dst] if i in self.world._pending}
        for op in self.world._pending.values():
            if op.src == self.my_pe:
                fenced.setdefault(op.dst, set()).add(op.id)

    def quiet(self, *, count: bool = True) -> None:
        """``nvshmem_quiet``: everything this PE issued has landed."""
        if count:
            self._count("quiet", self.my_pe)
        self.world._deliver_all(self.my_pe)
        self.world._fenced[self.my_pe].clear()

    def barrier_all(self) -> None:
        """``nvshmem_barrier_all``: ``quiet()``, then wait for every PE to arrive."""
        self.quiet(count=False)
        self._count("barrier", self.my_pe)
        self._meet()

    def sync_all(self) -> None:
        """``nvshmem_sync_all``: wait for every PE to arrive; nothing is completed."""
        self._count("barrier", self.my_pe)
        self._meet()

    def _meet(self) -> None:
        world = self.world
        world._arrived[self.my_pe] += 1
        mine = world._arrived[self.my_pe]
        self._block(lambda: min(world._arrived) >= mine, f"barrier {mine}")
