"""The text the book's small model is trained and scored on: the Python standard library.

Every machine that runs the book has it, so nothing downloads. The files are the ``.py``
files at the top of ``sysconfig.get_paths()["stdlib"]``, sorted by name; every
``HELDOUT_EVERY``-th one is held out, so held-out text comes from files the model never
saw (not from a later stretch of a file it did). Bytes are the tokens (vocab 256).

The standard library differs a little between Python versions, so a perplexity measured
on 3.11's files and one on 3.12's are close but not equal; compare formats within a run.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

HELDOUT_EVERY = 10


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def split_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) files: file ``i`` is held out when ``i % HELDOUT_EVERY == 0``."""
    files = stdlib_files()
    held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != 0]
    return train, held


def load_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, concatenated, as an int64 tensor of token ids in [0, 256)."""
    data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def heldout_tokens(max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` bytes of the held-out files."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
    return load_bytes(split_files()[1])[:max_tokens]
