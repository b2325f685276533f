"""Supervised fine-tuning, Megatron-style, on the book's model.

The chapter ``chapters/5-post-training/sft-training-loop`` builds this step by step:

- :mod:`.data`: the chat template (role markers as tokens), loss masks on assistant tokens,
  sequence packing with position ids that restart per document, the block-diagonal mask,
  and padding waste measured three ways;
- :mod:`.attention`: :class:`PackedAttention`, attention over packed documents (SDPA with
  the mask, or the FlashAttention chapter's kernel per document);
- :mod:`.loop`: :class:`SFTTrainer`, microbatches with per-token loss accumulation, warmup
  + cosine or WSD, save/resume;
- :mod:`.task`: multi-turn addition chats made from the GRPO chapter's task.
"""

from .attention import BACKENDS, PackedAttention
from .data import (
    ChatTemplate,
    Document,
    PackedBatch,
    block_diagonal_causal_mask,
    cu_seqlens_from_positions,
    first_fit_decreasing,
    lognormal_lengths,
    pack,
    pad,
    padding_waste,
)
from .loop import SCHEDULES, SFTTrainer, TrainConfig, packed_loss_sum, tokens_per_second, wsd
from .task import addition_chats, held_out_accuracy, task_names, template_for

__all__ = [
    "BACKENDS", "SCHEDULES", "ChatTemplate", "Document", "PackedAttention", "PackedBatch", "SFTTrainer",
    "TrainConfig", "addition_chats", "block_diagonal_causal_mask", "cu_seqlens_from_positions",
    "first_fit_decreasing", "held_out_accuracy", "lognormal_lengths", "pack", "packed_loss_sum", "pad",
    "padding_waste", "task_names", "template_for", "tokens_per_second", "wsd",
]
