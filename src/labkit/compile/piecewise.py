"""vLLM's piecewise compilation, reproduced on the book's model and the serving engine's runner.

A decode step's batch size changes every step, and a graph compiled for one size is
useless at another. vLLM's answer (``vllm/compilation/backends.py``), rebuilt here in
four moves:

1. **One Dynamo capture with a dynamic batch.** The step is traced once, at the largest
   capture size, with the token dimension marked dynamic (``torch._dynamo.mark_dynamic``):
   the FX graph speaks of ``s0`` tokens, not of 8. Dynamo's guards are then dropped
   (``guard_filter_fn``), so no later call at another size re-traces, as vLLM does.
2. **Split at attention.** Attention is registered as an opaque custom op
   (``torch.ops.labkit.paged_decode_attention``, :func:`store_and_attend`; vLLM's
   ``unified_attention``); the backend cuts the
   graph before and after every call of it (:func:`split_at`, with
   ``torch.fx.passes.split_module``). ``L`` layers give ``L + 1`` pieces of matmuls, norms,
   RoPE and SwiGLU between ``L`` attention calls.
3. **N concrete-shape Inductor compilations.** Each piece (:class:`Piece`) is compiled by
   Inductor once per capture size, with that size's real inputs: code specialised to 1, 2,
   4, 8 tokens rather than one generic kernel for ``s0``. Attention stays eager.
4. **Dispatch by padded batch size.** The runner pads a batch of ``b`` sequences up to the
   smallest capture size that holds it (the engine's static buffers and padding rows,
   :class:`labkit.serve.ModelRunner`); each piece finds its size among its arguments and
   runs that size's code, on a GPU replayed from a CUDA graph of that piece (piecewise
   CUDA graphs: attention runs between the graphs, not inside them).

:class:`CompiledModelRunner` is the serving engine's model runner with that decode path;
prefill and mixed steps, and batches above the largest size, still run eagerly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .. import backend
from ..models import Decoder
from ..serve import attention
from ..serve.model_runner import ModelRunner, runner_decode_attention
from ..serve.paged_cache import PagedKVCache
from ..validate import check_positive_int


def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pools: torch.Tensor,
                     v_pools: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """One layer's decode attention as one opaque op: store the new tokens' K and V in the
    pool (``[layers, blocks, block_size, kv_heads, d]``), then attend over each sequence's
    blocks. ``q`` ``[N, q_heads, d]``, ``k``, ``v`` ``[N, kv_heads, d]``; returns ``[N, q_heads, d]``.

    Dynamo records a call of it and never looks inside, which is what makes it a place to
    cut the graph; it is the serving engine's own kernel path (graph-safe: no value is read
    back to the host).
    """
    attention.write_kv(k_pools[layer], v_pools[layer], k, v, slot_mapping)
    if q.device.type != backend.device().type:
        # A model on the CPU of a GPU machine: the Triton kernel runs on the GPU only (as the
        # serving runner's PagedBatchKV, take the plain-torch definition).
        return attention.paged_decode_attention_reference(q, k_pools[layer], v_pools[layer], block_tables, lengths)
    return runner_decode_attention(q, k_pools[layer], v_pools[layer], block_tables, lengths)


# Registered as an opaque op: Dynamo records a call of it and never traces inside.
paged_decode_attention = torch.library.custom_op("labkit::paged_decode_attention",
                                                 mutates_args=("k_pools", "v_pools"))(store_and_attend)


@paged_decode_attention.register_fake
def _paged_decode_attention_fake(q, k, v, k_pools, v_pools, layer, slot_mapping, block_tables, lengths):
    # What tracing needs to know: the output's shape, dtype and device, not its values.
    return torch.empty_like(q)


SPLIT_OPS = (torch.ops.labkit.paged_decode_attention, torch.ops.labkit.paged_decode_attention.default)


class SplitAttentionKV:
    """The cache a compiled decode step hands the :class:`~labkit.models.Decoder`: each
    layer's attention becomes one call of :func:`paged_decode_attention` (the split point)."""

    def __init__(self, kv: PagedKVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 lengths: torch.Tensor) -> None:
        self.kv, self.slot_mapping, self.block_tables, self.lengths = kv, slot_mapping, block_tables, lengths

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[1, q_heads, N, d]``, ``k``, ``v`` ``[1, kv_heads, N, d]`` in (the model's packed
        layout), ``[1, q_heads, N, d]`` out."""
        def tokens(t):
            return t[0].transpose(0, 1).contiguous()

        out = torch.ops.labkit.paged_decode_attention(
            tokens(q), tokens(k), tokens(v), self.kv.k, self.kv.v, layer,
            self.slot_mapping, self.block_tables, self.lengths)
        return out.transpose(0, 1).unsqueeze(0)


def is_split_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls the attention op the graph is cut at."""
    return node.op == "call_function" and node.target in SPLIT_OPS


