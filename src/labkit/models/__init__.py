"""The book's model: one small Qwen3-style decoder that the inference and training chapters share.

>>> from labkit import models
>>> model = models.Decoder(models.TINY)
>>> cache = model.new_cache(batch=2, capacity=64)
>>> logits = model(prompt, cache)            # prefill: [2, T, vocab], cache.length == T
>>> logits = model(next_token, cache)        # one decode step: [2, 1, vocab]
>>> runner = models.GraphedDecoder(model, batch=2, capacity=64)   # decode steps from a CUDA graph

Weights from a Hugging Face ``Qwen3ForCausalLM`` state dict load with
:func:`load_hf_state_dict`; :func:`hf_config_kwargs` and :func:`config_from_hf` translate
configs. The tests check logits against ``transformers``' own implementation.
"""

from .cache import GrowingKVCache, KVCache, StaticKVCache
from .config import BOOK_GPU, QWEN3_SIZES, TINY, DecoderConfig, book_config
from .decoder import Decoder, apply_rope, attend, causal_mask
from .generate import CACHE_MODES, Generation, GraphedDecoder, generate_greedy
from .hf import (
    config_from_hf,
    hf_config_kwargs,
    hf_key_to_ours,
    load_hf_state_dict,
    our_key_to_hf,
    to_hf_state_dict,
)
from .text import random_windows, stdlib_corpus
from .train import adamw, lm_loss, masked_cross_entropy_sum, train_lm, warmup_cosine

__all__ = [
    "BOOK_GPU", "CACHE_MODES", "QWEN3_SIZES", "TINY", "Decoder", "DecoderConfig", "Generation", "GraphedDecoder",
    "GrowingKVCache", "KVCache", "StaticKVCache", "apply_rope", "attend", "book_config", "causal_mask",
    "config_from_hf", "generate_greedy", "hf_config_kwargs", "hf_key_to_ours", "load_hf_state_dict",
    "adamw", "lm_loss", "masked_cross_entropy_sum", "our_key_to_hf", "random_windows", "stdlib_corpus", "to_hf_state_dict", "train_lm", "warmup_cosine",
]
