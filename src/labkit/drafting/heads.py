"""Draft heads on the target's own hidden states: Medusa's and EAGLE's, and their training losses.

Both read the target's final (normed) hidden state ``f_t``, the feature its LM head turns
into the distribution of token ``t + 1``, and both reuse the target's LM head and
embedding, frozen. Training follows Medusa-1: the target is frozen and never updated, so
the heads are trained on features computed under ``torch.no_grad`` (the training loop is
:func:`labkit.spec.train_model`, the draft's, with these losses).

- :class:`MedusaHeads` (Cai et al. 2024): head ``k`` (``k = 1..K``) is one residual block
  ``f + SiLU(W_k f)`` followed by the LM head, and predicts token ``t + k + 1`` from
  ``f_t`` alone: it must guess what comes *after* tokens it does not see.
- :class:`EagleHead` (Li et al. 2024): autoregression on features. Its input at position
  ``t`` is ``f_t`` together with the embedding of the token ``t + 1`` that was actually
  sampled (the "shifted" token, which removes the uncertainty a feature alone leaves);
  an FC layer fuses them and one decoder layer of the book's family predicts ``f_{t+1}``,
  which the LM head turns into token ``t + 2``. Drafting feeds its own predicted features
  back in, one layer per drafted token instead of the target's 28.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models import Decoder, DecoderConfig
from ..models.decoder import Block, RotaryEmbedding
from ..validate import check_positive_int


class MedusaHeads(nn.Module):
    """``num_heads`` residual blocks on the target's hidden states; logits come from the target's LM head.

    >>> heads = MedusaHeads(hidden_size=1024, num_heads=4)
    >>> logits = heads(hidden, target.lm_head.weight)     # [..., 4, vocab]: tokens t+2 .. t+5
    """

    def __init__(self, hidden_size: int, num_heads: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        # Stacked [K, H, H]: the K heads run as one batched matmul. Zero init: each head starts
        # as the LM head itself (predicting t + 1), Medusa's initialisation.
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype, device=device))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[..., H]`` -> each head's feature ``[..., K, H]``."""
        expanded = hidden.unsqueeze(-2)                                  # [..., 1, H]
        projected = torch.einsum("...h,kgh->...kg", hidden, self.weight) + self.bias
        return expanded + F.silu(projected)

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., K, V]``: head ``k`` (0-based) scores token ``t + k + 2`` from ``f_t``."""
        return F.linear(self.features(hidden), lm_head_weight)


def _frozen_features(target: Decoder, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target(ids, hidden_only=True)


def medusa_loss(target: Decoder, decay: float = 0.8) -> Callable[..., torch.Tensor]:
    """A :func:`labkit.spec.train_model` objective for :class:`MedusaHeads` on the frozen ``target``:
    ``sum_k decay^k CE(head_k(f_t), x_{t+k+2})`` over positions, on the text's own tokens (Medusa-1)."""
    if not isinstance(target, Decoder):
        raise TypeError(f"target must be a labkit Decoder, got {type(target).__name__}")

    def loss(heads: MedusaHeads, ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = _frozen_features(target, ids)                          # [B, T, H]
        logits = heads(hidden, target.lm_head.weight.detach()).float()   # [B, T, K, V]
        total, weights = 0.0, 0.0
        for k in range(heads.num_heads):
            shift = k + 2
            if ids.shape[1] <= shift:
                break
            ce = F.cross_entropy(logits[:, :-shift, k].reshape(-1, logits.shape[-1]), ids[:, shift:].reshape(-1))
            total, weights = total + decay**k * ce, weights + decay**k
        return total / weights

    return loss


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, target: Decoder, ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[K, top_k]``: how often rank ``r`` of head ``k`` is the text's token ``t + k + 2``, on windows
    ``ids`` ``[B, T]`` of held-out text: the input of :func:`labkit.drafting.best_choices`."""
    check_positive_int(top_k, "top_k")
    hidden = target(ids, hidden_only=True)
    ranks = heads(hidden, target.lm_head.weight).topk(top_k, dim=-1).indices   # [B, T, K, top_k]
    out = torch.zeros(heads.num_heads, top_k, dtype=torch.float64)
    for k in range(heads.num_heads):
        shift = k + 2
        if ids.shape[1] > shift:
            out[k] = (ranks[:, :-shift, k] == ids[:, shift:, None]).double().mean((0, 1)).cpu()
    return out


class EagleHead(nn.Module):
    """EAGLE's draft: ``fc([f_t, embed(x_{t+1})])`` then one decoder layer of ``config``'s shape,
    predicting ``f_{t+1}``; embedding and LM head are the target's (frozen, passed in).

    >>> head = EagleHead(target.config)
    >>> predicted = head(features, next_tokens, target.embed.weight)     # [B, T, H]
    """

    def __init__(self, config: DecoderConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True, dtype=dtype, device=device)
        self.block = Block(config, dtype=dtype, device=device)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for module in self.block.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02, generator=gen)
            self.fc.weight.normal_(0.0, 0.02, generator=gen)
            self.fc.bias.zero_()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, embed_weight: torch.Tensor,
                cache=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``features`` ``[B, T, H]`` (``f_t``), ``tokens`` ``[B, T]`` (``x_{t+1}``) -> predicted ``f_{t+1}``
        ``[B, T, H]``. Without ``cache`` the ``T`` positions attend causally to each other (training);
        with a :class:`labkit.spec.DenseStepKV` (batch 1) they attend as its mask says (drafting)."""
        x = self.fc(torch.cat([features, F.embedding(tokens, embed_weight)], dim=-1))
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.rope(positions, x.dtype)
        return self.block(x, cos, sin, cache, 0, False)


def eagle_loss(target: Decoder, noise: float = 0.1, token_weight: float = 0.1) -> Callable[..., torch.Tensor]:
    """A :func:`labkit.spec.train_model` objective for :class:`EagleHead` on the frozen ``target``:
    smooth-L1 regression of ``f_{t+1}`` plus ``token_weight`` times the cross-entropy of the
    target's own distribution of token ``t + 2`` under the LM head of the prediction (EAGLE's
    1.0 / 0.1 weights), with uniform noise of ``noise`` on the input features (EAGLE's
    answer to the error its drafts feed back in at inference)."""
    if not isinstance(target, Decoder):
        raise TypeError(f"target must be a labkit Decoder, got {type(target).__name__}")

    def loss(head: EagleHead, ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        features = _frozen_features(target, ids)                        # f_0 .. f_T
        inputs = features[:, :-1]
        if noise:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
        predicted = head(inputs, ids[:, 1:], target.embed.weight.detach())   # f_1 .. f_T, predicted
        wanted = features[:, 1:]
        regression = F.smooth_l1_loss(predicted.float(), wanted.float())
        lm_weight = target.lm_head.weight.detach()
        with torch.no_grad():
            target_p = F.linear(wanted, lm_weight).float().softmax(-1)
        draft_logp = F.linear(predicted, lm_weight).float().log_softmax(-1)
        classification = -(target_p * draft_logp).sum(-1).mean()
        return regression + token_weight * classification

    return loss
