"""The chapter's fine-tuning experiments: a base task, a second task, and what each method learns.

The base model learns :class:`SymbolMapTask`: read ``n`` symbols, a separator, then write
each symbol's image under a fixed permutation of the alphabet. The fine-tuning task is the
same format under a *different* permutation, which agrees with the base one on half of the
alphabet: a change of behaviour the base model has the machinery for (attend to the
symbol, look up its image), the kind of adaptation fine-tuning is used for.

- :func:`update_spectra`: fully fine-tune a copy and take the SVD of ``Delta W`` for every
  block matrix; compare with the spectrum of a random matrix of the same shape and size.
- :func:`compare_methods`: fine-tune the base with each variant (and plain LoRA over ranks)
  with one loop, :func:`labkit.models.train_lm`, the same steps and learning rates per
  family, and report answer accuracy and loss on fresh sequences against trainable
  parameters. The budget of steps is short on purpose: given long enough, every method
  fits this task, and what differs is how fast.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .. import models
from ..validate import check_positive_int
from .layers import VARIANTS, add_lora, trainable_parameters


@dataclass(frozen=True)
class SymbolMapTask:
    """``BOS x_1..x_n SEP y_1..y_n`` with ``y_i = perm[x_i]``; ``alphabet`` symbols (ids 2..)."""

    alphabet: int
    length: int
    perm: tuple[int, ...]

    BOS = 0
    SEP = 1

    @classmethod
    def make(cls, alphabet: int, length: int, seed: int) -> "SymbolMapTask":
        check_positive_int(alphabet, "alphabet")
        check_positive_int(length, "length")
        gen = torch.Generator().manual_seed(seed)
        return cls(alphabet, length, tuple(torch.randperm(alphabet, generator=gen).tolist()))

    def variant(self, changed: int, seed: int) -> "SymbolMapTask":
        """The same task with the images of ``changed`` symbols permuted among themselves."""
        if isinstance(changed, bool) or not isinstance(changed, int) or not 2 <= changed <= self.alphabet:
            raise ValueError(f"changed must be an int from 2 to the alphabet's {self.alphabet} symbols "
                             f"(a cycle needs two), got {changed!r}")
        gen = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(self.alphabet, generator=gen)[:changed]
        perm = list(self.perm)
        # a cyclic shift of the chosen symbols' images: every chosen symbol's image changes
        images = [perm[i] for i in chosen.tolist()]
        for i, image in zip(chosen.tolist(), images[1:] + images[:1]):
            perm[i] = image
        return SymbolMapTask(self.alphabet, self.length, tuple(perm))

    @property
    def vocab_size(self) -> int:
        return self.alphabet + 2

    def batch(self, size: int, generator: torch.Generator, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [size, 2n + 2], loss_mask)``: the mask marks the answer tokens."""
        x = torch.randint(0, self.alphabet, (size, self.length), generator=generator)
        y = torch.tensor(self.perm)[x]
        bos = torch.full((size, 1), self.BOS)
        sep = torch.full((size, 1), self.SEP)
        ids = torch.cat([bos, x + 2, sep, y + 2], dim=1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, self.length + 2:] = True
        return ids.to(device), mask.to(device)


@torch.no_grad()
def evaluate(model: nn.Module, task: SymbolMapTask, size: int = 512, seed: int = 12345) -> tuple[float, float]:
    """``(accuracy, loss)`` on fresh sequences: the share of answer tokens predicted right
    (argmax, teacher forced) and the mean cross-entropy of the answer tokens (nats)."""
    device = next(model.parameters()).device
    ids, mask = task.batch(size, torch.Generator().manual_seed(seed), device)
    model.eval()
    predicted = model(ids[:, :-1]).argmax(-1)
    right = (predicted == ids[:, 1:]) & mask[:, 1:]
    return right.sum().item() / mask[:, 1:].sum().item(), models.lm_loss(model, ids, mask).item()


