"""The model runner: one forward pass of the Decoder over every sequence a step scheduled.

A step mixes prefills (a whole prompt, a chunk of one, or a recompute after preemption)
and decodes (one token each). :meth:`ModelRunner.prepare` packs all their new tokens
into one flat row of ``N`` tokens, as nano-vllm's ``prepare_prefill``/``prepare_decode``
and vLLM's ``_prepare_inputs`` do, and builds what attention needs to tell the sequences
apart (a :class:`PackedBatch`):

- ``positions``: each token's position in its own sequence (for the rotary embedding);
- ``slot_mapping``: the flat pool slot (``block * block_size + offset``) where each
  token's K and V go;
- ``block_tables``: one row of block ids per sequence (padded);
- ``cu_seqlens_q``: where each sequence's tokens start in the row; ``lengths``: how many
  positions each sequence has once this step's are stored (its context length);
- ``logits_indices``: each sequence's last token, the only logits a sampler needs.

The model then runs once (:class:`PagedBatchKV` is the cache it is given; its
:meth:`~PagedBatchKV.attend` calls :mod:`labkit.serve.attention`), and each sequence's
logits row comes back in the order the sequences were given.

Decode-only steps on a GPU replay a CUDA graph captured for the smallest *capture size*
that holds the batch (vLLM's ``cudagraph_capture_sizes``: 1, 2, 4, then multiples of 8,
then of 16 from 256). The padding rows write their K and V to a block the block manager
never hands out and attend over one position of it; their logits are dropped. Steps with a
prefill replay *piecewise* graphs, everything but attention, captured per padded token
count (:mod:`~labkit.serve.piecewise_graphs`), when the runner is given the step's token
budget (``max_num_batched_tokens``). Above the largest sizes the runner runs eagerly.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from .. import backend
from ..kvcache import kernels
from ..models import Decoder
from ..validate import check_choice, check_cuda_graph_flag, check_positive_int
from . import attention
from .lora import AdapterSlots, LoRAStep
from .paged_cache import KVStore, PagedKVCache
from .piecewise_graphs import PiecewiseGraphs
from .scheduler import Sequence


def capture_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph, vLLM's default list cut at ``max_batch``:
    1, 2, 4, every multiple of 8 below 256, every multiple of 16 from 256; and ``max_batch``."""
    check_positive_int(max_batch, "max_batch")
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_batch + 1, 16)]
    return [s for s in sizes if s < max_batch] + [max_batch]


