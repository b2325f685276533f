"""Streaming weights from host memory while the GPU computes: copies overlapped with compute.

A model too large for the GPU keeps its layers' weights in (pinned) host memory and copies
each one in just before it is needed (ZeRO-Offload and ZeRO-Infinity's parameter
offloading, FSDP's CPU offload). Done naively, on one stream, the GPU alternates: copy
layer i, compute layer i, copy layer i+1, ... and the copy engine and the SMs take turns
idling. On a second stream the copy of layer i+1 runs *while* layer i computes, and the
whole takes about max(copy, compute) instead of their sum.

Two events per buffer make that safe, one for each hazard:

- ``copied[b]`` (read after write): layer i's matmul must not start before its weights
  have landed in buffer b. The compute stream waits for it.
- ``freed[b]`` (write after read): the copy of layer i+n_buffers into buffer b must not
  start while layer i's matmul still reads b. The copy stream waits for it.

FSDP and ZeRO-3 prefetch with the same two waits, with an all-gather on a communication
stream where this has a host-to-device copy on a copy stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import runtime


def stream_layers(
    x: torch.Tensor, host_weights: Sequence[torch.Tensor], *, overlap: bool = True, n_buffers: int = 2,
) -> torch.Tensor:
    """``x @ W_0 @ W_1 @ ...`` with each ``W_i`` copied from host memory just in time.

    With ``overlap=True`` the copies run on a side stream, ``n_buffers`` ahead at most; with
    ``overlap=False`` everything runs on the current stream, one step after another.
    Returns on the host at once (on a GPU); the result is ready once the current stream is.
    """
    compute = runtime.current_stream()
    copy = runtime.new_stream() if overlap else compute
    # Allocated on the compute stream and written on the copy stream: the caching allocator
    # must not hand these blocks to anyone while a copy into them may be in flight. Every
    # copy is waited for by the compute stream below, so once the compute stream has passed
    # its last wait, no copy is pending, and freeing them there (on return) is safe.
    buffers = [torch.empty_like(host_weights[0], device=x.device) for _ in range(n_buffers)]
    copied = [runtime.new_event() for _ in range(n_buffers)]
    freed = [runtime.new_event() for _ in range(n_buffers)]
    # The copy stream starts behind everything issued before this call: without this wait
    # its first copies could run before the caller's earlier work (and before a timer's
    # start event on the compute stream, flattering the measurement).
    copy.wait_stream(compute)
    for i, w in enumerate(host_weights):
        b = i % n_buffers
        with runtime.issue_on(copy):
            # An event never recorded yet (the first n_buffers layers) makes this a no-op.
            copy.wait_event(freed[b])
            buffers[b].copy_(w, non_blocking=True)
            copied[b].record(copy)
        compute.wait_event(copied[b])
        x = x @ buffers[b]
        freed[b].record(compute)
    return x


def copy_layers(device_buffer: torch.Tensor, host_weights: Sequence[torch.Tensor]) -> None:
    """Only the copies of :func:`stream_layers`, one after another, into one buffer."""
    for w in host_weights:
        device_buffer.copy_(w, non_blocking=True)


def compute_layers(x: torch.Tensor, device_weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Only the matmuls of :func:`stream_layers`, with the weights already on the device."""
    for w in device_weights:
        x = x @ w
    return x


def schedule_spans(copy_ms: float, compute_ms: float, n_layers: int, *, overlap: bool,
                   n_buffers: int = 2) -> list[dict]:
    """The spans an ideal GPU would run :func:`stream_layers` as: one copy engine, one
    compute engine, each step as early as its stream order and its events allow.

    Serial: one queue, copy and matmul alternating. Overlapped: copy i starts once copy
    i-1 is done (one copy engine) and the matmul that last read its buffer, i-n_buffers,
    is done (``freed``); matmul i starts once its copy is done (``copied``) and matmul i-1
    is. Rows look like :func:`labkit.streams.trace.spans_from_chrome_trace`'s, in us.
    """
    copy_track, compute_track = ("copy stream", "compute stream") if overlap else ("one stream", "one stream")
    copy_end: list[float] = []
    compute_end: list[float] = []
    spans = []
    for i in range(n_layers):
        if overlap:
            start = max(copy_end[-1] if copy_end else 0.0,
                        compute_end[i - n_buffers] if i >= n_buffers else 0.0)
        else:
            start = compute_end[-1] if compute_end else 0.0
        copy_end.append(start + copy_ms)
        spans.append({"track": copy_track, "kind": "copy", "name": f"copy W{i}",
                      "start_us": start * 1e3, "dur_us": copy_ms * 1e3})
        start = max(copy_end[i], compute_end[-1] if compute_end else 0.0)
        compute_end.append(start + compute_ms)
        spans.append({"track": compute_track, "kind": "kernel", "name": f"x @ W{i}",
                      "start_us": start * 1e3, "dur_us": compute_ms * 1e3})
    return spans


def pipelined_time_model(copy_ms: float, compute_ms: float, n_layers: int, *, overlap: bool) -> float:
    """The time a perfect schedule takes, from one layer's copy and compute times.

    Serial: n (copy + compute). Overlapped with double buffering: the first copy and the
    last matmul stand alone, and in between each step takes the longer of the two,
    c + (n - 1) max(c, k) + k, which is within (1 + 1/n) of n max(c, k) when c = k.
    """
    if not overlap:
        return n_layers * (copy_ms + compute_ms)
    return copy_ms + (n_layers - 1) * max(copy_ms, compute_ms) + compute_ms
