"""Streams and events that exist in both of the book's modes.

On a GPU these are ``torch.cuda.Stream`` and ``torch.cuda.Event``. On the CPU there is
nothing to queue: every operation runs on the host thread, in program order, before the
call that launched it returns, so a stream that orders nothing and an event that waits
for nothing are exact stand-ins. The pipeline code is the same in both modes; only the
GPU can show it overlapping.
"""

from __future__ import annotations

import contextlib

import torch

from .. import backend


class HostStream:
    """A stream on the CPU: work already ran when it was issued, so there is nothing to wait for."""

    def wait_event(self, event: "HostEvent") -> None:
        pass

    def wait_stream(self, stream: "HostStream") -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostEvent:
    """An event on the CPU: it is complete as soon as it is recorded."""

    def record(self, stream: HostStream | None = None) -> None:
        pass

    def wait(self, stream: HostStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CPU_STREAM = HostStream()


def current_stream():
    """The stream work is issued to now (the device's current stream on a GPU)."""
    return torch.cuda.current_stream() if backend.on_gpu() else _CPU_STREAM


def new_stream():
    """A fresh side stream: its work is ordered only with itself and what it waits for."""
    return torch.cuda.Stream() if backend.on_gpu() else HostStream()


def new_event(timing: bool = False):
    """A fresh event; ``timing=True`` lets two of them measure the time between them."""
    return torch.cuda.Event(enable_timing=timing) if backend.on_gpu() else HostEvent()


def issue_on(stream):
    """``with issue_on(s):`` sends the kernels and copies launched inside to stream ``s``."""
    return torch.cuda.stream(stream) if backend.on_gpu() else contextlib.nullcontext()


def synchronize() -> None:
    """Block the host until the device has finished everything issued so far."""
    if backend.on_gpu():
        torch.cuda.synchronize()