@dataclass(frozen=True)
class Setup:
    """Sizes and schedules of one run of the experiments (CPU and GPU pick different ones)."""

    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    alphabet: int
    length: int
    changed: int
    batch: int
    base_steps: int
    finetune_steps: int
    base_lr: float = 3e-3
    full_lr: float = 1e-3
    lora_lr: float = 1e-2
    rank: int = 8
    ranks: tuple[int, ...] = (1, 2, 4, 8, 16)

    def config(self) -> models.DecoderConfig:
        return models.DecoderConfig(vocab_size=self.alphabet + 2, hidden_size=self.hidden, num_layers=self.layers,
                                    num_heads=self.heads, num_kv_heads=max(1, self.heads // 2),
                                    head_dim=self.head_dim, intermediate_size=self.intermediate,
                                    rope_theta=10_000.0, tie_word_embeddings=True)


def tasks(setup: Setup) -> tuple[SymbolMapTask, SymbolMapTask]:
    base = SymbolMapTask.make(setup.alphabet, setup.length, seed=0)
    return base, base.variant(setup.changed, seed=1)


def _batches(task: SymbolMapTask, setup: Setup, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda step: task.batch(setup.batch, gen, device)


def train_base(setup: Setup, device="cpu", progress: bool = False) -> tuple[models.Decoder, list[float]]:
    """The book's decoder at ``setup``'s size, trained on the base task."""
    base_task, _ = tasks(setup)
    model = models.Decoder(setup.config(), device=device, seed=0)
    losses = models.train_lm(model, _batches(base_task, setup, device, seed=10), steps=setup.base_steps,
                             lr=setup.base_lr, progress=progress, desc="base task")
    return model, losses


def block_matrices(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every block linear's weight ``[N, K]`` by name (``blocks.0.attn.wq``, ...)."""
    return {name.removesuffix(".weight"): p.detach() for name, p in model.named_parameters()
            if name.startswith("blocks.") and p.ndim == 2}


def full_finetune(base: models.Decoder, setup: Setup, progress: bool = False) -> tuple[models.Decoder, list[float]]:
    """A copy of ``base`` with every weight trained on the second task."""
    _, task = tasks(setup)
    model = copy.deepcopy(base)
    device = next(base.parameters()).device
    losses = models.train_lm(model, _batches(task, setup, device, seed=11), steps=setup.finetune_steps,
                             lr=setup.full_lr, progress=progress, desc="full fine-tune")
    return model, losses


def update_spectra(base: nn.Module, tuned: nn.Module, ranks=(1, 2, 4, 8, 16)) -> list[dict]:
    """For every block matrix: singular values of ``Delta W`` (normalised by the largest) and the
    share of ``||Delta W||_F^2`` in its top ``r`` directions; the same for a Gaussian matrix of
    the same shape, the spectrum of an update with no structure."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    tuned_w = block_matrices(tuned)
    for name, w in block_matrices(base).items():
        delta = (tuned_w[name] - w).double().cpu()
        noise = torch.randn(delta.shape, generator=gen, dtype=torch.float64)
        spectra = {"delta": torch.linalg.svdvals(delta), "random": torch.linalg.svdvals(noise)}
        row = {"matrix": name, "shape": list(delta.shape),
               "relative_change": (delta.norm() / w.double().cpu().norm()).item()}
        for kind, s in spectra.items():
            energy = (s**2).cumsum(0) / (s**2).sum()
            row[f"{kind}_singular_values"] = (s / s[0]).tolist()
            row.update({f"{kind}_energy_top{r}": energy[min(r, len(s)) - 1].item() for r in ranks})
            row[f"{kind}_stable_rank"] = ((s**2).sum() / s[0] ** 2).item()
        rows.append(row)
    return rows


def finetune_method(base: models.Decoder, setup: Setup, variant: str, rank: int,
                    progress: bool = False) -> dict:
    """Fine-tune a copy of ``base`` with ``variant`` at ``rank``; its accuracy and trainable parameters."""
    _, task = tasks(setup)
    model = add_lora(copy.deepcopy(base), rank=rank, alpha=2 * rank, variant=variant)
    device = next(base.parameters()).device
    losses = models.train_lm(model, _batches(task, setup, device, seed=11), steps=setup.finetune_steps,
                             lr=setup.lora_lr, progress=progress, desc=f"{variant} r={rank}")
    accuracy, loss = evaluate(model, task)
    return {"method": variant, "rank": rank, "trainable": trainable_parameters(model),
            "accuracy": accuracy, "eval_loss": loss, "losses": losses}


def compare_methods(setup: Setup, device="cpu", progress: bool = False) -> dict:
    """The whole experiment: base model, full fine-tune and its spectra, every variant at
    ``setup.rank`` and plain LoRA at ``setup.ranks``."""
    base_task, task = tasks(setup)
    base, base_losses = train_base(setup, device, progress)
    tuned, full_losses = full_finetune(base, setup, progress)
    (base_acc, base_loss), (full_acc, full_loss) = evaluate(base, task), evaluate(tuned, task)
    methods = [{"method": "base model (no fine-tune)", "rank": 0, "trainable": 0,
                "accuracy": base_acc, "eval_loss": base_loss, "losses": []},
               {"method": "full fine-tune", "rank": None, "trainable": trainable_parameters(tuned),
                "accuracy": full_acc, "eval_loss": full_loss, "losses": full_losses}]
    methods += [finetune_method(base, setup, variant, setup.rank, progress) for variant in VARIANTS]
    methods += [finetune_method(base, setup, "lora", r, progress) for r in setup.ranks if r != setup.rank]
    return {"base_accuracy_on_base_task": evaluate(base, base_task)[0],
            "base_losses": base_losses, "spectra": update_spectra(base, tuned, setup.ranks), "methods": methods}
