"""Length extrapolation, measured: train at length ``L``, read held-out text at ``L``, ``2L``, ``4L``.

Each trained scheme (:data:`TRAINED_SCHEMES`) gets its own model, trained with the book's
loop (:func:`labkit.models.train_lm`) on windows of ``L`` bytes of the standard library's
source (:func:`labkit.models.stdlib_corpus`). The RoPE model is then also read with the
long-context variants of :data:`ROPE_EXTENSIONS` swapped in at inference, each set for the
length it reads (``factor = length / L``), as a deployment sets ``rope_scaling`` for its
target context. With ``finetune_steps``, copies of the RoPE model are also fine-tuned for
that many steps on windows of the longest length, each with one of :data:`FINETUNED`
swapped in at that length's factor and kept for every reading (``"rope+ft"``, plain RoPE
fine-tuned long, is the control). Every model reads the same held-out windows, and the
result is the next-byte loss by position, in buckets, for every scheme, length and seed.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..models import DecoderConfig, random_windows, stdlib_corpus, train_lm
from ..models.text import VOCAB_SIZE
from ..validate import check_choice, check_positive_int
from . import schemes
from .model import PositionalDecoder

TRAINED_SCHEMES = ("nope", "sinusoidal", "learned", "rope", "alibi")
ROPE_EXTENSIONS = ("pi", "ntk", "yarn")
SCHEMES = TRAINED_SCHEMES + ROPE_EXTENSIONS
FINETUNED = ("rope", "pi", "yarn")
INIT_STD = 0.02  # the book model's initial weight scale; the sinusoidal table is scaled to it


@dataclass(frozen=True)
class ExtrapolationRun:
    """One experiment's settings: the model, the training and the evaluation."""

    model: DecoderConfig
    train_length: int
    steps: int
    batch: int
    lr: float
    seeds: tuple[int, ...]
    eval_windows: int
    bucket: int
    eval_multiples: tuple[int, ...] = (1, 2, 4)
    corpus_bytes: int = 4_000_000
    eval_batch: int = 16
    trained: tuple[str, ...] = TRAINED_SCHEMES
    extensions: tuple[str, ...] = ROPE_EXTENSIONS
    finetune_steps: int = 0
    finetune_batch: int = 16
    finetune_lr_scale: float = 0.3
    finetuned: tuple[str, ...] = FINETUNED

    def __post_init__(self) -> None:
        if self.model.vocab_size != VOCAB_SIZE:
            raise ValueError(f"the text is bytes, so the model's vocab_size must be {VOCAB_SIZE}, "
                             f"got {self.model.vocab_size}")
        for name in ("train_length", "steps", "batch", "eval_windows", "bucket", "corpus_bytes", "eval_batch",
                     "finetune_batch"):
            check_positive_int(getattr(self, name), name)
        if isinstance(self.finetune_steps, bool) or not isinstance(self.finetune_steps, int) or self.finetune_steps < 0:
            raise ValueError(f"finetune_steps must be an int >= 0 (0: no fine-tuning), got {self.finetune_steps!r}")
        if self.train_length % self.bucket:
            raise ValueError(f"bucket ({self.bucket}) must divide train_length ({self.train_length}), so that "
                             "no bucket straddles the trained length")
        if not self.seeds or not self.eval_multiples:
            raise ValueError("an experiment needs at least one seed and one evaluation length")
        for multiple in self.eval_multiples:
            check_positive_int(multiple, "each of eval_multiples")
        for name in self.trained:
            check_choice(name, "each trained scheme", TRAINED_SCHEMES)
        for name in self.extensions:
            check_choice(name, "each RoPE extension", ROPE_EXTENSIONS)
        for name in self.finetuned:
            check_choice(name, "each fine-tuned scheme", FINETUNED)
        if (self.extensions or self.finetune_steps) and "rope" not in self.trained:
            raise ValueError("RoPE extensions are applied to the RoPE-trained model: put 'rope' in trained")

    @property
    def eval_lengths(self) -> list[int]:
        return [m * self.train_length for m in self.eval_multiples]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = asdict(self.model)
        return d


