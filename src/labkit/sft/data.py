"""SFT data: a chat template with role markers as tokens, loss masks, and sequence packing.

A conversation is a list of ``(role, tokens)`` turns. :class:`ChatTemplate` renders it as
``<|user|> ... <|end|> <|assistant|> ... <|end|> ...``, each marker one token id past the
task's own vocabulary, and marks as *targets* only the assistant's tokens and the
``<|end|>`` that closes them: the model learns to answer and to stop, never to predict
the user. The mask convention is :func:`labkit.models.lm_loss`'s: ``loss_mask[t]`` says
whether token ``t`` is a target (predicted from the tokens before it).

:func:`pack` places whole documents into rows of ``seq_len`` tokens (first-fit
decreasing) and returns a :class:`PackedBatch`: ids, loss mask, position ids that restart
at 0 in every document, and each token's document number, from which the block-diagonal
causal mask follows (:func:`block_diagonal_causal_mask`). :func:`pad` is the baseline
that gives every document a row of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_positive_int, check_tensor

ROLES = ("user", "assistant")


@dataclass(frozen=True)
class Document:
    """One tokenized training example: ``ids`` ``[T]`` and ``loss_mask`` ``[T]`` (bool)."""

    ids: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor(self.ids, "ids", ndim=1, dtypes=(torch.int64,))
        check_tensor(self.loss_mask, "loss_mask", ndim=1, dtypes=(torch.bool,))
        if self.ids.shape != self.loss_mask.shape or self.ids.numel() == 0:
            raise ValueError(f"a document needs ids and loss_mask of one non-zero length, got "
                             f"{tuple(self.ids.shape)} and {tuple(self.loss_mask.shape)}")

    def __len__(self) -> int:
        return self.ids.numel()


@dataclass(frozen=True)
class ChatTemplate:
    """The book's chat template over a task vocabulary of ``base_vocab`` token ids.

    Four special tokens follow the task's ids: ``<|user|>``, ``<|assistant|>``, ``<|end|>``
    and ``<|pad|>``; :attr:`vocab_size` counts them all.
    """

    base_vocab: int

    def __post_init__(self) -> None:
        check_positive_int(self.base_vocab, "base_vocab")

    @property
    def user(self) -> int:
        return self.base_vocab

    @property
    def assistant(self) -> int:
        return self.base_vocab + 1

    @property
    def end(self) -> int:
        return self.base_vocab + 2

    @property
    def pad_id(self) -> int:
        return self.base_vocab + 3

    @property
    def vocab_size(self) -> int:
        return self.base_vocab + 4

    def render(self, turns: list[tuple[str, list[int]]]) -> Document:
        """Token ids and loss mask of a conversation; only assistant turns (and their end) train."""
        if not turns:
            raise ValueError("a conversation needs at least one turn")
        ids: list[int] = []
        mask: list[bool] = []
        for role, tokens in turns:
            if role not in ROLES:
                raise ValueError(f"role must be one of {ROLES}, got {role!r}")
            if any(not 0 <= t < self.base_vocab for t in tokens):
                raise ValueError(f"turn tokens must be task ids in [0, {self.base_vocab}), got {tokens}")
            trains = role == "assistant"
            marker = self.assistant if trains else self.user
            # The marker itself is the prompt's: the model is told whose turn it is.
            ids += [marker, *tokens, self.end]
            mask += [False] + [trains] * (len(tokens) + 1)
        return Document(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool))

    def prompt(self, user_tokens: list[int]) -> torch.Tensor:
        """The ids a model is given at inference: the user turn, then the assistant marker."""
        return torch.tensor([self.user, *user_tokens, self.end, self.assistant], dtype=torch.int64)

    def decode(self, ids: torch.Tensor, task_names: dict[int, str]) -> str:
        names = {self.user: "<|user|>", self.assistant: "<|assistant|>", self.end: "<|end|>", self.pad_id: "·"}
        return "".join(names.get(t, task_names.get(t, "?")) for t in ids.tolist())


@dataclass(frozen=True)
class PackedBatch:
    """Rows of ``seq_len`` tokens holding whole documents (or one padded document each).

    ``ids``, ``loss_mask``, ``position_ids`` and ``document_ids`` are ``[rows, seq_len]``;
    a row's trailing padding is one more document (its own positions, no targets), so
    that every query attends to at least itself.
    """

    ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    real_tokens: int

    @property
    def num_targets(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def efficiency(self) -> float:
        """Fraction of the token slots that hold real tokens (the rest is padding)."""
        return self.real_tokens / self.ids.numel()

    def cu_seqlens(self) -> torch.Tensor:
        """Document starts in the flattened batch, then its length: FlashAttention's varlen
        ``cu_seqlens`` (padding documents included)."""
        return cu_seqlens_from_positions(self.position_ids.reshape(-1))


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[0, start_1, ..., N]`` from flat position ids that restart at 0 in each document,
    as Hugging Face transformers derives FlashAttention's boundaries from ``position_ids``."""
    check_tensor(position_ids, "position_ids", ndim=1, dtypes=(torch.int32, torch.int64))
    if position_ids.numel() == 0 or int(position_ids[0]) != 0:
        raise ValueError("position_ids must be non-empty and start at 0")
    starts = torch.nonzero(position_ids == 0).flatten()
    return torch.cat([starts, starts.new_tensor([position_ids.numel()])]).to(torch.int32)


