"""A task with a verifiable answer: add two numbers, written digit by digit.

Prompts are ``"07+45="`` (operands zero-padded, so every prompt has the same length and
no left padding is needed); the answer is the sum's digits followed by an end token,
``"52<eos>"``. A rule checks a completion exactly, so the reward needs no learned model.
The prompt space is split once into training and held-out pairs: the held-out reward
measures what the policy learned, not what it memorised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..validate import check_positive_int, check_tensor

DIGITS = "0123456789"


@dataclass(frozen=True)
class AdditionTask:
    """Sums of two ``digits``-digit numbers; token ids: digits 0-9, '+', '=', eos, pad."""

    digits: int = 2
    held_out_fraction: float = 0.2
    seed: int = 0
    _split: tuple[torch.Tensor, torch.Tensor] = field(init=False, repr=False, compare=False)

    PLUS = 10
    EQUALS = 11
    EOS = 12
    PAD = 13
    vocab_size = 14

    def __post_init__(self) -> None:
        check_positive_int(self.digits, "digits")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        n = 10 ** self.digits
        pairs = torch.cartesian_prod(torch.arange(n), torch.arange(n))
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(self.seed))
        n_held = int(len(pairs) * self.held_out_fraction)
        object.__setattr__(self, "_split", (pairs[order[n_held:]], pairs[order[:n_held]]))

    @property
    def prompt_length(self) -> int:
        return 2 * self.digits + 2

    @property
    def max_answer_tokens(self) -> int:
        """Longest correct completion: every digit of the largest sum, then eos."""
        return self.digits + 2

    def pairs(self, split: str) -> torch.Tensor:
        if split not in ("train", "held_out"):
            raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
        return self._split[0] if split == "train" else self._split[1]

    def sample_pairs(self, n: int, split: str, generator: torch.Generator) -> torch.Tensor:
        check_positive_int(n, "n")
        pool = self.pairs(split)
        return pool[torch.randint(len(pool), (n,), generator=generator)]

    def _number_tokens(self, values: torch.Tensor, width: int) -> torch.Tensor:
        powers = 10 ** torch.arange(width - 1, -1, -1)
        return (values[:, None] // powers) % 10

    def prompts(self, pairs: torch.Tensor) -> torch.Tensor:
        """``[n, prompt_length]`` token ids of ``a+b=`` for each ``(a, b)`` row."""
        check_tensor(pairs, "pairs", ndim=2, dtypes=[torch.int64])
        n = len(pairs)
        a = self._number_tokens(pairs[:, 0], self.digits)
        b = self._number_tokens(pairs[:, 1], self.digits)
        plus = torch.full((n, 1), self.PLUS)
        equals = torch.full((n, 1), self.EQUALS)
        return torch.cat([a, plus, b, equals], dim=1)

    def answers(self, pairs: torch.Tensor) -> list[list[int]]:
        """The correct completion of each prompt: the sum's digits (no leading zeros), eos."""
        return [[int(c) for c in str(int(s))] + [self.EOS] for s in pairs.sum(dim=1)]

    def reward(self, completions: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """1.0 where a completion is exactly the answer followed by eos, else 0.0.

        Tokens after the first eos are padding and are ignored.
        """
        check_tensor(completions, "completions", ndim=2, dtypes=[torch.int64])
        if len(completions) != len(pairs):
            raise ValueError(f"{len(completions)} completions for {len(pairs)} prompts")
        out = torch.zeros(len(completions))
        for i, (tokens, answer) in enumerate(zip(completions.tolist(), self.answers(pairs))):
            out[i] = float(tokens[: len(answer)] == answer)
        return out

    def decode(self, tokens: torch.Tensor) -> str:
        names = {self.PLUS: "+", self.EQUALS: "=", self.EOS: "<eos>", self.PAD: ""}
        return "".join(DIGITS[t] if t < 10 else names[t] for t in tokens.tolist())
