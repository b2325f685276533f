"""Inputs for performance runs, generated on the device from a seed.

Real-size inputs (hundreds of megabytes) are too large to send through a pipe, so the
grader sends a recipe and both sides build the same tensors: the sandbox to time the
submission, the grader to compute the expected checksums. A submission that tampers with
the recipe only produces checksums the grader rejects.

The timed run returns one number per call, not the output: the output's sum weighted by
random signs (:func:`checksum`). A plain sum would let wrong answers through: a softmax's
rows always sum to one, and a transpose has its input's sum. With signs drawn afresh for
every run, a wrong element moves the checksum by its own error, while a correct output's
rounding errors, meeting the signs at random, add up only like a norm.
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


def checksum_signs(numel: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """``numel`` random signs (+1 or -1, int8) from ``seed``, generated on ``device``."""
    generator = torch.Generator(device=device).manual_seed(int(seed))
    signs = torch.randint(0, 2, (int(numel),), generator=generator, device=device, dtype=torch.int8)
    return signs.mul_(2).sub_(1)


def checksum(out: object, signs: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """``sum(out * roll(signs, shift))`` in float64 over the output's elements in row-major order.

    A sign flip is exact in any dtype, so only the float64 sum rounds; and one pass over an
    int8 sign per element keeps the checksum's cost small. The shift is drawn per call and
    sent with the timed request, so nothing about a call's checksum can be worked out
    before the call is asked for.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected the call to return a tensor, got {type(out).__name__}")
    if out.numel() != signs.numel():
        raise ValueError(f"expected an output of {signs.numel()} elements, got shape {tuple(out.shape)}")
    flat = out.detach().reshape(-1)
    n = flat.numel()
    shift = int(shift) % n if n else 0
    head = torch.sum(flat[shift:] * signs[:n - shift], dtype=torch.float64)
    return head + torch.sum(flat[:shift] * signs[n - shift:], dtype=torch.float64) if shift else head
