"""Train the book's model, byte-level and small, on the standard library; save it in bf16.

    python -m labkit.quant.make_checkpoint            # writes stdlib_decoder.pt beside this file

The quantization chapter needs a *trained* model: quantizing random weights says nothing
about perplexity. This one is a Qwen3-style :class:`labkit.models.Decoder` with a
256-token (byte) vocabulary, trained on one CPU core in about ten minutes on the train split of
:mod:`labkit.quant.corpus`. The saved file holds the bf16 state dict and every setting
below, so the run can be repeated and checked.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import models
from . import corpus

CHECKPOINT = Path(__file__).with_name("stdlib_decoder.pt")

CONFIG = models.DecoderConfig(
    vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    intermediate_size=384, rope_theta=10_000.0, tie_word_embeddings=True, max_position_embeddings=4096,
)
SETTINGS = dict(steps=900, batch=16, seq_len=128, lr=3e-3, warmup=30, weight_decay=0.1, seed=0,
                grad_clip=1.0)


def _batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])


def lm_loss(model: models.Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of ``tokens`` ``[batch, T+1]``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(steps: int, batch: int, seq_len: int, lr: float, warmup: int, weight_decay: float,
          seed: int, grad_clip: float, log_every: int = 50) -> tuple[models.Decoder, list[float]]:
    torch.manual_seed(seed)
    train_files, _ = corpus.split_files()
    data = corpus.load_bytes(train_files)
    model = models.Decoder(CONFIG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        # Linear warmup, then cosine decay to a tenth of the peak.
        frac = (step - warmup) / max(steps - warmup, 1)
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        loss = lm_loss(model, _batch(data, batch, seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f} nats/byte  {time.perf_counter() - t0:6.1f} s", flush=True)
    return model, losses


def load_checkpoint(path: Path | str = CHECKPOINT, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> models.Decoder:
    """The trained model from ``path`` (default: the committed checkpoint), in ``dtype`` on ``device``."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    config = models.DecoderConfig(**saved["config"])
    model = models.Decoder(config, dtype=dtype, device=device)
    state = {k: v.to(dtype) for k, v in saved["state_dict"].items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]  # saved once; the model shares it
    model.load_state_dict(state)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, losses = train(**SETTINGS)
    state = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to embed.weight
    torch.save({
        "config": asdict(CONFIG), "settings": SETTINGS, "final_train_loss": losses[-1],
        "python": sys.version.split()[0], "torch": str(torch.__version__),
        "train_files": [f.name for f in corpus.split_files()[0]], "state_dict": state,
    }, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
