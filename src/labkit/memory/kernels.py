"""Triton kernels of the memory chapter, and the launchers that call them.

Each kernel is one idea: a program instance (one "program") owns ``BLOCK_SIZE``
consecutive elements, loads them, and stores them. Three things make that fast on a GPU:

- *Contiguous offsets.* ``block_start + tl.arange(0, BLOCK_SIZE)`` tells the compiler that
  neighbouring threads touch neighbouring addresses, so it emits 16-byte vector loads
  and stores and a warp's accesses coalesce into whole 32-byte sectors.
- *Enough bytes in flight.* HBM answers a request after several hundred nanoseconds; to keep
  4+ TB/s moving, every SM must have tens of kilobytes requested at once. A block of a
  few thousand elements per program, several programs resident per SM, does that.
- *A masked tail.* The last program may run past ``n_elements``; the mask turns those
  lanes' loads and stores off, so any size works without padding. Triton vectorizes a
  masked access only where it can prove the mask constant over each 16-byte group,
  which it can when ``n_elements`` is a multiple of 16 (it compiles a variant for such
  sizes). Other sizes run with element-wide accesses: still coalesced, somewhat slower.

Offsets are computed in int64: a tensor of 2**31 or more elements (8 GiB of fp32 is
2**31) would overflow int32 index arithmetic and read the wrong addresses. Liger-Kernel
casts ``program_id`` the same way. The cost is negligible: addresses are 64-bit anyway.

The launchers take tensors the caller has already validated (see :mod:`labkit.memory`)
and return the compiled kernel, whose register count the occupancy benchmark reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The defaults the public functions use: 16 elements per thread (four 16-byte vectors
# of fp32) and 8 warps, so a program reads 16 KiB of fp32 and an SM has warp slots for 8.
DEFAULT_BLOCK_SIZE = 4096
DEFAULT_NUM_WARPS = 8
# The read kernel's loop is not software-pipelined: a program's 16 KiB block already puts
# enough loads in flight, and pipelining would stage blocks in shared memory, which would
# change how many programs an SM holds (memory.resident_programs counts on none).
READ_NUM_STAGES = 1


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """``dst[i] = src[i]``: the fastest a memory-bound kernel can be."""
    block_start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    values = tl.load(src_ptr + offsets, mask=mask)
    tl.store(dst_ptr + offsets, values, mask=mask)


@triton.jit
def vector_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr,
                      COMPUTE_DTYPE: tl.constexpr = None):
    """``out[i] = x[i] + y[i]``: two reads and a write per element, one FLOP.

    With ``COMPUTE_DTYPE`` set (the launcher sets fp32 for 16-bit floats, see
    :func:`compute_dtype`), the sum is formed in it and rounded once on the store, as
    torch does. That also keeps the kernel right under Triton's interpreter, which holds
    bf16 as raw ``uint16`` and would add the bit patterns. On the GPU the conversions
    are free: the kernel waits on memory, not on arithmetic.
    """
    block_start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    if COMPUTE_DTYPE is not None:  # decided when the kernel compiles, not per element
        x = x.to(COMPUTE_DTYPE)
        y = y.to(COMPUTE_DTYPE)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def strided_read_kernel(src_ptr, dst_ptr, n_out, STRIDE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """``dst[i] = src[i * STRIDE]``: contiguous writes, reads ``STRIDE`` elements apart.

    Lanes of a warp read addresses ``STRIDE * itemsize`` bytes apart, so each 32-byte
    sector the memory system fetches holds fewer useful bytes as the stride grows, until
    every element costs a sector of its own. The stride is a compile-time constant: the
    compiler then knows that stride 1 is contiguous and emits the same 16-byte vector
    accesses as :func:`copy_kernel` (a runtime stride would hide that, and the baseline
    of the comparison would be slow for the wrong reason). Each stride compiles once.
    """
    block_start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_out
    values = tl.load(src_ptr + offsets * STRIDE, mask=mask)
    tl.store(dst_ptr + offsets, values, mask=mask)


@triton.jit
def read_kernel(src_ptr, partial_ptr, n_elements, passes, BLOCK_SIZE: tl.constexpr):
    """Read ``src`` ``passes`` times; write one float32 partial sum per program.

    A read-only stream: the bandwidth a kernel reaches when it only reads, with no write
    traffic sharing the memory bus (a copy spends half its bytes on writes). The sums
    are what keep the compiler from dropping the loads; one ``float32`` per program is
    all that is written, a few kilobytes against gigabytes read.

    Program ``p`` of ``P`` reads blocks ``p, p + P, p + 2P, ...`` and then starts over:
    each pass sweeps the whole buffer before the next begins, so the passes after the
    first find the buffer in L2 only if all of it fits there. The loads bypass L1
    (``.cg``, "cache global"): a program re-reads the same blocks every pass, and L1
    would serve small buffers from the SM itself instead of from L2.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_blocks = tl.cdiv(n_elements, BLOCK_SIZE)
    acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    for _ in range(passes):
        for block in range(pid, n_blocks, n_programs):
            offsets = tl.cast(block, tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            mask = offsets < n_elements
            acc += tl.load(src_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def pointer_chase_kernel(table_ptr, state_ptr, hops):
    """Follow ``hops`` links of ``table`` from ``state[0]``; leave where it ended in ``state[0]``.

    ``table[i]`` holds the index of the next element to visit, so each load's address is
    the value of the load before it: no two loads can be in flight at once, and the time
    per hop is the latency of whichever level of the hierarchy holds the table (plus a
    few cycles of address arithmetic). Launched as one program of one warp. Storing the
    end lets the next call continue around the cycle rather than re-walk its start.
    """
    index = tl.load(state_ptr)
    for _ in range(hops):
        index = tl.load(table_ptr + index)
    tl.store(state_ptr, index)


def _grid(n: int, block_size: int) -> tuple[int]:
    return (triton.cdiv(n, block_size),)


def compute_dtype(dtype: torch.dtype) -> tl.dtype | None:
    """What :func:`vector_add_kernel` adds ``dtype`` in: fp32 for 16-bit floats, else ``dtype`` itself (None)."""
    return tl.float32 if dtype in (torch.float16, torch.bfloat16) else None


def launch_copy(src: torch.Tensor, dst: torch.Tensor, block_size: int, num_warps: int):
    n = src.numel()
    return copy_kernel[_grid(n, block_size)](src, dst, n, BLOCK_SIZE=block_size, num_warps=num_warps)


def launch_vector_add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, block_size: int, num_warps: int):
    n = out.numel()
    return vector_add_kernel[_grid(n, block_size)](
        x, y, out, n, BLOCK_SIZE=block_size, COMPUTE_DTYPE=compute_dtype(x.dtype), num_warps=num_warps
    )


def launch_read(src: torch.Tensor, partials: torch.Tensor, passes: int, block_size: int, num_warps: int):
    """One program per element of ``partials`` (at most one per block of ``src``)."""
    return read_kernel[(partials.numel(),)](
        src, partials, src.numel(), passes, BLOCK_SIZE=block_size, num_warps=num_warps, num_stages=READ_NUM_STAGES
    )


def launch_pointer_chase(table: torch.Tensor, state: torch.Tensor, hops: int):
    return pointer_chase_kernel[(1,)](table, state, hops, num_warps=1)


def launch_strided_read(src: torch.Tensor, dst: torch.Tensor, stride: int, block_size: int, num_warps: int):
    n_out = dst.numel()
    return strided_read_kernel[_grid(n_out, block_size)](
        src, dst, n_out, STRIDE=stride, BLOCK_SIZE=block_size, num_warps=num_warps
    )
