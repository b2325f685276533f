"""The memory chapter's operations: copy, vector add and a strided read, as Triton kernels.

These are the three smallest programs that say something about a GPU's memory system:
a copy moves bytes and does nothing else, so its speed *is* the memory bandwidth a kernel
can reach; vector add is the simplest kernel with arithmetic in it (one FLOP per 12 bytes
in fp32); a strided read keeps the bytes written fixed while spreading the reads apart,
which shows what uncoalesced access costs.

Every function checks its arguments (:mod:`labkit.validate`) before launching, because a
kernel handed the wrong tensor reads past a buffer instead of failing. ``out=`` lets a
benchmark reuse one output buffer, as ``torch.Tensor.copy_`` does, so that timing measures
the kernel and not the allocator.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import backend, validate
from . import kernels
from .kernels import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_WARPS
from .occupancy import compiled_registers
from .occupancy import occupancy as occupancy_of  # the name `occupancy` stays the submodule's

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_NUM_WARPS", "READ_DTYPES", "SUPPORTED_DTYPES",
    "copy", "pointer_chase", "random_cycle", "read_sum", "resident_programs", "strided_read", "vector_add",
]

SUPPORTED_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
)
READ_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what read_sum sums (in float32)
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16, 32)  # a CUDA block holds at most 1024 threads = 32 warps
# A program keeps its block in registers. 2**16 four-byte elements is 256 KiB, an H200 SM's
# whole register file; beyond that a block cannot even be resident, let alone fast.
MAX_BLOCK_SIZE = 2**16


def _check_launch(block_size: object, num_warps: object) -> None:
    validate.check_power_of_two(block_size, "block_size")
    if block_size > MAX_BLOCK_SIZE:  # type: ignore[operator]
        raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE}, got {block_size}")
    if isinstance(num_warps, bool) or not isinstance(num_warps, int):
        raise TypeError(f"num_warps must be an int, got {type(num_warps).__name__}")
    validate.check_choice(num_warps, "num_warps", NUM_WARPS_CHOICES)


def _check_input(x: object, name: str, *, ndim: int | None = None) -> torch.Tensor:
    return validate.check_tensor(
        x, name, ndim=ndim, dtypes=SUPPORTED_DTYPES, device=backend.device(), contiguous=True
    )


def _check_same(reference: torch.Tensor, other: torch.Tensor, ref_name: str, name: str, *, shape: tuple[int, ...]) -> None:
    if other.dtype != reference.dtype:
        raise TypeError(
            f"{name} must have the dtype of {ref_name} ({validate.dtype_name(reference.dtype)}), "
            f"got {validate.dtype_name(other.dtype)}"
        )
    validate.check_same_device(**{ref_name: reference, name: other})
    if tuple(other.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(other.shape)}")


def _output(out: object, like: torch.Tensor, shape: tuple[int, ...], like_name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    out = _check_input(out, "out")
    _check_same(like, out, like_name, "out", shape=shape)
    return out


def copy(
    x: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """A copy of ``x`` (into ``out`` if given) made by :func:`kernels.copy_kernel`."""
    x = _check_input(x, "x")
    _check_launch(block_size, num_warps)
    out = _output(out, x, tuple(x.shape), "x")
    kernels.launch_copy(x, out, block_size, num_warps)
    return out


def vector_add(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """``x + y`` elementwise (into ``out`` if given), by :func:`kernels.vector_add_kernel`."""
    x = _check_input(x, "x")
    y = _check_input(y, "y")
    _check_same(x, y, "x", "y", shape=tuple(x.shape))
    _check_launch(block_size, num_warps)
    out = _output(out, x, tuple(x.shape), "x")
    kernels.launch_vector_add(x, y, out, block_size, num_warps)
    return out


def strided_read(
    x: torch.Tensor,
    stride: int,
    *,
    out: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """``x[::stride]`` of a 1-D tensor as a new contiguous tensor, by :func:`kernels.strided_read_kernel`.

    Reading a column of a row-major ``(rows, cols)`` matrix is this with ``stride = cols``.
    """
    x = _check_input(x, "x", ndim=1)
    validate.check_positive_int(stride, "stride")
    _check_launch(block_size, num_warps)
    n_out = -(-x.numel() // stride)
    out = _output(out, x, (n_out,), "x")
    kernels.launch_strided_read(x, out, stride, block_size, num_warps)
    return out


@lru_cache(maxsize=None)
def resident_programs(dtype: torch.dtype, block_size: int, num_warps: int) -> int:
    """How many programs of :func:`kernels.read_kernel` the whole GPU holds at once.

    SMs times the programs one SM holds (:func:`labkit.memory.occupancy.occupancy`, from
    the compiled kernel's registers). :func:`read_sum` launches no more than this, so
    every program is resident from the start and none waits for another to finish (a
    late wave would run alone and halve the rate). Under the interpreter: 4.
    """
    if not backend.on_gpu():
        return 4
    probe = torch.empty(1, dtype=dtype, device="cuda")
    # Sizes that specialize as the timed launches do (Triton compiles a variant for ints
    # equal to 1 and for multiples of 16); nothing is launched, so nothing is read.
    compiled = kernels.read_kernel.warmup(probe, probe.float(), 2**20, 2, BLOCK_SIZE=block_size,
                                          num_warps=num_warps, num_stages=kernels.READ_NUM_STAGES, grid=(1,))
    registers = compiled_registers(compiled)[0]
    per_sm = occupancy_of(registers, num_warps, int(compiled.metadata.shared)).blocks_per_sm
    return backend.sm_count(torch.device("cuda", 0)) * per_sm


def read_sum(
    x: torch.Tensor,
    *,
    passes: int = 1,
    out: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """Per-program partial sums (float32) of ``x``, read ``passes`` times, by :func:`kernels.read_kernel`.

    The result's sum is ``passes * x.sum()``. The kernel exists to be timed: it only reads,
    so its rate is the read bandwidth (bytes read: ``passes * x.nbytes``). ``out``, if
    given, is a float32 vector with one element per program; otherwise one is allocated,
    with as many programs as are resident at once (:func:`resident_programs`), never more
    than there are blocks.
    """
    x = validate.check_tensor(x, "x", dtypes=READ_DTYPES, device=backend.device(), contiguous=True)
    validate.check_positive_int(passes, "passes")
    _check_launch(block_size, num_warps)
    if out is None:
        programs = min(-(-x.numel() // block_size), resident_programs(x.dtype, block_size, num_warps))
        out = torch.empty(programs, dtype=torch.float32, device=x.device)
    else:
        out = validate.check_tensor(out, "out", ndim=1, dtypes=(torch.float32,), device=backend.device(),
                                    contiguous=True)
    kernels.launch_read(x, out, passes, block_size, num_warps)
    return out


def random_cycle(working_set_bytes: int, *, node_bytes: int = 128, seed: int = 0) -> torch.Tensor:
    """A table for :func:`pointer_chase`: one random cycle through ``working_set_bytes``.

    The table is int64 with one node every ``node_bytes`` (128 by default: one node per
    cache line, so every hop touches a line of its own). Node ``i``'s element holds the
    element index of the node after it, in a random order that visits every node once
    before it returns: a random permutation, linked in its own order, leaves no pattern
    for a prefetcher and no shorter loop that would shrink the working set.
    """
    validate.check_positive_int(working_set_bytes, "working_set_bytes")
    validate.check_power_of_two(node_bytes, "node_bytes")
    if node_bytes < 8:
        raise ValueError(f"node_bytes must be at least 8 (one int64 link), got {node_bytes}")
    if working_set_bytes % node_bytes:
        raise ValueError(f"working_set_bytes must be a multiple of node_bytes ({node_bytes}), got {working_set_bytes}")
    stride = node_bytes // 8
    n_nodes = working_set_bytes // node_bytes
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_nodes, generator=generator).to(backend.device()) * stride
    table = torch.zeros(working_set_bytes // 8, dtype=torch.int64, device=backend.device())
    table[order] = order.roll(-1)  # each node in the order points at the next; the last at the first
    return table


def pointer_chase(table: torch.Tensor, state: torch.Tensor, hops: int) -> torch.Tensor:
    """Follow ``hops`` links of ``table`` from ``state[0]`` by :func:`kernels.pointer_chase_kernel`.

    ``state`` (int64, one element) holds the start and receives the end, so successive
    calls walk on around the cycle. Returns ``state``. Every link must be a valid index
    of ``table`` (:func:`random_cycle` makes such tables); the kernel cannot check that
    without adding work to the chain it times.
    """
    table = validate.check_tensor(table, "table", ndim=1, dtypes=(torch.int64,), device=backend.device(),
                                  contiguous=True)
    state = validate.check_tensor(state, "state", ndim=1, dtypes=(torch.int64,), device=backend.device())
    validate.check_same_device(table=table, state=state)
    if state.numel() != 1:
        raise ValueError(f"state must hold exactly one index, got shape {tuple(state.shape)}")
    validate.check_positive_int(hops, "hops")
    kernels.launch_pointer_chase(table, state, hops)
    return state
