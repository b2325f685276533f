"""Multi-head latent attention as a module of the book's decoder, and its latent cache.

:func:`mla_decoder` builds a :class:`labkit.models.Decoder` and swaps each block's
attention for :class:`MLAttention` and the model's rotary table for one of the decoupled
rotary width; the embedding, norms, MLP, LM head, training loop and generation are the
book's own. The module follows DeepSeek-V2's attention (``modeling_deepseek.py``):

- queries: ``W_Q x`` per head, split into ``qk_nope_head_dim`` columns without position
  and ``qk_rope_head_dim`` rotated ones (DeepSeek-V2/V3 first compress the query through a
  ``q_lora_rank`` bottleneck to save activations in training; that does not change the
  cache, and the small model leaves it out);
- keys and values: ``W_DKV x`` gives the latent ``c`` (``kv_lora_rank``, RMS-normed) and
  one rotary key ``k_pe`` shared by all heads; head ``h``'s key is ``[W_UK[h] c ; k_pe]``
  and its value ``W_UV[h] c``. Only ``c`` and ``k_pe`` are cached.

RoPE cannot act on ``c``: a rotation by position between ``W_UK`` and the query would
stop ``W_UK`` from being absorbed into it. Hence the *decoupled* rotary key, carried
beside the latent.

Decode steps (one new token) with ``decode_kernel=True`` run the absorbed Triton kernel
(:func:`labkit.mla.mla_decode`); everything else decompresses the cached latents into
per-head K and V and calls SDPA, as a prefill does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import models
from ..models.decoder import RMSNorm, RotaryEmbedding, apply_rope, attend
from ..validate import check_positive_int, check_tensor
from .reference import absorb_query, split_cache, unabsorb_output


@dataclass(frozen=True)
class MLAConfig:
    """MLA's widths. DeepSeek-V2/V3: 512, 128, 64, 128."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive_int(getattr(self, name), name)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")

    @property
    def row(self) -> int:
        """Cached elements per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """Softmax scale: over the full key width ``nope + rope``, as DeepSeek's."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


DEEPSEEK_V3 = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


