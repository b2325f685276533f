"""The book's decoder: Qwen3's architecture in about a hundred lines of plain torch.

One block is ``x + attn(norm(x))`` then ``x + mlp(norm(x))``. Attention is grouped-query
(``num_kv_heads`` K/V heads, each shared by ``group_size`` query heads) with an RMSNorm on
every query and key head before the rotary embedding, as Qwen3 does; the MLP is SwiGLU.
Everything runs in the dtype of the weights except the norms' statistics (fp32), as in
Hugging Face's ``Qwen3ForCausalLM``, which the tests hold this model to.

``forward(ids, cache)`` with a cache processes only the new tokens: their K and V are
appended to the cache and attention reads the cached ones. That is incremental decoding,
and it is exact: position ``t``'s K and V depend only on tokens ``<= t`` (causal), so the
ones computed at step ``t`` are the ones a full recomputation would produce.

``Decoder(config, fused=True)`` (or setting ``model.fused``) runs the norms, the rotary
embedding, the SwiGLU activation and each residual add with the norm after it through
the Triton kernels of :mod:`labkit.fused`, forward and backward; the matmuls and
attention are the same either way, and so are the logits, up to rounding.

:meth:`Decoder.fuse_projections` stacks each layer's q, k and v weights into one matrix and
its gate and up weights into another, as inference engines load their models (vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear``): the separate weights become views
of the stacked ones, and a fused model's inference forward runs one matmul where it ran
three, and one where it ran two. In such a model's packed forward (:mod:`labkit.serve`'s),
``model.decode_matmul = "split_k"`` runs each layer's four matmuls (q/k/v, output, gate/up,
down) through :mod:`labkit.matmul`'s split-K kernel instead of ``F.linear`` (cuBLAS on a
GPU) when they have at most :data:`SPLIT_K_MAX_ROWS` rows, as a decode step's sequences do.

With a :class:`~labkit.models.StaticKVCache`, a one-token step takes its position from the
device and attends over the whole capacity through the decode kernel's ``lengths``, so the
same kernels with the same arguments serve every step: what a CUDA graph needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import fused as fused_ops
from .. import matmul as matmul_ops
from ..kvcache import decode_attention
from ..kvcache.kernels import default_config, split_kv_decode
from ..validate import check_choice, check_tensor
from .cache import GrowingKVCache, KVCache, StaticKVCache
from .config import DecoderConfig


DECODE_MATMULS = ("torch", "split_k")
# The split-K kernel's 64-row tile holds a decode step of up to this many sequences.
SPLIT_K_MAX_ROWS = 64


def inference_linear(x: torch.Tensor, weight: torch.Tensor, decode_matmul: str) -> torch.Tensor:
    """``x @ weight.T`` in an inference forward: with ``decode_matmul`` ``"split_k"`` and at
    most :data:`SPLIT_K_MAX_ROWS` rows (all but the last axis flattened), through
    :mod:`labkit.matmul`'s split-K kernel, whose autotuner splits K so that a decode step's
    few output tiles still give every SM a share of the weight to read; else ``F.linear``."""
    rows = x.numel() // x.shape[-1]
    if decode_matmul == "split_k" and rows <= SPLIT_K_MAX_ROWS and not torch.is_grad_enabled():
        out = matmul_ops.matmul(x.reshape(rows, x.shape[-1]), weight.t(), kernel="split_k")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def apply_linear(layer: nn.Module, x: torch.Tensor, decode_matmul: str) -> torch.Tensor:
    """``layer(x)``; with ``decode_matmul`` ``"split_k"``, through :func:`inference_linear` where
    ``layer`` is a plain bias-free ``nn.Linear`` (a layer wrapped since, with adapters, runs
    its own forward). Otherwise the module is called, hooks and all."""
    if decode_matmul == "split_k" and type(layer) is nn.Linear and layer.bias is None:
        return inference_linear(x, layer.weight, decode_matmul)
    return layer(x)


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` with the statistic in fp32 and the result rounded back first."""

    def __init__(self, dim: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; rotates the two halves of each head (Qwen/Llama layout)."""

    def __init__(self, head_dim: int, theta: float, device=None) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, T, head_dim]`` by the angles of its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_mask(new: int, total: int, device: torch.device) -> torch.Tensor:
    """Which keys each of the ``new`` last queries may see among ``total`` positions."""
    query_pos = torch.arange(total - new, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    return key_pos <= query_pos


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of the last ``q.shape[2]`` positions over all ``k.shape[2]``.

    Only a prefill that follows cached tokens (a chunked prefill) needs an explicit mask.
    The two common cases avoid one on purpose: an explicit mask sends SDPA with
    ``enable_gqa`` to its slow math kernel, while ``is_causal`` (a fresh prefill) and no
    mask (one decode query, which may see every cached key) keep the flash kernel.
    """
    new, total = q.shape[2], k.shape[2]
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if new == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(new, total, q.device), enable_gqa=True)


