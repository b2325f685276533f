"""Inputs for performance runs, generated on the device from a seed.

Real-size inputs (hundreds of megabytes) are too large to send through a pipe, so the
grader sends a recipe and both sides build the same tensors: the sandbox to time the
submission, the grader to compute the expected checksums. A submission that tampers with
the recipe only produces checksums the grader rejects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import check

from . import wire


@dataclass(frozen=True)
class Randn:
    """``labkit.check.randn(*shape, dtype=dtype, seed=seed)`` on the device."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def spec(self) -> dict:
        return {"kind": "randn", "shape": list(self.shape), "dtype": wire.name_of(self.dtype),
                "seed": self.seed}


def materialize(spec: object, device: torch.device | str) -> object:
    """A recipe's tensor (scalars pass through unchanged)."""
    if isinstance(spec, dict) and spec.get("kind") == "randn":
        shape = tuple(int(s) for s in spec["shape"])
        return check.randn(*shape, dtype=wire.dtype_of(spec["dtype"]), device=device,
                           seed=int(spec["seed"]))
    if spec is None or isinstance(spec, (bool, int, float)):
        return spec
    raise wire.WireError(f"unknown input recipe {spec!r}")
