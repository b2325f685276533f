"""Device-initiated "communication" inside one GPU: producer and consumer programs of one launch.

Half the programs of :func:`put_signal_consume_kernel` are *producers*: each copies a block of
``x`` into ``buf`` (the put) and then raises that block's flag with a release store (the
signal). The other half are *consumers*: each waits for its block's flag with acquire loads
(``signal_wait_until``) and then computes on the block (SiLU). Data moves and compute starts
block by block, inside one kernel, with no host in between: what NVSHMEM, DeepEP and the
fused comm-compute kernels do across GPUs, shown where one GPU can show it.

Two hazards, and how the kernel avoids both:

- **Deadlock on the GPU.** A consumer that spins while its producer has not been scheduled
  (all SMs busy with spinning consumers) never finishes. So a program's role is not its
  ``program_id`` but a *ticket* it draws from an atomic counter when it starts: tickets are
  handed out in the order programs actually run, the first ``n_blocks`` are producers, so by
  the time any program is a consumer every producer has started and will finish (the trick of
  CUB's decoupled look-back).
- **Deadlock in the interpreter.** Triton's interpreter runs programs one after another, each
  to its end. With tickets, producers take the first ``n_blocks`` tickets and run first, so a
  consumer never finds its flag down. Should it anyway, it spins at most ``max_spins`` times
  (1 under the interpreter), sets ``err`` and goes on: the launcher raises instead of hanging.

Flags and the ticket counter are not cleared between launches (a clear is another launch):
launch ``e`` compares flags with ``e + 1`` and subtracts ``e * 2 * n_blocks`` from the tickets,
the sequence-number scheme symmetric-memory kernels use to reuse their signal words.
"""

from __future__ import annotations

import torch

from .. import backend  # noqa: F401  (sets TRITON_INTERPRET before triton loads, on a CPU)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def put_signal_consume_kernel(x_ptr, buf_ptr, out_ptr, flag_ptr, ticket_ptr, err_ptr, n, n_blocks, epoch, ticket_base,
                              MAX_SPINS: tl.constexpr, BLOCK: tl.constexpr):
    ticket = (tl.atomic_add(ticket_ptr, 1) - ticket_base).to(tl.int32)
    if ticket < n_blocks:  # producer: put the block, then signal it
        offs = ticket * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(buf_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        # Every thread's stores before the flag: the CTA barrier orders them before the one
        # thread's release store (release orders only what that thread has seen).
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr + ticket, epoch + 1, sem="release", scope="gpu")
    else:  # consumer: wait for the block's signal, then compute on it
        block = ticket - n_blocks
        if block >= n_blocks:  # a ticket outside this launch: the counter is out of step with the epoch
            tl.atomic_xchg(err_ptr, 2)
        else:
            seen = tl.atomic_add(flag_ptr + block, 0, sem="acquire", scope="gpu")
            spins = 0
            while (seen != epoch + 1) & (spins < MAX_SPINS):
                seen = tl.atomic_add(flag_ptr + block, 0, sem="acquire", scope="gpu")
                spins += 1
            if seen != epoch + 1:
                tl.atomic_xchg(err_ptr, 1)
            offs = block * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(buf_ptr + offs, mask=mask, cache_modifier=".cg").to(tl.float32)  # from L2, not a stale L1
            tl.store(out_ptr + offs, (v * tl.sigmoid(v)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_kernel(buf_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The consumer alone: the second launch of the host-driven version."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(buf_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (v * tl.sigmoid(v)).to(out_ptr.dtype.element_ty), mask=mask)


def put_signal_consume_launch(x: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, flags: torch.Tensor,
                              ticket: torch.Tensor, err: torch.Tensor, epoch: int, block: int, max_spins: int) -> None:
    n_blocks = triton.cdiv(x.numel(), block)
    put_signal_consume_kernel[(2 * n_blocks,)](x, buf, out, flags, ticket, err, x.numel(), n_blocks, epoch,
                                               epoch * 2 * n_blocks, MAX_SPINS=max_spins, BLOCK=block)


def silu_launch(buf: torch.Tensor, out: torch.Tensor, block: int) -> None:
    silu_kernel[(triton.cdiv(buf.numel(), block),)](buf, out, buf.numel(), BLOCK=block)
