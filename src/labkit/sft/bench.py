"""``sft.throughput``: training tokens per second, padded against packed, on the book's model.

One global batch of documents with log-normal lengths is laid out two ways, one document
per padded row or first-fit-decreasing packed, and a full :meth:`SFTTrainer.train_step`
(forward, backward, AdamW) is timed on each. The rate counts *real* tokens, so padding
costs what it costs: the ratio packed/padded is what packing buys at that length
distribution. Attention runs the FlashAttention chapter's kernel per document (no
``N x N`` mask), so both layouts pay only for the tokens they hold.

The kernel is called once per document, so a step meets dozens of distinct lengths. Its
autotuner keys on power-of-two buckets of the length (:func:`labkit.attention.kernels.tuning_length`),
so the two warm-up steps tune a handful of keys and the timed steps tune none; keyed on
exact lengths, the first step tuned ten candidates for each of some 35 lengths and the
benchmark ran past its time cap before timing anything.
"""

from __future__ import annotations

import torch

from .. import backend, timing
from ..benchmarks import Measurement, benchmark
from ..models import BOOK_GPU, TINY, Decoder
from ..results import Goal
from .data import Document, lognormal_lengths, pack, pad
from .loop import SFTTrainer, TrainConfig, packed_loss_sum


def _documents(lengths: list[int], vocab: int, seed: int) -> list[Document]:
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 2:] = True  # the second half plays the answer
        docs.append(Document(torch.randint(0, vocab - 1, (n,), generator=gen), mask))
    return docs


@benchmark("sft.throughput", chapter="sft-training-loop",
           title="SFT training tokens/s: padded rows against packed rows (real tokens only)")
def sft_throughput() -> Measurement:
    config = backend.pick(cpu=TINY, gpu=BOOK_GPU)
    # On the GPU the padded layout's logits dominate memory (rows x seq_len x vocab in fp32):
    # 16 documents in rows of 2048 keep them near 20 GB.
    seq_len, documents, median = backend.pick(cpu=(64, 12, 20), gpu=(2048, 16, 300))
    dtype = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
    lengths = lognormal_lengths(documents, median=median, sigma=0.9, max_len=seq_len, seed=0)
    docs = _documents(lengths, config.vocab_size, seed=1)
    rows = []
    for layout, build in (("padded", pad), ("packed", pack)):
        batch = build(docs, seq_len, config.vocab_size - 1)
        model = Decoder(config, dtype=dtype, device=backend.device())
        trainer = SFTTrainer(model, TrainConfig(steps=10_000, lr=1e-5),
                             loss_fn=lambda m, b: packed_loss_sum(m, b, attention="flash"))
        t = timing.measure(lambda: trainer.train_step([batch]), warmup=2, reps=backend.pick(cpu=2, gpu=5),
                           flush_l2=False)
        seconds = t.median_ms / 1e3
        rows.append({"layout": layout, "rows": batch.ids.shape[0], "seq_len": seq_len,
                     "real_tokens": batch.real_tokens, "efficiency": batch.efficiency,
                     "step_ms": t.median_ms, "tokens_per_s": batch.real_tokens / seconds,
                     "timing": t.method})
        del trainer, model
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    for row in rows:
        row["ours/padded"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return Measurement(
        rows=rows, metric="real (non-padding) training tokens per second, one train_step",
        goals=[Goal("packed/padded tokens per second", speedup, ">=", 1.0)],
        config={"model": {k: getattr(config, k) for k in ("hidden_size", "num_layers", "vocab_size")},
                "dtype": str(dtype), "documents": documents, "median_length": median, "sigma": 0.9,
                "attention": "labkit.attention.flash_attention per document",
                "autotune_key": "power-of-two buckets of each document's length, tuned in the warm-up steps"},
    )