@dataclass
class PackedBatch:
    """One step's model inputs: ``N`` tokens of ``B`` sequences, packed (see the module docstring)."""

    token_inputs: torch.Tensor    # [3, N] int64: input ids, positions, slot mapping (one copy moves all three)
    block_tables: torch.Tensor    # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor    # [B + 1] int32
    lengths: torch.Tensor         # [B] int32
    logits_indices: torch.Tensor  # [B] int64
    decode_only: bool             # every sequence runs exactly one token
    max_queries: int = 1          # the most tokens any one sequence runs (on the host: it sizes a launch)
    # With adapters (labkit.serve.lora): each token's and each sequence's adapter slot (-1: none),
    # and whether any is not -1 (on the host: a step without adapters skips their kernels).
    lora_slots: torch.Tensor | None = None      # [N] int32
    seq_lora_slots: torch.Tensor | None = None  # [B] int32
    uses_lora: bool = False

    @property
    def input_ids(self) -> torch.Tensor:
        """``[1, N]`` int64: the new tokens of every sequence, one after another."""
        return self.token_inputs[0:1]

    @property
    def positions(self) -> torch.Tensor:
        """``[N]`` int64: each token's position in its own sequence."""
        return self.token_inputs[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        """``[N]`` int64: the pool slot of each token's K and V, ``block * block_size + offset``."""
        return self.token_inputs[2]

    @property
    def num_seqs(self) -> int:
        return self.lengths.shape[0]


def fill_placeholders(ids: torch.Tensor, pending_tokens: torch.Tensor) -> None:
    """Put the tokens of the step still in flight in place of their placeholders, on the device:
    ``ids[i] = pending_tokens[-1 - ids[i]]`` wherever ``ids[i] < 0`` (asynchronous scheduling's
    ``-1 - j`` stands for token ``j`` of that step). Nothing is read back to the host."""
    ids.copy_(torch.where(ids < 0, pending_tokens[(-1 - ids).clamp_min(0)], ids))


def lora_step(batch: PackedBatch) -> LoRAStep | None:
    """What the adapted layers read for ``batch``: per token (BGMV) in a decode step, per
    sequence (SGMV) otherwise; ``None`` when no sequence of the step has an adapter."""
    if not batch.uses_lora:
        return None
    if batch.decode_only:
        return LoRAStep(batch.lora_slots)
    return LoRAStep(batch.lora_slots, batch.cu_seqlens_q, batch.seq_lora_slots, batch.max_queries)


def runner_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            block_tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Paged decode attention without the checks that read values back to the host.

    :func:`labkit.serve.attention.paged_decode_attention` checks its arguments' values, which
    reads them back to the host: a CUDA graph's capture cannot contain that, and in an eager
    step each read stalls the host until the device has run everything queued, every layer.
    The runner's arguments are valid by construction (int32, contiguous, built by
    :meth:`ModelRunner.prepare` from the block manager's tables, or its static buffers), so
    this path calls the same split-KV kernel without the checks, with the same launch
    (:func:`labkit.kvcache.kernels.paged_config`). Its launch depends on shapes alone: the
    tables' width (the batch's longest sequence, or ``max_model_len`` in a captured graph)
    stands for every sequence's length.
    """
    batch, width = block_tables.shape
    block_size, kv_heads, head_dim = k_pool.shape[1:]
    config = kernels.paged_config(batch, kv_heads, width * block_size, head_dim=head_dim,
                                   element_size=k_pool.element_size())
    return kernels.paged_split_kv_decode(q, k_pool, v_pool, block_tables, lengths, head_dim**-0.5, config)


def runner_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, lengths: torch.Tensor,
                             max_queries: int) -> torch.Tensor:
    """Paged prefill attention without the checks that read values back to the host.

    :func:`labkit.serve.attention.paged_prefill_attention` checks its arguments' values: six
    reads back to the host per call, so per layer, each of which stalls the host until the
    device has run everything queued, and the next layer's launches cannot run ahead of the
    kernels. The runner's packed inputs are valid by construction (:meth:`ModelRunner.prepare`
    builds them from the block manager's tables), and ``max_queries`` comes from the host.
    """
    head_dim = k_pool.shape[3]
    return kernels.paged_prefill(q, k_pool, v_pool, block_tables, cu_seqlens_q, lengths, max_queries,
                                 head_dim**-0.5)


class PagedBatchKV:
    """The cache a packed forward passes to the Decoder: each layer's K and V go to their
    slots in the pool, then attention reads every sequence through its block table.
    ``torch_attention``: attention runs the plain-torch definitions, not the kernels."""

    def __init__(self, kv: PagedKVCache, batch: PackedBatch, *, torch_attention: bool = False) -> None:
        self.kv = kv
        self.batch = batch
        self.torch_attention = torch_attention

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[1, q_heads, N, head_dim]``, ``k``, ``v`` ``[1, kv_heads, N, head_dim]`` in, the
        attention output ``[1, q_heads, N, head_dim]`` out."""
        attention.write_kv(self.kv.k[layer], self.kv.v[layer], k[0].transpose(0, 1), v[0].transpose(0, 1),
                           self.batch.slot_mapping)
        q_tokens = q[0].transpose(0, 1).contiguous()  # [N, q_heads, head_dim]
        return self.attend_stored(layer, q_tokens).transpose(0, 1).unsqueeze(0)

    def kv_store(self, layer: int) -> KVStore:
        """Where this step's K and V of layer ``layer`` go (for a kernel that stores them itself)."""
        return self.kv.store(layer, self.batch.slot_mapping)

    def attend_stored(self, layer: int, q_tokens: torch.Tensor) -> torch.Tensor:
        """Attention of ``q_tokens`` ``[N, q_heads, head_dim]`` over the pool, this step's K and V
        already stored: ``[N, q_heads, head_dim]``."""
        b = self.batch
        k_pool, v_pool = self.kv.k[layer], self.kv.v[layer]
        if self.torch_attention or q_tokens.device.type != backend.device().type:
            # The Triton kernels run where labkit runs them (the GPU, or the interpreter on a
            # machine without one); a pool elsewhere (a CPU model on a GPU machine) takes the
            # plain-torch definitions.
            decode, prefill = attention.paged_decode_attention_reference, attention.paged_prefill_attention_reference
        else:
            decode = runner_decode_attention
            prefill = functools.partial(runner_prefill_attention, max_queries=b.max_queries)
        if b.decode_only:
            return decode(q_tokens, k_pool, v_pool, b.block_tables, b.lengths)
        return prefill(q_tokens, k_pool, v_pool, b.block_tables, b.cu_seqlens_q, b.lengths)


