"""Tensor arguments handed to a submission inside guarded buffers.

A kernel with a missing or wrong mask writes past the end of its output. On a GPU that
corrupts a neighbour or faults; under Triton's interpreter it silently scribbles over
whatever memory follows. So every tensor argument a test passes reaches the submission
as a view into a larger buffer whose margins hold a fixed byte pattern. After the call
the margins are compared with the pattern: a changed byte is a write out of bounds, and
the test fails saying where, instead of passing (or crashing) by luck.

The margin pattern is finite and unusual (bytes ``0xA5``: ``-2.87e-16`` as float32), not
NaN: a kernel that loads an input's margin and stores it into an output's margin would
copy a NaN unnoticed, but it cannot copy ``0xA5`` bytes through ``a * x + b`` unchanged.
Strided views keep their strides: the buffer covers the view's whole storage span.
"""

from __future__ import annotations

import math

import torch

MARGIN_ELEMENTS = 4096
MARGIN_BYTE = 0xA5


def span_length(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a view of ``shape`` and ``stride`` reaches (0 if empty)."""
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def describe(t: torch.Tensor) -> dict:
    """What is sent for a tensor argument: its storage span, shape and strides."""
    t = t.detach()
    if any(s < 0 for s in t.stride()):
        raise ValueError("negative strides are not supported")
    n = span_length(tuple(t.shape), tuple(t.stride()))
    span = t.as_strided((n,), (1,), t.storage_offset()).clone() if n else t.new_empty(0)
    return {"kind": "tensor_arg", "span": span, "shape": list(t.shape), "stride": list(t.stride())}


def is_tensor_arg(value: object) -> bool:
    return isinstance(value, dict) and value.get("kind") == "tensor_arg"


class Placed:
    """A tensor argument living at the centre of a buffer with patterned margins."""

    def __init__(self, spec: dict, device: torch.device | str):
        span: torch.Tensor = spec["span"]
        self.shape, self.stride = tuple(spec["shape"]), tuple(spec["stride"])
        if span_length(self.shape, self.stride) != span.numel():
            raise ValueError("tensor argument: span does not match shape and strides")
        self.length, self.margin, self.dtype = span.numel(), MARGIN_ELEMENTS, span.dtype
        # A bool buffer cannot hold the pattern: torch treats any nonzero byte as True and
        # copies write it back as 1, so a margin only read would look overwritten. Bool
        # arguments live in a uint8 buffer, and the submission gets a bool view of it.
        storage = torch.uint8 if span.dtype == torch.bool else span.dtype
        self.buffer = torch.empty(self.length + 2 * self.margin, dtype=storage, device=device)
        self.buffer.view(torch.uint8).fill_(MARGIN_BYTE)
        typed = self.buffer.view(span.dtype)
        typed[self.margin:self.margin + self.length] = span.to(device)
        self.view = typed.as_strided(self.shape, self.stride, self.margin)

    def after(self) -> dict:
        """The span as the call left it, and both margins, for the grader to inspect."""
        b = self.buffer.detach().to("cpu")
        m, n = self.margin, self.length
        return {"span": b[m:m + n].view(self.dtype).clone(), "before": b[:m].clone(), "after": b[m + n:].clone()}


def margin_damage(margin: torch.Tensor) -> int:
    """How many elements of a margin no longer hold the pattern."""
    if margin.numel() == 0:
        return 0
    raw = margin.contiguous().view(torch.uint8).reshape(margin.numel(), -1)
    return int((raw != MARGIN_BYTE).any(dim=1).sum().item())


def margin_report(after: dict, arg_name: str, shape: tuple[int, ...]) -> str | None:
    """A sentence about out-of-bounds writes around one argument, or None if there were none."""
    before_n, after_n = margin_damage(after["before"]), margin_damage(after["after"])
    if not before_n and not after_n:
        return None
    parts = []
    if after_n:
        parts.append(f"{after_n} element(s) past the end")
    if before_n:
        parts.append(f"{before_n} element(s) before the start")
    return (
        f"the submission wrote {' and '.join(parts)} of {arg_name} (shape {shape}): "
        "out of bounds. A load or store is missing its mask, or the mask is off by one."
    )


def as_left(t: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """A new tensor shaped like argument ``t``, holding what the call left in its storage."""
    if span.numel() == 0:
        return t.detach().clone()
    return span.as_strided(tuple(t.shape), tuple(t.stride()), 0).clone()
