"""The rollout worker: the policy's own copy inside :class:`labkit.serve.LLM`, sampling groups.

RL systems do not sample with the trainer's model: verl, slime and Miles hand rollouts to
an inference engine (vLLM or SGLang) with its own copy of the weights, its paged KV cache,
continuous batching and CUDA graphs, because generation dominates an RL step. The worker
asks the engine for ``n = group_size`` samples per prompt (they share the prompt's KV
blocks) and for each sampled token's log-probability as the engine computed it, then lays
the result out as :class:`labkit.grpo.Rollout`, the format the GRPO trainer reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..grpo import Rollout, completion_mask
from ..models import Decoder
from ..serve import LLM, SamplingParams
from ..validate import check_positive_int, check_tensor
from .sync import SyncStats, sync_weights


@dataclass
class RolloutBatch:
    """A rollout, and the engine's log-probability of every counted token (0 elsewhere),
    aligned with ``rollout.mask`` (position ``t`` is the token at ``t + 1``)."""

    rollout: Rollout
    rollout_logp: torch.Tensor  # [N, T-1]


class RolloutWorker:
    """A copy of ``policy`` in ``dtype`` behind an :class:`~labkit.serve.LLM` sized for
    ``max_num_seqs`` sequences of up to ``max_model_len`` tokens.

    ``attention`` defaults to the paged Triton kernels on a GPU and to their plain-torch
    definitions on a CPU (the Triton interpreter would take minutes per rollout).
    :meth:`load_weights` is the weight sync: it copies a trainer's weights into the
    engine's model in place, so the engine (and its captured CUDA graphs) sees them at once.
    """

    def __init__(self, policy: Decoder, *, max_num_seqs: int, max_model_len: int,
                 dtype: torch.dtype | None = None, block_size: int = 16, attention: str | None = None,
                 cuda_graphs: bool | None = None) -> None:
        if not isinstance(policy, Decoder):
            raise TypeError(f"policy must be a labkit Decoder, got {type(policy).__name__}")
        check_positive_int(max_num_seqs, "max_num_seqs")
        check_positive_int(max_model_len, "max_model_len")
        device = policy.embed.weight.device
        dtype = dtype or policy.embed.weight.dtype
        self.model = Decoder(policy.config, dtype=dtype, device=device).eval().requires_grad_(False)
        self.load_weights(policy)
        attention = attention or ("triton" if device.type == "cuda" else "torch")
        blocks_per_seq = -(-max_model_len // block_size)
        self.llm = LLM(self.model, num_blocks=max_num_seqs * blocks_per_seq, block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max(2048, max_num_seqs * max_model_len),
                       max_model_len=max_model_len, attention=attention,
                       cuda_graphs=cuda_graphs if attention == "triton" else False)

    def load_weights(self, policy: Decoder) -> SyncStats:
        """Copy ``policy``'s weights into the engine's model (see :func:`labkit.rl.sync.sync_weights`)."""
        return sync_weights(policy, self.model)

    def generate(self, prompts: torch.Tensor, *, group_size: int, max_new_tokens: int, eos: int, pad: int,
                 temperature: float = 1.0, seed: int = 0) -> RolloutBatch:
        """``group_size`` samples of each prompt row (all rows the same length), rows
        ``b*G .. b*G+G-1`` for prompt ``b`` as :func:`labkit.grpo.sample_group` lays them out;
        completions stop at ``eos`` or after ``max_new_tokens`` and are padded with ``pad``.
        Prompt ``b``'s samples draw from generators seeded ``seed + b*G + i``."""
        check_tensor(prompts, "prompts", ndim=2, dtypes=[torch.int64])
        check_positive_int(group_size, "group_size")
        check_positive_int(max_new_tokens, "max_new_tokens")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, stop_token_ids=(eos,),
                                 seed=seed + b * group_size, n=group_size, logprobs=True)
                  for b in range(len(prompts))]
        outputs = self.llm.generate(prompts.tolist(), params)
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise ValueError(f"the engine refused {len(failed)} prompts, first: {failed[0]}")
        n, p = len(prompts) * group_size, prompts.shape[1]
        completions = torch.full((n, max_new_tokens), pad, dtype=torch.int64)
        logprobs = torch.zeros(n, max_new_tokens)
        for row, sample in enumerate(s for o in outputs for s in (o, *o.more_samples)):
            completions[row, :len(sample.tokens)] = torch.tensor(sample.tokens)
            logprobs[row, :len(sample.logprobs)] = torch.tensor(sample.logprobs)
        device = prompts.device
        tokens = torch.cat([prompts.repeat_interleave(group_size, dim=0), completions.to(device)], dim=1)
        mask = torch.zeros(n, tokens.shape[1] - 1, device=device)
        mask[:, p - 1:] = completion_mask(completions, eos).to(device)
        rollout_logp = torch.zeros_like(mask)
        rollout_logp[:, p - 1:] = logprobs.to(device)
        return RolloutBatch(Rollout(tokens, mask, p), rollout_logp * mask)