def block_diagonal_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool: query ``i`` may see key ``j`` iff ``j <= i`` in the same document."""
    check_tensor(document_ids, "document_ids", ndim=1, dtypes=(torch.int32, torch.int64))
    n = document_ids.numel()
    same = document_ids[:, None] == document_ids[None, :]
    return same & torch.ones(n, n, dtype=torch.bool, device=document_ids.device).tril()


def _check_documents(documents: list[Document], seq_len: int) -> None:
    check_positive_int(seq_len, "seq_len")
    if not documents or not all(isinstance(d, Document) for d in documents):
        raise TypeError("documents must be a non-empty list of Document")
    longest = max(len(d) for d in documents)
    if longest > seq_len:
        raise ValueError(f"a document of {longest} tokens does not fit a row of seq_len={seq_len}; "
                         "truncate or split it first")


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices, longest first, each into the first row with room.

    The classic bin-packing heuristic (one of Megatron Bridge's offline packing algorithms): at most
    11/9 of the optimal number of rows, plus a constant.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _rows(documents: list[Document], bins: list[list[int]], seq_len: int, pad_id: int) -> PackedBatch:
    rows = len(bins)
    ids = torch.full((rows, seq_len), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    position_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
    document_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
    doc_number = 0
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            doc, n = documents[i], len(documents[i])
            ids[r, at:at + n] = doc.ids
            loss_mask[r, at:at + n] = doc.loss_mask
            # No target may be predicted across a boundary: the first token of a document
            # has only the previous document before it.
            loss_mask[r, at] = False
            position_ids[r, at:at + n] = torch.arange(n)
            document_ids[r, at:at + n] = doc_number
            doc_number, at = doc_number + 1, at + n
        if at < seq_len:  # the padding is a document of its own
            position_ids[r, at:] = torch.arange(seq_len - at)
            document_ids[r, at:] = doc_number
            doc_number += 1
    real = sum(len(d) for d in documents)
    return PackedBatch(ids, loss_mask, position_ids, document_ids, real)


def pack(documents: list[Document], seq_len: int, pad_id: int) -> PackedBatch:
    """Whole documents packed into as few rows of ``seq_len`` as first-fit decreasing finds."""
    _check_documents(documents, seq_len)
    return _rows(documents, first_fit_decreasing([len(d) for d in documents], seq_len), seq_len, pad_id)


def pad(documents: list[Document], seq_len: int, pad_id: int) -> PackedBatch:
    """The baseline: one document per row, padded to ``seq_len``."""
    _check_documents(documents, seq_len)
    return _rows(documents, [[i] for i in range(len(documents))], seq_len, pad_id)


def padding_waste(lengths: list[int], seq_len: int, batch: int | None = None) -> dict[str, float]:
    """Fraction of token slots that are padding, three ways, for documents of ``lengths``.

    ``pad to seq_len`` gives each document a row of ``seq_len``; ``pad to longest`` groups
    ``batch`` documents in order and pads each group to its longest (dynamic padding);
    ``packed`` is first-fit decreasing into rows of ``seq_len``.
    """
    check_positive_int(seq_len, "seq_len")
    if not lengths or any(not 0 < n <= seq_len for n in lengths):
        raise ValueError(f"lengths must be non-empty, each in [1, seq_len={seq_len}]")
    batch = batch or 8
    real = sum(lengths)
    dynamic = sum(len(group) * max(group) for group in (lengths[i:i + batch] for i in range(0, len(lengths), batch)))
    rows = len(first_fit_decreasing(lengths, seq_len))
    return {"pad to seq_len": 1 - real / (len(lengths) * seq_len),
            "pad to longest": 1 - real / dynamic,
            "packed": 1 - real / (rows * seq_len)}


def lognormal_lengths(n: int, *, median: float, sigma: float, max_len: int, seed: int = 0) -> list[int]:
    """``n`` document lengths drawn from a log-normal (clipped to ``[2, max_len]``).

    Chat and instruction datasets have right-skewed lengths: many short exchanges, a
    long tail. A log-normal is the usual model of that shape.
    """
    check_positive_int(n, "n")
    gen = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.log(torch.tensor(float(median))) + sigma * torch.randn(n, generator=gen))
    return draws.round().clamp(2, max_len).long().tolist()
