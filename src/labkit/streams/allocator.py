"""The stream-ordered caching allocator's pitfall, demonstrated: memory reused too early.

PyTorch's CUDA caching allocator keeps freed blocks for reuse, and tags each block with
the stream it was allocated on. A block freed on the host can be handed at once to the
next allocation *on that stream*, because that stream's later work runs after everything
already queued on it. Work queued on any *other* stream is invisible to it. So a tensor
allocated on stream A, read by a kernel on stream B, and deleted on the host while that
kernel waits or runs, can have its memory handed to a new tensor on A, whose writes then
race the reader on B.

:func:`reuse_race` builds exactly that case and reports whether the block was reused and
how many elements the reader got wrong, for three ways of handling the free:

- ``'nothing'``: the bug;
- ``'record_stream'``: ``x.record_stream(B)`` tells the allocator that B used ``x``; at the
  free it records an event on B and will not reuse the block until that event completes;
- ``'wait_stream'``: A waits for B before the free, so A's later work, including a new
  tensor's writes, is ordered after B's read (the deterministic fix).
"""

from __future__ import annotations

import torch

from .. import backend
from . import runtime

PROTECTIONS = ("nothing", "record_stream", "wait_stream")
POISON = -1.0
# GPU cycles the reader's stream sleeps before it reads: milliseconds at the H200's clock,
# far longer than the host takes to free the tensor and queue the overwrite.
READER_DELAY_CYCLES = 2**23


def reuse_race(protection: str, n: int) -> dict:
    """Free a tensor that another stream is about to read; count what the reader got wrong.

    Returns ``{'protection', 'block_reused', 'wrong_elements', 'elements'}``. On the CPU
    there is no queue, the reader has already finished when the tensor is freed, and no
    element can be wrong.
    """
    if backend.on_gpu():
        # Start from an empty cache, so that when x is freed its block is the only free one
        # of its size: otherwise the newcomer might take another cached block, and the race
        # would depend on what ran before.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    main, reader = runtime.current_stream(), runtime.new_stream()
    x = torch.ones(n, device=backend.device())  # allocated on main
    reader.wait_stream(main)  # x is written before the reader starts
    with runtime.issue_on(reader):
        if backend.on_gpu():
            torch.cuda._sleep(READER_DELAY_CYCLES)  # a reader that is late, as a busy stream is
        doubled = x * 2  # allocated on the reader's stream, read later on main after a wait
    if protection == "record_stream" and backend.on_gpu():
        x.record_stream(reader)
    elif protection == "wait_stream":
        main.wait_stream(reader)
    address = x.data_ptr()
    del x  # on the host, now: the reader has not run yet
    newcomer = torch.empty(n, device=backend.device())  # on main
    block_reused = newcomer.data_ptr() == address
    newcomer.fill_(POISON)  # main does not wait for the reader: this may land first
    main.wait_stream(reader)
    wrong = int((doubled != 2).sum())
    return {"protection": protection, "block_reused": block_reused, "wrong_elements": wrong, "elements": n}
