"""The quality side of the trade: the book's model trained with MHA, GQA, MQA and MLA attention.

Every variant is the same decoder (:class:`labkit.models.Decoder`: embedding, RMSNorm,
SwiGLU, LM head) with a different attention, trained by the same loop
(:func:`labkit.models.train_lm`) on the same byte-level text (the standard library's
source, :func:`labkit.models.stdlib_corpus`), from the same seed, on the same batches, for
the same number of steps, and scored on the same held-out windows (files never trained
on). What differs is what attention may keep per token:

- MHA: a key and a value per head; GQA: per group of heads; MQA: one for all heads;
- MLA: one latent of ``kv_lora_rank = 4 x head_dim`` and one rotary key of
  ``head_dim / 2``, DeepSeek-V2's proportions (512 and 64 at head_dim 128), which makes its
  cache as large as GQA with 2.25 groups.

A second MHA run from another seed measures how much two runs of the *same* variant
differ: a gap between variants smaller than that is noise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .. import backend, models
from .module import MLAConfig, mla_decoder


@dataclass(frozen=True)
class TrainingSetup:
    """The model's shared shape and the training run every variant gets."""

    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int
    batch: int
    steps: int
    lr: float
    eval_windows: int
    corpus_bytes: int


CPU_SETUP = TrainingSetup(hidden_size=48, num_layers=2, num_heads=4, head_dim=12, intermediate_size=96,
                          seq_len=64, batch=8, steps=40, lr=3e-3, eval_windows=16, corpus_bytes=400_000)
GPU_SETUP = TrainingSetup(hidden_size=512, num_layers=6, num_heads=8, head_dim=64, intermediate_size=1408,
                          seq_len=256, batch=32, steps=500, lr=2e-3, eval_windows=128, corpus_bytes=4_000_000)


def setup() -> TrainingSetup:
    """The run at this machine's size."""
    return backend.pick(cpu=CPU_SETUP, gpu=GPU_SETUP)


def _config(s: TrainingSetup, kv_heads: int) -> models.DecoderConfig:
    return models.DecoderConfig(vocab_size=models.text.VOCAB_SIZE, hidden_size=s.hidden_size,
                                num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=kv_heads,
                                head_dim=s.head_dim, intermediate_size=s.intermediate_size, rope_theta=10_000.0)


def mla_config(s: TrainingSetup) -> MLAConfig:
    """DeepSeek-V2's proportions at this head size: latent 4 x head_dim, rotary key head_dim / 2."""
    return MLAConfig(kv_lora_rank=4 * s.head_dim, qk_nope_head_dim=s.head_dim,
                     qk_rope_head_dim=s.head_dim // 2, v_head_dim=s.head_dim)


def variants(s: TrainingSetup) -> dict[str, tuple[int, int | None]]:
    """Name -> (KV heads for a plain decoder, or None for MLA; seed)."""
    gqa = max(2, s.num_heads // 4)
    return {"MHA": (s.num_heads, 0), f"GQA-{gqa}": (gqa, 0), "MQA": (1, 0), "MLA": (None, 0),
            "MHA (seed 1)": (s.num_heads, 1)}


def build(s: TrainingSetup, kv_heads: int | None, seed: int, device: torch.device | str) -> tuple[torch.nn.Module, int]:
    """A variant's model and its cached elements per token and layer."""
    if kv_heads is None:
        config, mla = _config(s, s.num_heads), mla_config(s)
        return mla_decoder(config, mla, device=device, seed=seed), mla.row
    return models.Decoder(_config(s, kv_heads), device=device, seed=seed), 2 * kv_heads * s.head_dim


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) over fixed held-out windows."""
    return sum(models.lm_loss(model, w).item() for w in windows.split(32)) / math.ceil(len(windows) / 32)


def train_variants(s: TrainingSetup | None = None, *, progress: bool = False) -> list[dict]:
    """Train every variant of :func:`variants` once; one row each (losses, cache size, params)."""
    s = setup() if s is None else s
    if not isinstance(s, TrainingSetup):
        raise TypeError(f"s must be a TrainingSetup, got {type(s).__name__}")
    device = backend.device()
    train, held_out = models.stdlib_corpus(max_bytes=s.corpus_bytes)
    eval_ids = models.random_windows(held_out, s.eval_windows, s.seq_len + 1,
                                     torch.Generator().manual_seed(1234)).to(device)
    rows = []
    for name, (kv_heads, seed) in variants(s).items():
        model, per_layer = build(s, kv_heads, seed, device)
        data = torch.Generator().manual_seed(seed)  # same batches for every variant of a seed

        def next_batch(step, data=data):
            return models.random_windows(train, s.batch, s.seq_len + 1, data).to(device)

        start = time.perf_counter()
        losses = models.train_lm(model, next_batch, steps=s.steps, lr=s.lr, progress=progress, desc=name)
        seconds = time.perf_counter() - start
        tail = losses[-max(1, s.steps // 10):]
        attn_params = sum(p.numel() for p in model.blocks[0].attn.parameters())
        rows.append({
            "variant": name, "seed": seed, "kv_heads": kv_heads if kv_heads is not None else "latent",
            "kv_elements_per_token_layer": per_layer,
            "kv_bytes_per_token_bf16": 2 * per_layer * s.num_layers,
            "kv_fraction_of_mha": per_layer / (2 * s.num_heads * s.head_dim),
            "params": sum(p.numel() for p in model.parameters()),
            "attention_params_per_layer": attn_params,
            "train_loss_last10pct": sum(tail) / len(tail),
            "held_out_loss": held_out_loss(model, eval_ids),
            "train_seconds": seconds,
            # About fifty points of the loss curve, for the figure.
            "loss_curve": losses[:: max(1, s.steps // 50)],
        })
        del model
    for r in rows:
        r["held_out_bits_per_byte"] = r["held_out_loss"] / math.log(2)
    return rows