def split_at(gm: torch.fx.GraphModule, is_split: Callable[[torch.fx.Node], bool] = is_split_node
             ) -> torch.fx.GraphModule:
    """``gm`` cut before and after every node ``is_split`` picks: a graph of ``submod_i``
    calls, the picked nodes each alone in their own submodule (vLLM's ``split_graph``)."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    piece = 0
    assignment: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split(node):
            # the split node gets a piece of its own; what follows starts the next one
            assignment[node] = piece + 1
            piece += 2
        else:
            assignment[node] = piece
    return split_module(gm, None, lambda node: assignment[node], keep_original_order=True)


class _PieceGraph:
    """One piece at one size replayed from a CUDA graph.

    A graph replays fixed addresses. The inputs of a piece are mostly the model's weights
    and the previous piece's graph outputs, which never move; an input that arrives at
    another address (attention's output, allocated eagerly) is copied into the captured
    one first, a copy of one activation per layer. Holding ``inputs`` keeps every captured
    address alive.
    """

    def __init__(self, fn: Callable, args: Sequence) -> None:
        self.inputs = list(args)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)
        self.graph.replay()  # capturing records the kernels; it runs none of them

    def __call__(self, *args):
        for captured, given in zip(self.inputs, args):
            if isinstance(given, torch.Tensor) and given.data_ptr() != captured.data_ptr():
                captured.copy_(given)
        self.graph.replay()
        return self.outputs


@dataclass
class Piece:
    """One piece of the split graph, compiled by Inductor per concrete size.

    ``size_arg`` is the position of the piece's argument that carries the dynamic token
    count (a SymInt when traced, an int when called; vLLM's ``sym_shape_indices``). A call
    at a size in ``sizes`` runs that size's compiled code (compiled at its first call, with
    its real inputs); with ``cuda_graphs``, from its second call on, a CUDA graph of it (the
    first call is the warm-up a capture needs: Triton compiles, cuBLAS picks algorithms).
    Any other size runs the piece's FX graph as traced, op by op.
    """

    name: str
    graph_module: torch.fx.GraphModule
    size_arg: int | None
    sizes: tuple[int, ...]
    cuda_graphs: bool
    compiled: dict[int, Callable] = field(default_factory=dict)
    graphs: dict[int, _PieceGraph] = field(default_factory=dict)
    compile_seconds: dict[int, float] = field(default_factory=dict)

    def __call__(self, *args):
        size = args[self.size_arg] if self.size_arg is not None else None
        if size not in self.sizes:
            return self.graph_module(*args)
        if size in self.graphs:
            return self.graphs[size](*args)
        if size not in self.compiled:
            from torch._inductor.compile_fx import compile_fx

            start = time.perf_counter()
            # a copy: compile_fx may rewrite the graph it is given (to return a tuple)
            self.compiled[size] = compile_fx(copy.deepcopy(self.graph_module), list(args))
            self.compile_seconds[size] = time.perf_counter() - start
            return self.compiled[size](*args)
        if self.cuda_graphs:
            self.graphs[size] = _PieceGraph(self.compiled[size], args)
            return self.graphs[size].outputs
        return self.compiled[size](*args)


class PiecewiseBackend:
    """A ``torch.compile`` backend: cut Dynamo's graph at attention and give every other
    piece a :class:`Piece` that compiles per size in ``sizes``.

    After the trace, ``graph`` is Dynamo's whole graph, ``split`` the cut one, ``pieces``
    the compiled pieces in order and ``num_attention`` the cuts.
    """

    def __init__(self, sizes: Sequence[int], *, cuda_graphs: bool = False) -> None:
        self.sizes = tuple(check_positive_int(s, "size") for s in sizes)
        self.cuda_graphs = cuda_graphs
        self.graph: torch.fx.GraphModule | None = None
        self.split: torch.fx.GraphModule | None = None
        self.pieces: list[Piece] = []
        self.num_attention = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
        self.graph = gm
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        symbolic = {p.name for p, example in zip(placeholders, example_inputs) if isinstance(example, torch.SymInt)}
        split = split_at(gm)
        for node in split.graph.find_nodes(op="call_module"):
            sub = getattr(split, node.target)
            if any(is_split_node(n) for n in sub.graph.nodes):
                self.num_attention += 1
                continue
            size_arg = next((i for i, a in enumerate(node.args)
                             if isinstance(a, torch.fx.Node) and a.name in symbolic), None)
            piece = Piece(node.target, sub, size_arg, self.sizes, self.cuda_graphs)
            # The split module calls self.<target>(...); an instance attribute shadows the
            # registered submodule (vLLM installs its piecewise backends the same way).
            split.__dict__[node.target] = piece
            self.pieces.append(piece)
        self.split = split
        return split


def drop_all_guards(guards: list) -> list[bool]:
    """``guard_filter_fn`` that keeps no guard: the one trace serves every later call.

    Safe here because the runner only ever calls the step with the same buffers, sliced
    to a capture size; an arbitrary caller would lose Dynamo's protection against a
    changed input (vLLM makes the same trade).
    """
    return [False for _ in guards]


class CompiledModelRunner(ModelRunner):
    """:class:`labkit.serve.ModelRunner` whose decode steps run piecewise-compiled.

    ``sizes`` are the batch sizes compiled (and, on a GPU, graphed): the engine's capture
    sizes for ``max_num_seqs`` by default. :meth:`compile` traces the step once at the
    largest; :meth:`execute` then pads each decode batch to a size and runs the pieces.
    ``forward`` (eager) and ``replay`` (one CUDA graph of the eager step) stay as inherited,
    so one runner measures all three over the same pool.
    """

    def __init__(self, model: Decoder, kv: PagedKVCache, *, pad_block: int, max_num_seqs: int,
                 max_model_len: int | None = None, cuda_graphs: bool | None = None,
                 sizes: Sequence[int] | None = None) -> None:
        super().__init__(model, kv, pad_block=pad_block, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         cuda_graphs=cuda_graphs)
        if sizes is None:
            sizes = self.graph_sizes
        sizes = sorted({check_positive_int(s, "size") for s in sizes})
        if sizes[-1] > max_num_seqs:
            raise ValueError(f"sizes must not exceed max_num_seqs={max_num_seqs}, got {sizes}")
        if sizes[-1] < 2:
            raise ValueError(f"the largest size must be at least 2 (the trace marks the batch dynamic, and "
                             f"Dynamo specialises sizes 0 and 1), got {sizes}")
        self.sizes = tuple(sizes)
        self.backend = PiecewiseBackend(self.sizes, cuda_graphs=self.cuda_graphs)
        self._compiled_step: Callable | None = None

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The function Dynamo traces: the model over ``N`` packed decode tokens, logits ``[N, vocab]``."""
        kv = SplitAttentionKV(self.kv, slot_mapping, block_tables, lengths)
        return self.model(input_ids, kv, positions=positions)[0]

    def compile(self) -> None:
        """Trace the decode step once at the largest size, its token dimension dynamic."""
        if self._static is None:
            self._padding_batch(self.graph_sizes[-1])
        args = self._step_args(self.static_batch(self.sizes[-1]))
        for tensor, dim in zip(args, (1, 0, 0, 0, 0)):
            torch._dynamo.mark_dynamic(tensor, dim)
        step = torch.compile(self.decode_step, backend=self.backend, fullgraph=True,
                             options={"guard_filter_fn": drop_all_guards})
        with torch.no_grad():
            step(*args)
        self._compiled_step = step

    @staticmethod
    def _step_args(batch) -> tuple[torch.Tensor, ...]:
        return batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.lengths

    @torch.no_grad()
    def run_size(self, size: int) -> torch.Tensor:
        """The compiled step over the first ``size`` rows of the static inputs (staged by
        :meth:`stage`): logits ``[size, vocab]``, a graph's output buffer on a GPU (the next
        call at this size overwrites it)."""
        if size not in self.sizes:
            raise ValueError(f"size must be one of the compiled sizes {self.sizes}, got {size!r}")
        if self._compiled_step is None:
            self.compile()
        return self._compiled_step(*self._step_args(self.static_batch(size)))

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest compiled size that holds ``num_seqs`` sequences (None: above them all)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    @torch.no_grad()
    def execute(self, seqs) -> torch.Tensor:
        """One step: decode batches up to the largest size piecewise-compiled (padded), the rest eagerly."""
        batch = self.prepare(seqs)
        size = self.padded_size(batch.num_seqs) if batch.decode_only else None
        if size is None:
            return self.forward(batch)
        self.stage(batch)
        self._pad_rows(batch.num_seqs, size)  # stage pads to the engine's sizes; ours may be coarser
        return self.run_size(size)[:batch.num_seqs]
