"""Measuring what a rank holds: the storage behind its parameters, gradients and optimizer state.

On the CPU there is no allocator to ask for a peak, so a rank's memory is *counted*: the
bytes of every storage that its parameters (full or sharded), gradients (full or sharded)
and optimizer state live in, each storage once however many views share it (a parameter
that is a view of a flat buffer costs nothing extra). The wrappers take a sample at every
point where that changes (a unit gathered or freed, a bucket of gradients reduced, the
update done), and :class:`MemoryMeter` keeps the largest. On a GPU the chapter also reads
the CUDA allocator's own peak (:mod:`labkit.zero.bench`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .memory import KINDS


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def held_bytes(groups: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes of the distinct storages behind each group of tensors (``None`` entries skipped).

    A storage shared across groups is charged to the first group that names it, so the
    total counts every byte once. Returns the groups' bytes and ``"total"``.
    """
    seen: set[tuple[str, int]] = set()
    held = {}
    for name, tensors in groups.items():
        held[name] = 0
        for t in tensors:
            if t is None:
                continue
            key = storage_key(t)
            nbytes = t.untyped_storage().nbytes()
            if key in seen or nbytes == 0:
                continue
            seen.add(key)
            held[name] += nbytes
    held["total"] = sum(held[k] for k in groups)
    return held


class MemoryMeter:
    """The largest :func:`held_bytes` over the samples taken, and where it was taken."""

    def __init__(self, tensors_by_kind: Callable[[], dict[str, list[torch.Tensor | None]]]) -> None:
        self.tensors_by_kind = tensors_by_kind
        self.reset()

    def reset(self) -> None:
        self.peak: dict[str, int] = {k: 0 for k in (*KINDS, "total")}
        self.peak_at = ""
        self.samples = 0

    def sample(self, where: str) -> dict[str, int]:
        held = held_bytes(self.tensors_by_kind())
        self.samples += 1
        if held["total"] > self.peak["total"]:
            self.peak, self.peak_at = held, where
        return held