class LatentCache:
    """A preallocated MLA cache: ``rows`` ``[layers, batch, capacity, kv_lora_rank + rope]``.

    It has the interface :class:`labkit.models.Decoder` expects of a cache (``length``,
    ``append``, ``advance``, ``truncate``); :meth:`append` takes the latent and the rotary
    key of the new tokens and returns every cached row of the layer, in the one-tensor
    layout the decode kernel reads.
    """

    def __init__(self, num_layers: int, mla: MLAConfig, batch: int, capacity: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if not isinstance(mla, MLAConfig):
            raise TypeError(f"mla must be an MLAConfig, got {type(mla).__name__}")
        for value, name in ((num_layers, "num_layers"), (batch, "batch"), (capacity, "capacity")):
            check_positive_int(value, name)
        self.mla = mla
        self.rows = torch.empty(num_layers, batch, capacity, mla.row, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.rows.shape[2]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def append(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Write ``latent`` ``[batch, new, kv_lora_rank]`` and ``k_pe`` ``[batch, new, rope]``
        after the cached positions of ``layer``; return its rows ``[batch, length + new, row]``."""
        num_layers, batch, _, _ = self.rows.shape
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
        check_tensor(latent, "latent", ndim=3, dtypes=(self.rows.dtype,))
        check_tensor(k_pe, "k_pe", ndim=3, dtypes=(self.rows.dtype,))
        r, e = self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        if latent.shape[0] != batch or latent.shape[2] != r or k_pe.shape != (*latent.shape[:2], e):
            raise ValueError(f"expected latent [batch={batch}, new, {r}] and k_pe [batch, new, {e}], "
                             f"got {tuple(latent.shape)} and {tuple(k_pe.shape)}")
        end = self.length + latent.shape[1]
        if end > self.capacity:
            raise ValueError(f"cache full: {self.length} cached + {latent.shape[1]} new > capacity {self.capacity}")
        self.rows[layer, :, self.length:end, :r] = latent
        self.rows[layer, :, self.length:end, r:] = k_pe
        return self.rows[layer, :, :end]

    def advance(self, new: int) -> None:
        self.length += new

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}], got {length}")
        self.length = length


class MLAttention(nn.Module):
    """DeepSeek-V2's multi-head latent attention, with the book's attention interface."""

    def __init__(self, config: models.DecoderConfig, mla: MLAConfig, **factory) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        self.num_heads, self.mla = heads, mla
        self.wq = nn.Linear(h, heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim), bias=False, **factory)
        self.w_dkv = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False, **factory)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, **factory)
        self.w_uk = nn.Linear(mla.kv_lora_rank, heads * mla.qk_nope_head_dim, bias=False, **factory)
        self.w_uv = nn.Linear(mla.kv_lora_rank, heads * mla.v_head_dim, bias=False, **factory)
        self.wo = nn.Linear(heads * mla.v_head_dim, h, bias=False, **factory)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` ``[heads, nope, latent]`` and ``W_UV`` ``[heads, v_dim, latent]``."""
        r = self.mla.kv_lora_rank
        return self.w_uk.weight.view(self.num_heads, -1, r), self.w_uv.weight.view(self.num_heads, -1, r)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None,
                layer: int, decode_kernel: bool) -> torch.Tensor:
        batch, new, _ = x.shape
        mla, heads = self.mla, self.num_heads
        q = self.wq(x).view(batch, new, heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        latent, k_pe = self.w_dkv(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_pe = apply_rope(k_pe[:, None], cos, sin)[:, 0]  # one rotary key for all heads
        if cache is not None:
            rows = cache.append(layer, latent, k_pe)
        else:
            rows = torch.cat([latent, k_pe], dim=-1)
        w_uk, w_uv = self.up_weights()
        if decode_kernel and new == 1:
            from . import mla_decode  # the package's checked entry point

            lengths = torch.full((batch,), rows.shape[1], dtype=torch.int32, device=x.device)
            o_latent = mla_decode(absorb_query(q_nope[:, :, 0], w_uk), q_pe[:, :, 0].contiguous(), rows,
                                  lengths, scale=mla.scale)
            out = unabsorb_output(o_latent, w_uv)[:, :, None]
        else:
            c, k_pe_all = split_cache(rows, mla.kv_lora_rank)
            k_nope = self.w_uk(c).view(batch, -1, heads, mla.qk_nope_head_dim).transpose(1, 2)
            v = self.w_uv(c).view(batch, -1, heads, mla.v_head_dim).transpose(1, 2)
            k = torch.cat([k_nope, k_pe_all[:, None].expand(-1, heads, -1, -1)], dim=-1)
            # SDPA scales by the query's width, nope + rope: DeepSeek's scale.
            out = attend(torch.cat([q_nope, q_pe], dim=-1), k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, new, -1))


def mla_decoder(config: models.DecoderConfig, mla: MLAConfig, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", seed: int = 0, init_std: float = 0.02) -> models.Decoder:
    """The book's decoder with MLA in every block (``config.num_kv_heads`` and ``head_dim`` unused).

    ``model.new_cache`` still makes a per-head cache; pass :class:`LatentCache` to the forward:
    ``model(ids, LatentCache(config.num_layers, mla, batch, capacity))``.
    """
    if not isinstance(mla, MLAConfig):
        raise TypeError(f"mla must be an MLAConfig, got {type(mla).__name__}")
    model = models.Decoder(config, dtype=dtype, device=device, seed=seed, init_std=init_std)
    factory = dict(dtype=dtype, device=device)
    for block in model.blocks:
        block.attn = MLAttention(config, mla, **factory)
    model.rope = RotaryEmbedding(mla.qk_rope_head_dim, config.rope_theta, device=device)
    model.reset_parameters(seed, init_std)  # the swapped-in weights start as the rest do
    return model
