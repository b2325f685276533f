"""The user-facing side of :mod:`labkit.shmem.kernels`: a flag channel, and the host-driven version.

:class:`FlagChannel` owns the landing buffer, one flag per block, the ticket counter and an
error word, all allocated once (as a symmetric buffer is) and reused launch after launch.
``channel.put_and_consume(x)`` is one launch: producers put, consumers wait on flags and
compute. :func:`copy_then_consume` is what a host-driven program does instead: a copy (the
transfer, ``cudaMemcpyAsync`` or a collective) and then a second kernel, ordered by the stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import backend
from ..validate import check_positive_int, check_power_of_two, check_tensor
from . import kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x.to(torch.float64))


class FlagChannel:
    """A landing buffer of ``numel`` elements with a flag per ``block`` elements, reused across launches."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 block: int = 1024, max_spins: int | None = None):
        check_positive_int(numel, "numel")
        check_power_of_two(block, "block")
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {DTYPES}, got {dtype}")
        device = torch.device(device) if device is not None else backend.device()
        self.numel, self.dtype, self.device, self.block = numel, dtype, device, block
        self.n_blocks = -(-numel // block)
        # Under the interpreter a consumer that finds its flag down would spin forever (its
        # producer cannot run until it ends); one look is all it gets there.
        self.max_spins = max_spins if max_spins is not None else (1 if not backend.on_gpu() else 1 << 30)
        check_positive_int(self.max_spins, "max_spins")
        self.buf = torch.zeros(numel, dtype=dtype, device=device)
        self.flags = torch.zeros(self.n_blocks, dtype=torch.int32, device=device)
        self.ticket = torch.zeros(1, dtype=torch.int64, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = 0

    def put_and_consume(self, x: torch.Tensor, out: torch.Tensor | None = None, *, check_errors: bool = True) -> torch.Tensor:
        """``out = silu(x)``, with ``x`` passed through the buffer block by block, in one launch."""
        check_tensor(x, "x", dtypes=(self.dtype,), device=self.device.type, contiguous=True)
        if x.numel() != self.numel:
            raise ValueError(f"this channel carries {self.numel} elements, x has {x.numel()}")
        out = torch.empty_like(x) if out is None else out
        kernels.put_signal_consume_launch(x, self.buf, out, self.flags, self.ticket, self.err, self.epoch,
                                          self.block, self.max_spins)
        self.epoch += 1
        if check_errors:
            self.raise_if_failed()
        return out

    def raise_if_failed(self) -> None:
        """Raise if any launch so far had a consumer give up (1) or a ticket out of step (2)."""
        err = int(self.err.item())
        if err == 1:
            raise RuntimeError("a consumer program found its flag down after max_spins polls: its producer had not "
                               "run (under the interpreter, programs run one at a time in ticket order)")
        if err == 2:
            raise RuntimeError("a program drew a ticket outside its launch: the ticket counter is out of step with "
                               "the channel's epoch (was it changed by hand?); no producer wrote that block")


def copy_then_consume(x: torch.Tensor, buf: torch.Tensor, out: torch.Tensor | None = None,
                      block: int = 1024) -> torch.Tensor:
    """The host-driven version: ``buf.copy_(x)`` (one launch), then SiLU of ``buf`` (another)."""
    check_tensor(x, "x", dtypes=DTYPES, contiguous=True)
    check_tensor(buf, "buf", dtypes=(x.dtype,), contiguous=True)
    if buf.numel() != x.numel():
        raise ValueError(f"buf has {buf.numel()} elements, x has {x.numel()}")
    check_power_of_two(block, "block")
    out = torch.empty_like(x) if out is None else out
    buf.copy_(x)
    kernels.silu_launch(buf, out, block)
    return out