class ModelRunner:
    """Packs a step's sequences, runs the model once, returns one logits row per sequence.

    ``kv`` is the pool; its block ``pad_block`` is never handed out by the block manager,
    and padding rows write there. ``cuda_graphs`` (default: whether the model is on a CUDA
    device) captures decode steps of up to ``max_num_seqs`` sequences, with block tables
    wide enough for ``max_model_len`` tokens (default: the model's positions), and, given
    ``max_num_batched_tokens``, piecewise graphs of steps with a prefill of up to that many
    tokens. ``attention`` is ``"triton"`` (the paged kernels) or ``"torch"`` (their
    plain-torch definitions; eager steps only, as a CUDA graph captures the kernels' launches).
    ``adapters`` (:class:`~labkit.serve.lora.AdapterSlots` over the model) adds each token's
    adapter in every adapted layer: decode graphs include those kernels, and steps with a
    prefill run eagerly.
    """

    def __init__(self, model: Decoder, kv: PagedKVCache, *, pad_block: int, max_num_seqs: int,
                 max_model_len: int | None = None, cuda_graphs: bool | None = None,
                 attention: str = "triton", max_num_batched_tokens: int | None = None,
                 adapters: AdapterSlots | None = None) -> None:
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a labkit Decoder, got {type(model).__name__}")
        if adapters is not None and not isinstance(adapters, AdapterSlots):
            raise TypeError(f"adapters must be an AdapterSlots over the model, got {type(adapters).__name__}")
        self.adapters = adapters
        self.torch_attention = check_choice(attention, "attention", ("triton", "torch")) == "torch"
        self.model = model
        self.kv = kv
        self.device = model.embed.weight.device
        self.block_size = kv.block_size
        self.pad_block = pad_block
        max_model_len = model.config.max_position_embeddings if max_model_len is None else max_model_len
        self.max_blocks_per_seq = -(-check_positive_int(max_model_len, "max_model_len") // self.block_size)
        self.cuda_graphs = check_cuda_graph_flag(cuda_graphs, "cuda_graphs", self.device)
        if self.cuda_graphs and self.torch_attention:
            raise ValueError("attention='torch' runs eagerly: pass cuda_graphs=False with it")
        self.graph_sizes = capture_sizes(check_positive_int(max_num_seqs, "max_num_seqs"))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: PackedBatch | None = None
        # Seconds the last execute() spent packing its inputs and copying them to the device, and
        # putting the pending tokens in place of their placeholders: the engine splits a step's
        # launch with them.
        self.last_prepare_s = 0.0
        self.last_placeholders_s = 0.0
        if self.device.type == "cuda":
            # CUDA loads a kernel at its first launch (lazy loading, torch's default), and the load
            # waits for the work already queued. The placeholder fill's kernels run in no other step:
            # left to the first asynchronous step with placeholders, their loading would hold the host
            # behind the step in flight (issued behind 20 ms of queued work, the first fill held an
            # H100's host 0.10 s; the next ones, 0.2 ms). Load them here, with nothing queued.
            fill_placeholders(torch.full((1,), -1, dtype=torch.int64, device=self.device),
                              torch.zeros(1, dtype=torch.int64, device=self.device))
        # With adapters, steps with a prefill run eagerly: SGMV's launch follows the step's
        # sequences, which a graph would freeze.
        self.piecewise = None if max_num_batched_tokens is None or adapters is not None else PiecewiseGraphs(
            model, kv, pad_slot=pad_block * self.block_size, max_tokens=max_num_batched_tokens,
            max_seqs=max_num_seqs)

    # -- inputs ----------------------------------------------------------------------------

    def prepare(self, seqs: SequenceOf[Sequence], *, pad_to: int | None = None) -> PackedBatch:
        """Pack the ``num_new`` tokens after each sequence's ``num_cached`` into one batch.

        ``pad_to`` (decode steps only) appends padding rows up to that many sequences, as a
        CUDA graph of that size reads them (see :meth:`stage`).

        The host work of a step is on the critical path of every step (unless the engine
        schedules asynchronously, overlapping it with the previous step's kernels), so it is
        done in numpy rather than in Python lists, and crosses to the device in two copies,
        one per dtype: the int64 inputs (``input_ids``, ``positions``, ``slot_mapping``,
        ``logits_indices``) and the int32 ones (``cu_seqlens_q``, ``lengths``,
        ``block_tables``, and with adapters each token's and each sequence's slot) are views
        of one buffer each.
        """
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        num_real = len(seqs)
        starts = np.fromiter((seq.num_cached for seq in seqs), np.int64, num_real)
        counts = np.fromiter((seq.num_new for seq in seqs), np.int64, num_real)
        table_lengths = np.fromiter((len(seq.block_table) for seq in seqs), np.int64, num_real)
        ends = starts + counts
        misfit = (counts < 1) | (-(-ends // self.block_size) > table_lengths)
        if misfit.any():
            seq = seqs[int(misfit.argmax())]
            raise ValueError(f"request {seq.request_id}: {seq.num_new} new tokens after {seq.num_cached} cached "
                             f"do not fit its {len(seq.block_table)} blocks of {self.block_size}")
        decode_only = bool((counts == 1).all())
        num_seqs = num_real if pad_to is None else pad_to
        if pad_to is not None and (not decode_only or pad_to < num_real):
            raise ValueError(f"pad_to pads decode steps to at least their {num_real} sequences, got pad_to={pad_to} "
                             f"for a step that is {'' if decode_only else 'not '}decode-only")
        pad_rows = num_seqs - num_real
        num_tokens = int(counts.sum()) + pad_rows
        width = int(table_lengths.max())
        on_device = self.device.type == "cuda"  # pinned host memory: the copies run asynchronously

        host64 = torch.empty(3 * num_tokens + num_seqs, dtype=torch.int64, pin_memory=on_device)
        lora = self.adapters is not None
        lora_entries = num_tokens + num_seqs if lora else 0  # each token's adapter slot, then each sequence's
        host32 = torch.empty(2 * num_seqs + 1 + num_seqs * width + lora_entries, dtype=torch.int32,
                             pin_memory=on_device)
        a64, a32 = host64.numpy(), host32.numpy()
        ids, positions, slots = a64[:3 * num_tokens].reshape(3, num_tokens)
        logits_indices = a64[3 * num_tokens:]
        cu_seqlens, lengths = a32[:num_seqs + 1], a32[num_seqs + 1:2 * num_seqs + 1]
        tables_end = 2 * num_seqs + 1 + num_seqs * width
        tables = a32[2 * num_seqs + 1:tables_end].reshape(num_seqs, width)

        # Padding rows: token 0 at position 0 of the pad block, which the manager never hands out.
        ids[num_tokens - pad_rows:] = 0
        positions[num_tokens - pad_rows:] = 0
        lengths[num_real:] = 1
        tables.fill(self.pad_block)
        for row, seq in enumerate(seqs):
            tables[row, :len(seq.block_table)] = seq.block_table
        cu_seqlens[0] = 0
        np.cumsum(counts, out=cu_seqlens[1:num_real + 1])
        cu_seqlens[num_real + 1:] = cu_seqlens[num_real] + np.arange(1, pad_rows + 1)
        lengths[:num_real] = ends
        logits_indices[:] = cu_seqlens[1:] - 1
        real = num_tokens - pad_rows
        if decode_only:  # one token each: index it, no slicing of the token lists
            ids[:real] = np.fromiter((seq.prompt[seq.num_cached] if seq.num_cached < len(seq.prompt)
                                      else seq.output[seq.num_cached - len(seq.prompt)] for seq in seqs),
                                     np.int64, num_real)
            positions[:real] = starts
        else:
            # (prompt and output sliced apart: seq.tokens would copy the whole sequence)
            ids[:real] = np.fromiter(itertools.chain.from_iterable(
                seq.prompt[seq.num_cached:seq.num_cached + seq.num_new]
                + seq.output[max(0, seq.num_cached - len(seq.prompt)):
                             max(0, seq.num_cached + seq.num_new - len(seq.prompt))]
                for seq in seqs), np.int64, real)
            positions[:real] = np.arange(real) - np.repeat(cu_seqlens[:num_real] - starts, counts)
        row_of_token = np.repeat(np.arange(num_seqs), np.append(counts, np.ones(pad_rows, np.int64)))
        slots[:] = tables[row_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        uses_lora = False
        if lora:
            token_lora, seq_lora = a32[tables_end:tables_end + num_tokens], a32[tables_end + num_tokens:]
            seq_lora[num_real:] = -1
            seq_lora[:num_real] = np.fromiter((seq.lora_slot for seq in seqs), np.int32, num_real)
            token_lora[:] = seq_lora[row_of_token]
            uses_lora = bool((seq_lora >= 0).any())

        dev64 = host64.to(self.device, non_blocking=True)
        dev32 = host32.to(self.device, non_blocking=True)
        return PackedBatch(
            token_inputs=dev64[:3 * num_tokens].view(3, num_tokens), logits_indices=dev64[3 * num_tokens:],
            cu_seqlens_q=dev32[:num_seqs + 1], lengths=dev32[num_seqs + 1:2 * num_seqs + 1],
            block_tables=dev32[2 * num_seqs + 1:tables_end].view(num_seqs, width),
            decode_only=decode_only, max_queries=int(counts.max()),
            lora_slots=dev32[tables_end:tables_end + num_tokens] if lora else None,
            seq_lora_slots=dev32[tables_end + num_tokens:] if lora else None, uses_lora=uses_lora)

    # -- the forward -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The model over a packed batch: logits ``[num_seqs, vocab]`` (eagerly, or being captured)."""
        indices = None if batch.decode_only else batch.logits_indices  # decode: every token is a last one
        if self.adapters is not None:
            self.adapters.step = lora_step(batch)
        try:
            logits = self.model(batch.input_ids, PagedBatchKV(self.kv, batch, torch_attention=self.torch_attention),
                                positions=batch.positions, logits_indices=indices)
        finally:
            if self.adapters is not None:
                self.adapters.step = None
        return logits[0]

    @torch.no_grad()
    def execute(self, seqs: SequenceOf[Sequence], *, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over ``seqs``; logits ``[len(seqs), vocab]``, one row per sequence in order.

        ``pending_tokens``: the tokens the previous step sampled, still on the device, when
        some of this step's input tokens are their placeholders (``-1 - i`` stands for
        ``pending_tokens[i]``; see :class:`~labkit.serve.LLM`'s ``async_scheduling``).

        A replayed step's logits are a view of its graph's output buffer, which the next
        replay overwrites: copy (or sample from) them before the next step."""
        started = time.perf_counter()
        graphed = self.cuda_graphs and len(seqs) <= self.graph_sizes[-1] and all(seq.num_new == 1 for seq in seqs)
        # A graphed step is padded on the host, so that staging it for the graph is three copies.
        batch = self.prepare(seqs, pad_to=self.capture_size(len(seqs)) if graphed else None)
        prepared = time.perf_counter()
        if pending_tokens is not None:
            fill_placeholders(batch.token_inputs[0], pending_tokens)
        self.last_prepare_s = prepared - started
        self.last_placeholders_s = time.perf_counter() - prepared
        if graphed:
            return self.replay(batch)[:len(seqs)]
        if self.cuda_graphs and self.piecewise is not None and self.piecewise.size_for(batch.input_ids.shape[1]):
            if not self.piecewise.captured:
                self.capture()
            return self.forward_piecewise(batch)
        return self.forward(batch)

    @torch.no_grad()
    def forward_piecewise(self, batch: PackedBatch) -> torch.Tensor:
        """The model over a packed batch through the piecewise graphs (replayed where captured,
        run inline otherwise, as on a CPU), attention eager between them: logits ``[num_seqs, vocab]``."""
        if self.piecewise is None:
            raise RuntimeError("this runner has no piecewise graphs: pass max_num_batched_tokens")
        if self.torch_attention:
            raise ValueError("attention='torch' runs eagerly: the piecewise path calls the paged kernels")
        pieces = self.piecewise

        def attend(layer: int, num_tokens: int) -> None:
            out = runner_prefill_attention(pieces.queries[:num_tokens], self.kv.k[layer], self.kv.v[layer],
                                           batch.block_tables, batch.cu_seqlens_q, batch.lengths, batch.max_queries)
            pieces.attn_out[:num_tokens].copy_(out)

        return pieces.run(batch, attend)

    # -- CUDA graphs ---------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture one decode graph per capture size, largest first, then the piecewise graphs of
        every token size (if the runner has them), all sharing one memory pool.

        Before each capture one eager step runs the same shapes (compiling Triton kernels
        and letting cuBLAS choose algorithms, which a capture may not do). The static inputs
        hold padding while capturing, so the captured writes land in the pad block.
        """
        if not self.cuda_graphs:
            raise RuntimeError("this runner does not use CUDA graphs (cuda_graphs=False or not on a GPU)")
        self._padding_batch(self.graph_sizes[-1])
        pool = torch.cuda.graph_pool_handle()  # one pool for every graph: one step's graphs run at a time
        for size in reversed(self.graph_sizes):
            view = self.static_batch(size)
            self.forward(view)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(view)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        if self.piecewise is not None:
            self.piecewise.capture(pool)

    def replay(self, batch: PackedBatch) -> torch.Tensor:
        """A decode batch through the graph of the smallest capture size that holds it."""
        if not self._graphs:
            self.capture()
        size = self.stage(batch)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:batch.num_seqs]

    def stage(self, batch: PackedBatch) -> int:
        """Copy a decode batch into the static inputs, padded to the smallest capture size that
        holds it (the padding rows point at the pad block); that size. What a replay reads.

        A batch :meth:`prepare` already padded to that size (as :meth:`execute` asks) takes
        three copies: its tokens, its lengths and its block tables. The static tables' columns
        past the batch's width keep whatever an earlier step left there: the kernels never
        read a table past a sequence's own blocks."""
        if self._static is None:
            self._padding_batch(self.graph_sizes[-1])
        b = batch.num_seqs
        if not batch.decode_only or b > self.graph_sizes[-1]:
            raise ValueError(f"only decode batches of up to {self.graph_sizes[-1]} sequences are staged for a "
                             f"graph, got {b} sequences (decode only: {batch.decode_only})")
        size = self.capture_size(b)
        static, width = self._static, batch.block_tables.shape[1]
        static.token_inputs[:, :b].copy_(batch.token_inputs)
        static.lengths[:b].copy_(batch.lengths)
        static.block_tables[:b, :width].copy_(batch.block_tables)
        if static.lora_slots is not None:
            static.lora_slots[:b].copy_(batch.lora_slots)
        if b < size:
            self._pad_rows(b, size)
        return size

    def graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The decode graph of capture size ``size`` (captured first if none is), as :meth:`replay`
        launches it after staging a batch: replaying it again reruns the step last staged."""
        if size not in self.graph_sizes:
            raise ValueError(f"no graph of size {size}: the capture sizes are {self.graph_sizes}")
        if not self._graphs:
            self.capture()
        return self._graphs[size][0]

    def capture_size(self, num_seqs: int) -> int:
        """The smallest capture size that holds a decode batch of ``num_seqs`` sequences."""
        return next(s for s in self.graph_sizes if s >= num_seqs)

    def static_batch(self, size: int) -> PackedBatch:
        """The first ``size`` rows of the static inputs: the batch the graph of ``size`` was captured on."""
        s = self._static
        lora_slots = s.lora_slots[:size] if s.lora_slots is not None else None
        # A graph captured with adapters runs their kernels whatever the step's slots (-1: nothing added).
        return PackedBatch(s.token_inputs[:, :size], s.block_tables[:size], s.cu_seqlens_q[:size + 1],
                           s.lengths[:size], s.logits_indices[:size], decode_only=True, lora_slots=lora_slots,
                           seq_lora_slots=lora_slots, uses_lora=lora_slots is not None)

    def _padding_batch(self, size: int) -> None:
        """Allocate the static decode inputs for ``size`` sequences, every row a padding row."""
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        batch = PackedBatch(
            token_inputs=zeros(3, size), block_tables=zeros(size, self.max_blocks_per_seq, dtype=torch.int32),
            cu_seqlens_q=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            lengths=zeros(size, dtype=torch.int32), logits_indices=torch.arange(size, device=self.device),
            decode_only=True, lora_slots=zeros(size, dtype=torch.int32) if self.adapters is not None else None)
        self._static = batch
        self._pad_rows(0, size)

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows ``start:end`` of the static inputs: token 0 at position 0 of the pad block."""
        s = self._static
        s.token_inputs[:2, start:end] = 0  # token id, position
        s.slot_mapping[start:end] = self.pad_block * self.block_size
        s.lengths[start:end] = 1
        s.block_tables[start:end] = self.pad_block
        if s.lora_slots is not None:
            s.lora_slots[start:end] = -1