def stack_as_views(*linears: nn.Linear) -> torch.Tensor:
    """One matrix holding the weights of ``linears`` one under another; each weight's data
    becomes a view of its rows (the Parameter objects stay, so an optimizer holding them
    still updates the model, and no second copy is kept). A single matmul by it computes
    all of theirs."""
    stacked = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = stacked[start:start + rows]
        start += rows
    return stacked


def unstack_views(*linears: nn.Linear) -> None:
    """Give each linear's weight storage of its own again (the undoing of :func:`stack_as_views`)."""
    for linear in linears:
        linear.weight.data = linear.weight.detach().clone()


def stacked_weight(stacked: torch.Tensor | None, *linears: nn.Module) -> torch.Tensor | None:
    """``stacked`` if one matmul by it may stand for ``linears`` in this forward, else ``None``.

    It may in inference (no gradient would reach the separate weights through it) while
    every linear is still a plain ``nn.Linear`` whose weight is the view of its rows that
    :func:`stack_as_views` made: a layer wrapped since (LoRA) or a weight replaced or moved
    since (``.to()``) falls back to the separate matmuls."""
    if stacked is None or torch.is_grad_enabled():
        return None
    row_bytes = stacked.stride(0) * stacked.element_size()
    address = stacked.data_ptr()
    for linear in linears:
        weight = getattr(linear, "weight", None)
        if type(linear) is not nn.Linear or weight is None or weight.data_ptr() != address:
            return None
        address += weight.shape[0] * row_bytes
    return stacked


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.wq = nn.Linear(h, config.num_heads * d, bias=False, **factory)
        self.wk = nn.Linear(h, config.num_kv_heads * d, bias=False, **factory)
        self.wv = nn.Linear(h, config.num_kv_heads * d, bias=False, **factory)
        self.wo = nn.Linear(config.num_heads * d, h, bias=False, **factory)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, **factory)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, **factory)
        self.fused = False
        self.decode_matmul = "torch"
        self.qkv_weight: torch.Tensor | None = None  # wq, wk, wv stacked (Decoder.fuse_projections)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | GrowingKVCache | StaticKVCache | None, layer: int,
                decode_kernel: bool) -> torch.Tensor:
        batch, new, _ = x.shape
        packed = hasattr(cache, "attend")
        qkv_weight = stacked_weight(self.qkv_weight, self.wq, self.wk, self.wv) if packed and self.fused else None
        if qkv_weight is not None:
            # One matmul for q, k and v, then one kernel for both norms, the rotation and the
            # cache stores; attention reads the stored K and V.
            qkv = inference_linear(x[0], qkv_weight, self.decode_matmul)  # [N, (Hq + 2 Hk) * D]
            store = cache.kv_store(layer)
            queries = store.queries if store.queries is not None else qkv.new_empty(new, self.num_heads, self.head_dim)
            q = fused_ops.qkv_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                                        q_out=queries, k_out=store.k_rows, v_out=store.v_rows,
                                        slot_mapping=store.slot_mapping)
            return apply_linear(self.wo, cache.attend_stored(layer, q).reshape(batch, new, -1), self.decode_matmul)
        q = self.q_norm(self.wq(x).view(batch, new, self.num_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, new, self.num_kv_heads, self.head_dim))
        v = self.wv(x).view(batch, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.fused:
            # Rotate in the projections' [B, T, H, D] layout, where each token's heads are
            # contiguous, then transpose: the same tensors as below, in one kernel.
            q, k = fused_ops.rope_(q, k, cos, sin)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if packed:
            # A packed batch of many sequences over a paged pool (labkit.serve's model
            # runner): the cache stores K and V at each token's slot and runs the attention.
            return self.wo(cache.attend(layer, q, k, v).transpose(1, 2).reshape(batch, new, -1))
        if cache is not None:
            k, v = cache.append(layer, k, v)
        if isinstance(cache, StaticKVCache) and new == 1:
            # k and v span the whole capacity; the kernel reads the first lengths[b] positions
            # and decides its launch from shapes alone, so nothing here waits on the device.
            config = default_config(batch, self.num_kv_heads, k.shape[2])
            out = split_kv_decode(q[:, :, 0], k, v, cache.lengths, self.head_dim**-0.5, config).unsqueeze(2)
        elif decode_kernel and new == 1:
            lengths = torch.full((batch,), k.shape[2], dtype=torch.int32, device=x.device)
            out = decode_attention(q[:, :, 0], k, v, lengths).unsqueeze(2)
        else:
            out = attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, new, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        h, m = config.hidden_size, config.intermediate_size
        self.gate = nn.Linear(h, m, bias=False, **factory)
        self.up = nn.Linear(h, m, bias=False, **factory)
        self.down = nn.Linear(m, h, bias=False, **factory)
        self.fused = False
        self.decode_matmul = "torch"
        self.gate_up_weight: torch.Tensor | None = None  # gate and up stacked (Decoder.fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate_up_weight = stacked_weight(self.gate_up_weight, self.gate, self.up)
            if gate_up_weight is not None:
                hidden = fused_ops.swiglu_halves(inference_linear(x, gate_up_weight, self.decode_matmul))
                return apply_linear(self.down, hidden, self.decode_matmul)
            return self.down(fused_ops.swiglu(self.gate(x), self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.attn = Attention(config, **factory)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, **factory)

    def forward(self, x, cos, sin, cache, layer, decode_kernel):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, decode_kernel)
        return x + self.mlp(self.mlp_norm(x))

    def forward_fused(self, stream, pending, cos, sin, cache, layer, decode_kernel):
        """The same block with each residual add fused into the norm that reads its sum.

        ``stream`` is the residual stream and ``pending`` the previous block's MLP output
        not yet added to it (``None`` before the first block); returns the new pair. The
        last add happens in the final norm (:meth:`Decoder.forward`), so every add of the
        model is one kernel with a norm, as vLLM's and Liger's Qwen3 do it.
        """
        if pending is None:
            normed = self.attn_norm(stream)
        else:
            normed, stream = fused_ops.add_rms_norm(pending, stream, self.attn_norm.weight, self.attn_norm.eps)
        attn_out = self.attn(normed, cos, sin, cache, layer, decode_kernel)
        normed, stream = fused_ops.add_rms_norm(attn_out, stream, self.mlp_norm.weight, self.mlp_norm.eps)
        return stream, self.mlp(normed)


class Decoder(nn.Module):
    """A Qwen3-style causal language model. ``Decoder(config)(ids)`` gives logits.

    Weights start as Qwen3's initializer does (normal, std ``init_std`` = 0.02; norms at
    one), drawn from ``seed`` so two models built alike are equal. (Untrained weights that
    small make greedy decoding repeat one token; tests pass a larger ``init_std`` so the
    tokens vary and a wrong cache shows.) Load real or HF-made weights with
    :func:`labkit.models.load_hf_state_dict`.
    """

    def __init__(self, config: DecoderConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, init_std: float = 0.02,
                 fused: bool = False) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        factory = dict(dtype=dtype, device=device)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.blocks = nn.ModuleList(Block(config, **factory) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, device=device)
        self.reset_parameters(seed, init_std)
        self.fused = fused
        self.decode_matmul = "torch"

    @property
    def fused(self) -> bool:
        """Whether the non-matmul parts run as :mod:`labkit.fused`'s Triton kernels."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"fused must be a bool, got {type(value).__name__}")
        self._fused = value
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = value

    @property
    def decode_matmul(self) -> str:
        """How the stacked projections' inference matmuls run (see :meth:`fuse_projections`):
        ``"torch"`` (``F.linear``) or ``"split_k"`` (:func:`inference_linear`). Capture CUDA
        graphs after setting it: a graph replays the kernels it was captured with."""
        return self._decode_matmul

    @decode_matmul.setter
    def decode_matmul(self, value: str) -> None:
        check_choice(value, "decode_matmul", DECODE_MATMULS)
        self._decode_matmul = value
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.decode_matmul = value

    def fuse_projections(self) -> None:
        """Stack every layer's q, k and v weights into one matrix and its gate and up weights
        into another, as inference engines load a model, so that a fused model's inference
        forward runs one matmul for q, k and v and one for gate and up (three and two
        launches become one each: at a decode step's few tokens a matmul's time is mostly
        launch and ramp-up, not bytes).

        The separate weights' data become views of the stacked ones: no memory is added, the
        parameters and the state dict are unchanged, and an optimizer step or
        ``load_state_dict`` on them writes the stacked matrix too. Training, an unfused
        model, and a layer replaced since (LoRA) use the separate matmuls (see
        :func:`stacked_weight`). Call it after ``.to()``, and
        before capturing CUDA graphs: a graph keeps reading the matrices it was captured with.
        """
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            if attn.qkv_weight is None:
                attn.qkv_weight = stack_as_views(attn.wq, attn.wk, attn.wv)
            if mlp.gate_up_weight is None:
                mlp.gate_up_weight = stack_as_views(mlp.gate, mlp.up)

    def unfuse_projections(self) -> None:
        """Undo :meth:`fuse_projections`: every projection its own weight again."""
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            if attn.qkv_weight is not None:
                unstack_views(attn.wq, attn.wk, attn.wv)
                attn.qkv_weight = None
            if mlp.gate_up_weight is not None:
                unstack_views(mlp.gate, mlp.up)
                mlp.gate_up_weight = None

    @property
    def projections_fused(self) -> bool:
        """Whether :meth:`fuse_projections` stacked the weights (and nothing has undone it)."""
        return all(b.attn.qkv_weight is not None and b.mlp.gate_up_weight is not None for b in self.blocks)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, init_std: float = 0.02) -> None:
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or init_std <= 0:
            raise ValueError(f"init_std must be a positive number, got {init_std!r}")
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, init_std, generator=gen)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A preallocated cache for ``batch`` sequences of up to ``capacity`` tokens, in the model's dtype."""
        w = self.embed.weight
        return KVCache(self.config, batch, capacity, dtype=w.dtype, device=w.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | GrowingKVCache | StaticKVCache | None = None, *,
                last_only: bool = False, decode_kernel: bool = False, positions: torch.Tensor | None = None,
                logits_indices: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """Logits ``[batch, T, vocab]`` for ``input_ids`` ``[batch, T]``.

        ``hidden_only`` returns the final normed hidden states ``[batch, T, hidden]`` instead,
        for losses that apply the LM head themselves a chunk at a time (:mod:`labkit.align`),
        so that the full ``T x vocab`` logits never exist at once.

        With ``cache``, the ids are the *next* ``T`` tokens after the cached ones (a prefill
        when the cache is empty, a decode step when ``T == 1``); the cache is extended.
        ``last_only`` computes logits for the last position only (``[batch, 1, vocab]``):
        all a sampler needs, and it spares a ``T x vocab`` matmul. ``decode_kernel`` runs
        decode steps' attention with :func:`labkit.kvcache.decode_attention`; a
        :class:`~labkit.models.StaticKVCache`'s decode steps always use the kernel.

        A serving engine packs many sequences' new tokens into one row (``[1, N]``) and
        passes what a single cache length cannot say: ``positions`` ``[N]``, each token's
        position in its own sequence, and ``logits_indices``, the tokens whose logits it
        samples from (each sequence's last; the result is then ``[1, len(indices), vocab]``).
        Its cache is then a packed batch with an ``attend`` method (see
        :mod:`labkit.serve.model_runner`) and is not advanced here.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"input_ids must be an int32/int64 tensor, got {got}")
        if input_ids.ndim != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be [batch, tokens] and non-empty, got shape {tuple(input_ids.shape)}")
        packed = hasattr(cache, "attend")
        # Any object with the caches' interface serves (labkit.serve's paged sequence view does).
        if cache is not None and not packed and not all(hasattr(cache, name) for name in ("length", "append", "advance")):
            raise TypeError(f"cache must have length, append and advance (a KVCache, GrowingKVCache or "
                            f"paged sequence view) or attend (a packed batch), got {type(cache).__name__}")
        new = input_ids.shape[1]
        if packed != (positions is not None):
            raise ValueError("positions go with a packed batch's cache (one with attend) and only with it")
        if logits_indices is not None and last_only:
            raise ValueError("pass last_only or logits_indices, not both")
        x = self.embed(input_ids)
        if positions is not None:
            # The caller checked the positions against max_position_embeddings on the host:
            # reading them back here would stall a CUDA graph's capture.
            check_tensor(positions, "positions", ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)
            if input_ids.shape[0] != 1 or positions.shape[0] != new:
                raise ValueError(f"a packed batch is input_ids [1, N] with positions [N], got "
                                 f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        elif isinstance(cache, StaticKVCache) and new == 1:
            positions = cache.position  # on the device: one captured step serves every position
        else:
            start = cache.length if cache is not None else 0
            if start + new > self.config.max_position_embeddings:
                raise ValueError(f"{start + new} positions exceed max_position_embeddings "
                                 f"{self.config.max_position_embeddings}")
            positions = torch.arange(start, start + new, device=x.device)
        cos, sin = self.rope(positions, x.dtype)
        if self.fused:
            pending = None
            for layer, block in enumerate(self.blocks):
                x, pending = block.forward_fused(x, pending, cos, sin, cache, layer, decode_kernel)
            if last_only:
                x, pending = x[:, -1:].contiguous(), pending[:, -1:].contiguous()
            elif logits_indices is not None:
                x, pending = x[:, logits_indices].contiguous(), pending[:, logits_indices].contiguous()
            normed = fused_ops.add_rms_norm(pending, x, self.norm.weight, self.norm.eps)[0]
        else:
            for layer, block in enumerate(self.blocks):
                x = block(x, cos, sin, cache, layer, decode_kernel)
            if last_only:
                x = x[:, -1:]
            elif logits_indices is not None:
                x = x[:, logits_indices]
            normed = self.norm(x)
        if cache is not None and not packed:
            cache.advance(new)
        return normed if hidden_only else self.lm_head(normed)
