"""Byte-level text that every machine has: the Python standard library's own source.

Chapters that compare model variants on language modelling (positional encodings,
MQA/GQA/MLA) train on it, so nothing is downloaded. Tokens are bytes (a vocabulary of
256), and the split into training and held-out text is by file, so held-out windows are
text the model has never seen.

>>> train, held_out = stdlib_corpus(max_bytes=2_000_000)
>>> ids = random_windows(train, batch=32, length=256, generator=gen)     # int64 [32, 256]

The corpus depends on the Python version's standard library; records say which
Python made them.
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

from ..validate import check_positive_int

VOCAB_SIZE = 256
HELD_OUT_EVERY = 10


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name: the same files on every
    install of a version, and none of the test suite's generated or binary-ish data."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no Python sources under {root}: cannot build the text corpus")
    return files


def split_files(files: list[Path] | None = None, every: int = HELD_OUT_EVERY) -> tuple[list[Path], list[Path]]:
    """``(train, held_out)`` files: file ``i`` is held out when ``i % every == 0``."""
    files = stdlib_files() if files is None else files
    return ([f for i, f in enumerate(files) if i % every], [f for i, f in enumerate(files) if i % every == 0])


def load_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, concatenated, as a uint8 tensor."""
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).clone()


@lru_cache(maxsize=4)
def _read(max_bytes: int, held_out_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    files, total = [], 0
    for path in stdlib_files():  # whole files, in name order, until max_bytes are read
        files.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    train, held_out = split_files(files, held_out_every)
    return load_bytes(train), load_bytes(held_out)


def stdlib_corpus(max_bytes: int = 4_000_000, held_out_every: int = HELD_OUT_EVERY) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)`` uint8 tensors of source bytes from the first files (in name order)
    that hold ``max_bytes``; every ``held_out_every``-th of them is held out."""
    check_positive_int(max_bytes, "max_bytes")
    check_positive_int(held_out_every, "held_out_every")
    if held_out_every < 2:
        raise ValueError(f"held_out_every must be at least 2 (1 would hold out everything), got {held_out_every}")
    return _read(max_bytes, held_out_every)


def random_windows(data: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``length`` consecutive bytes at random offsets, as int64 ids."""
    check_positive_int(batch, "batch")
    check_positive_int(length, "length")
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.ndim != 1:
        raise TypeError(f"data must be a 1-D uint8 tensor of bytes, got {getattr(data, 'dtype', type(data).__name__)}")
    if data.numel() <= length:
        raise ValueError(f"windows of {length} bytes need more than {length} bytes of text, got {data.numel()}")
    starts = torch.randint(0, data.numel() - length, (batch,), generator=generator)
    return data[starts[:, None] + torch.arange(length)].long()
