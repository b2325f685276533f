"""Copies between host and device memory: pinned against pageable, each direction.

A host-to-device copy is done by a DMA (copy) engine on the GPU, which reads host memory
over PCIe on its own. It can only read memory the operating system will not move or page
out while it reads, *pinned* (page-locked) memory. From ordinary *pageable* memory the
driver first copies the data, piece by piece, into a pinned staging buffer of its own and
DMAs from there: an extra pass through host memory, done by a CPU thread, and a copy that
the host must wait for. :func:`transfer_timing` times both kinds, each direction, and both
directions at once (the H200 has separate engines for each direction).
"""

from __future__ import annotations

import torch

from .. import backend, timing
from . import runtime

DIRECTIONS = ("h2d", "d2h", "both")


FILL_BYTE = 0xA5  # what the host buffers hold; a copy engine's speed does not depend on it


def host_buffer(n_bytes: int, *, pinned: bool) -> torch.Tensor:
    """``n_bytes`` of host memory, pinned on a GPU machine if asked, every page written.

    The bytes are written once here, so every page is already mapped: a first touch inside
    the timed copy would add page faults to what we mean to measure. Pinning needs a CUDA
    driver; on the CPU there is none, and the flag is ignored.
    """
    return torch.empty(n_bytes, dtype=torch.uint8, pin_memory=pinned and backend.on_gpu()).fill_(FILL_BYTE)


def _copy_fn(direction: str, host: torch.Tensor, device_buf: torch.Tensor, pinned: bool):
    # non_blocking only makes a copy asynchronous from pinned memory; from pageable memory
    # the driver copies synchronously through its staging buffer whatever we ask.
    if direction == "h2d":
        return lambda: device_buf.copy_(host, non_blocking=pinned)
    if direction == "d2h":
        return lambda: host.copy_(device_buf, non_blocking=pinned)
    # Both directions at once: one side stream each. Both wait for the timed stream before
    # either is issued, and the timed stream joins both only after both are issued: had the
    # download's stream waited for the timed stream after that had joined the upload, the
    # two would run one after the other (an earlier version did, and recorded it).
    host_out = host_buffer(host.numel(), pinned=pinned)
    device_in = torch.empty_like(device_buf).copy_(device_buf)
    up, down = runtime.new_stream(), runtime.new_stream()

    def both():
        main = runtime.current_stream()
        up.wait_stream(main)
        down.wait_stream(main)
        with runtime.issue_on(up):
            device_buf.copy_(host, non_blocking=pinned)
        with runtime.issue_on(down):
            host_out.copy_(device_in, non_blocking=pinned)
        main.wait_stream(up)
        main.wait_stream(down)

    return both


def transfer_timing(n_bytes: int, direction: str, *, pinned: bool) -> tuple[timing.Timing, int]:
    """Time one copy of ``n_bytes`` in ``direction``; returns the timing and the bytes moved.

    ``direction`` is ``'h2d'``, ``'d2h'`` or ``'both'`` (one copy each way, concurrently,
    counting the bytes of both). CUDA events bracket the copy on the current stream; for a
    pageable copy, which blocks the host, they still bracket the whole transfer: the driver
    waits for the stream before it starts staging, and the end event is issued after.
    """
    host = host_buffer(n_bytes, pinned=pinned)
    device_buf = torch.empty(n_bytes, dtype=torch.uint8, device=backend.device())
    fn = _copy_fn(direction, host, device_buf, pinned)
    t = timing.measure(fn, flush_l2=False)
    return t, n_bytes * (2 if direction == "both" else 1)