def make_scheme(name: str, config: DecoderConfig, *, train_length: int, length: int) -> schemes.PositionScheme:
    """The scheme ``name`` for a model trained at ``train_length`` that reads ``length`` tokens.

    The RoPE extensions are set for that length: ``factor = length / train_length`` (1, a
    no-op, at the trained length). A learned table is built as long as ``length``.
    """
    check_choice(name, "scheme", SCHEMES)
    d, theta = config.head_dim, config.rope_theta
    factor = max(1.0, length / train_length)
    if name == "nope":
        return schemes.NoPE()
    if name == "sinusoidal":
        return schemes.Sinusoidal(config.hidden_size, rms=INIT_STD)
    if name == "learned":
        return schemes.Learned(config.hidden_size, length)
    if name == "rope":
        return schemes.rope(d, theta)
    if name == "alibi":
        return schemes.ALiBi(config.num_heads)
    if name == "pi":
        return schemes.position_interpolation(d, theta, factor)
    if name == "ntk":
        return schemes.ntk_aware(d, theta, factor)
    return schemes.yarn(d, theta, factor, original_max_positions=train_length)


@torch.inference_mode()
def loss_by_position(model: torch.nn.Module, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """Mean next-token loss (nats) at each input position ``0..T-2`` of ``ids`` ``[windows, T]``, fp32 ``[T-1]``."""
    check_positive_int(batch, "batch")
    total = torch.zeros(ids.shape[1] - 1, dtype=torch.float64, device=ids.device)
    for chunk in ids.split(batch):
        logits = model(chunk[:, :-1]).float()
        losses = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")  # [b, T-1]
        total += losses.double().sum(0)
    return (total / ids.shape[0]).float()


def _bucket_rows(losses: torch.Tensor, bucket: int, **labels) -> list[dict]:
    rows = []
    for start in range(0, len(losses), bucket):
        part = losses[start:start + bucket]
        # Rounded to 1e-5 nats, far below the seed-to-seed spread, to keep the record small.
        rows.append({**labels, "position_start": start, "position_end": start + len(part),
                     "loss": round(float(part.mean()), 5)})
    return rows


def run_extrapolation(run: ExtrapolationRun, device: torch.device | str = "cpu", progress: bool = False) -> dict:
    """Train every scheme of ``run`` for every seed and read the held-out windows at every length.

    Returns ``rows`` (one per scheme, evaluation length, seed and position bucket, with the
    mean loss there), ``final_train_loss`` (per scheme, per seed: the mean of the last tenth
    of the steps) and the seconds spent training and evaluating.
    """
    if not isinstance(run, ExtrapolationRun):
        raise TypeError(f"run must be an ExtrapolationRun, got {type(run).__name__}")
    device = torch.device(device)
    train_text, held_out = stdlib_corpus(max_bytes=run.corpus_bytes)
    longest = max(run.eval_lengths)
    # The same held-out windows for every scheme and seed: differences are the schemes'.
    windows = random_windows(held_out, run.eval_windows, longest + 1, torch.Generator().manual_seed(12345)).to(device)
    rows, final_loss = [], {}
    seconds = {"train": 0.0, "evaluate": 0.0}
    for name in run.trained:
        for seed in run.seeds:
            scheme = make_scheme(name, run.model, train_length=run.train_length, length=longest)
            model = PositionalDecoder(run.model, scheme, device=device, seed=seed, init_std=INIT_STD)
            data = torch.Generator().manual_seed(seed)
            t0 = time.perf_counter()
            losses = train_lm(model, lambda step: random_windows(train_text, run.batch, run.train_length + 1, data).to(device),
                              steps=run.steps, lr=run.lr, progress=progress, desc=f"{name} seed {seed}")
            seconds["train"] += time.perf_counter() - t0
            tail = losses[-max(1, run.steps // 10):]
            final_loss.setdefault(name, []).append(sum(tail) / len(tail))
            t0 = time.perf_counter()
            readings = [(name, name)] + ([(ext, "rope") for ext in run.extensions] if name == "rope" else [])
            for shown, trained_as in readings:
                for length in run.eval_lengths:
                    if shown != name:  # an extension set for this length, swapped into the trained RoPE model
                        model.use_scheme(make_scheme(shown, run.model, train_length=run.train_length, length=length))
                    losses_here = loss_by_position(model, windows[:, :length + 1], run.eval_batch)
                    rows += _bucket_rows(losses_here.cpu(), run.bucket, scheme=shown, trained_as=trained_as,
                                         eval_length=length, seed=seed)
            seconds["evaluate"] += time.perf_counter() - t0
            if name == "rope" and run.finetune_steps:
                rows += _finetune_and_read(model, run, train_text, windows, seed, seconds, progress)
    return {"rows": rows, "final_train_loss": final_loss, "seconds": seconds,
            "corpus_bytes": {"train": int(train_text.numel()), "held_out": int(held_out.numel())}}


def _finetune_and_read(rope_model: PositionalDecoder, run: ExtrapolationRun, train_text: torch.Tensor,
                       windows: torch.Tensor, seed: int, seconds: dict, progress: bool) -> list[dict]:
    """Fine-tune a copy of the RoPE model per scheme of ``run.finetuned`` at the longest length; read it."""
    longest, device = max(run.eval_lengths), windows.device
    rows = []
    for shown in run.finetuned:
        model = copy.deepcopy(rope_model)
        model.use_scheme(make_scheme(shown, run.model, train_length=run.train_length, length=longest))
        data = torch.Generator().manual_seed(10_000 + seed)
        t0 = time.perf_counter()
        train_lm(model, lambda step: random_windows(train_text, run.finetune_batch, longest + 1, data).to(device),
                 steps=run.finetune_steps, lr=run.lr * run.finetune_lr_scale, progress=progress,
                 desc=f"{shown}+ft seed {seed}")
        seconds["finetune"] = seconds.get("finetune", 0.0) + time.perf_counter() - t0
        for length in run.eval_lengths:  # the fine-tuned model keeps its scheme, as a deployment would
            losses_here = loss_by_position(model, windows[:, :length + 1], run.eval_batch)
            rows += _bucket_rows(losses_here.cpu(), run.bucket, scheme=f"{shown}+ft", trained_as="rope",
                                 eval_length=length, seed=seed)
    return rows


def summarize(rows: list[dict], train_length: int) -> list[dict]:
    """Per scheme and evaluation length: the mean loss over seeds, over all positions and beyond ``train_length``.

    Also the spread over seeds (min and max of each seed's own mean), so a reader sees
    whether a gap between schemes is larger than the seed-to-seed noise.
    """
    per_seed: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        key = (r["scheme"], r["eval_length"], r["seed"])
        slot = per_seed.setdefault(key, {"all": [], "beyond": []})
        slot["all"].append(r["loss"])
        if r["position_start"] >= train_length:
            slot["beyond"].append(r["loss"])
    table: dict[tuple, dict[str, list[float]]] = {}
    for (scheme, length, _seed), slot in per_seed.items():
        entry = table.setdefault((scheme, length), {"all": [], "beyond": []})
        entry["all"].append(sum(slot["all"]) / len(slot["all"]))
        if slot["beyond"]:
            entry["beyond"].append(sum(slot["beyond"]) / len(slot["beyond"]))
    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    out = []
    for (scheme, length), entry in table.items():
        out.append({"scheme": scheme, "eval_length": length, "seeds": len(entry["all"]),
                    "loss": mean(entry["all"]), "loss_min": min(entry["all"]), "loss_max": max(entry["all"]),
                    "loss_beyond_train": mean(entry["beyond"]),
                    "loss_beyond_train_min": min(entry["beyond"]) if entry["beyond"] else None,
                    "loss_beyond_train_max": max(entry["beyond"]) if entry["beyond"] else None})
    return out


__all__ = ["FINETUNED", "ROPE_EXTENSIONS", "SCHEMES", "TRAINED_SCHEMES", "ExtrapolationRun", "loss_by_position",
           "make_scheme", "run_extrapolation", "summarize"]
