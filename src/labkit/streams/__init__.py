"""CUDA streams: host-device copies, copies overlapped with compute, timelines, the allocator.

- :mod:`.runtime`: streams and events in both modes (no-ops on the CPU, where nothing queues);
- :mod:`.bandwidth`: pinned and pageable host memory, copied each way;
- :mod:`.pipeline`: weights streamed from host memory layer by layer, the copies on a side
  stream overlapped with the matmuls, two events per buffer guarding the two hazards;
- :mod:`.trace`: a ``torch.profiler`` trace as rows of spans (stream, kind, start, duration);
- :mod:`.allocator`: the caching allocator reusing a block another stream still reads,
  and the two fixes.

The functions here check their arguments and call those modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import validate
from . import allocator, bandwidth, pipeline, runtime, trace
from .allocator import PROTECTIONS
from .bandwidth import DIRECTIONS, host_buffer
from .trace import busy_us, issue_end_us, profile_spans, spans_from_chrome_trace

__all__ = [
    "DIRECTIONS", "PROTECTIONS", "allocator", "bandwidth", "busy_us", "host_buffer", "issue_end_us", "pipeline",
    "pipelined_time_model", "profile_spans", "reuse_race", "runtime", "spans_from_chrome_trace",
    "stream_layers", "trace", "transfer_timing",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def stream_layers(x: torch.Tensor, host_weights: Sequence[torch.Tensor], *, overlap: bool = True,
                  n_buffers: int = 2) -> torch.Tensor:
    """``x @ W_0 @ W_1 @ ...`` with each weight copied from host memory as it is needed.

    ``x``: (tokens, d) on the compute device; ``host_weights``: a non-empty sequence of
    (d, d) CPU tensors of ``x``'s dtype (pinned, on a GPU machine, for the copies to be
    asynchronous). ``overlap`` puts the copies on a side stream; ``n_buffers`` device
    buffers take turns (2 is double buffering). See :func:`.pipeline.stream_layers`.
    """
    validate.check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    if isinstance(host_weights, torch.Tensor) or not isinstance(host_weights, Sequence) or not host_weights:
        raise TypeError(f"host_weights must be a non-empty list of tensors, got {type(host_weights).__name__}"
                        + (" (empty)" if isinstance(host_weights, Sequence) and not host_weights else ""))
    d = x.shape[1]
    for i, w in enumerate(host_weights):
        validate.check_tensor(w, f"host_weights[{i}]", ndim=2, dtypes=(x.dtype,), device="cpu")
        if tuple(w.shape) != (d, d):
            raise ValueError(f"host_weights[{i}] must have shape ({d}, {d}) to follow x of shape "
                             f"{tuple(x.shape)}, got {tuple(w.shape)}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    validate.check_positive_int(n_buffers, "n_buffers")
    return pipeline.stream_layers(x, host_weights, overlap=overlap, n_buffers=n_buffers)


def transfer_timing(n_bytes: int, direction: str, *, pinned: bool):
    """Time one host-device copy of ``n_bytes``; returns ``(Timing, bytes moved)``.

    ``direction``: ``'h2d'``, ``'d2h'`` or ``'both'`` (one each way at once). See
    :func:`.bandwidth.transfer_timing`.
    """
    validate.check_positive_int(n_bytes, "n_bytes")
    validate.check_choice(direction, "direction", DIRECTIONS)
    if not isinstance(pinned, bool):
        raise TypeError(f"pinned must be a bool, got {type(pinned).__name__}")
    return bandwidth.transfer_timing(n_bytes, direction, pinned=pinned)


def pipelined_time_model(copy_ms: float, compute_ms: float, n_layers: int, *, overlap: bool) -> float:
    """What a perfect schedule of ``n_layers`` copy-then-compute steps takes, in ms.

    See :func:`.pipeline.pipelined_time_model`.
    """
    for name, value in (("copy_ms", copy_ms), ("compute_ms", compute_ms)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    validate.check_positive_int(n_layers, "n_layers")
    return pipeline.pipelined_time_model(float(copy_ms), float(compute_ms), n_layers, overlap=overlap)


def reuse_race(protection: str, n: int) -> dict:
    """Free an ``n``-element tensor that another stream is about to read; see :mod:`.allocator`.

    ``protection``: ``'nothing'``, ``'record_stream'`` or ``'wait_stream'``.
    """
    validate.check_choice(protection, "protection", PROTECTIONS)
    validate.check_positive_int(n, "n")
    return allocator.reuse_race(protection, n)
