"""The text the book's small model is trained and scored on: the Python standard library.

Every machine that runs the book has it, so nothing downloads. The files and their split are
:mod:`labkit.models.text`'s (every chapter that trains on text uses the same): every
``HELDOUT_EVERY``-th one is held out, so held-out text comes from files the model never
saw (not from a later stretch of a file it did). Bytes are the tokens (vocab 256).

The standard library differs a little between Python versions, so a perplexity measured
on 3.11's files and one on 3.12's are close but not equal; compare formats within a run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import text
from ..models.text import split_files, stdlib_files

HELDOUT_EVERY = text.HELD_OUT_EVERY
__all__ = ["HELDOUT_EVERY", "heldout_tokens", "load_bytes", "split_files", "stdlib_files"]


def load_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, concatenated, as an int64 tensor of token ids in [0, 256)."""
    return text.load_bytes(files).long()


def heldout_tokens(max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` bytes of the held-out files."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
    return load_bytes(split_files()[1])[:max_tokens]
