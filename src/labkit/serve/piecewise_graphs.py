"""Piecewise CUDA graphs for the steps a whole-step graph cannot hold: prefills and mixed steps.

A decode step's attention launch depends on shapes alone, so the whole step fits in one
CUDA graph per batch size (:meth:`ModelRunner.capture <labkit.serve.ModelRunner.capture>`).
A step with a prefill does not: its attention kernel's grid follows the longest query run
(``max_queries``) and its sequences' boundaries change every step. Run eagerly, though, such
a step pays for every launch from Python, about 500 of them for a 28-layer model: tens of
milliseconds of host time, whatever the step computes (``serve.engine_decode`` records the
eager step against the graphed one).

vLLM's answer is *piecewise* graphs (``cudagraph_mode`` ``PIECEWISE``): capture everything
except attention, once per padded token count. Its default mode, ``FULL_AND_PIECEWISE``,
pairs them with whole-step graphs for decode batches, which is what this engine does.
Each layer's attention is a boundary. With ``L`` layers a step is ``L + 1`` graphs with ``L`` eager attention calls
between them:

- graph 0: embed, rotary angles, layer 0's norm, projections, q/k norms, RoPE, the store of
  K and V into the pool, and a copy of the queries to a static buffer;
- eager: the paged prefill kernel over the queries of the real tokens, into a static output
  buffer;
- graph ``i``: layer ``i - 1``'s output projection, residual, norm and MLP, then layer ``i``'s
  attention inputs, as graph 0;
- graph ``L``: the last MLP, the final norm over each sequence's last token, to a static
  buffer; the LM head then runs eagerly on exactly the sequences' rows.

The token count is padded to the smallest *token size* that holds it (16, 32, 64, ... up to
the step's token budget): the padding tokens store their K and V in the pad block, as a
padded decode row does, and attention never reads them. Every per-token op is row by row,
so a padding row changes no real row. :mod:`labkit.compile.piecewise` builds the same cut
with ``torch.compile``; here the model's own ``attend`` hook is the cut, and nothing is
compiled: the graphs replay the eager kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..validate import check_positive_int
from . import attention
from .paged_cache import KVStore

MIN_TOKEN_SIZE = 16


def token_sizes(max_tokens: int) -> list[int]:
    """The token counts that get piecewise graphs: powers of two from 16 below ``max_tokens``, and ``max_tokens``."""
    check_positive_int(max_tokens, "max_tokens")
    sizes, size = [], MIN_TOKEN_SIZE
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


class _Pieces:
    """The cache a pass over the static inputs hands the model: at each layer's attention it
    stores K and V (padding tokens to the pad block), copies the queries to the static query
    buffer, calls ``at_attention(layer)`` (run attention now, or end one graph and begin the
    next) and returns the static output buffer, which the next piece reads."""

    def __init__(self, graphs: PiecewiseGraphs, size: int, at_attention: Callable[[int], None]) -> None:
        self.graphs, self.size, self.at_attention = graphs, size, at_attention

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g, n = self.graphs, self.size
        attention.write_kv(g.kv.k[layer], g.kv.v[layer], k[0].transpose(0, 1), v[0].transpose(0, 1),
                           g.slot_mapping[:n])
        g.queries[:n].copy_(q[0].transpose(0, 1))
        return self.attend_stored(layer, g.queries[:n]).transpose(0, 1).unsqueeze(0)

    def kv_store(self, layer: int) -> KVStore:
        """The pool's slot rows for this layer, and the static query buffer as the queries' place."""
        g, n = self.graphs, self.size
        return g.kv.store(layer, g.slot_mapping[:n], queries=g.queries[:n])

    def attend_stored(self, layer: int, q_tokens: torch.Tensor) -> torch.Tensor:
        """Attention between the pieces: the queries must be in the static query buffer (where
        :meth:`kv_store` put them, or :meth:`attend` copied them); the static output buffer."""
        g, n = self.graphs, self.size
        if q_tokens.data_ptr() != g.queries.data_ptr():
            raise ValueError("the queries must be in the static query buffer (kv_store's queries)")
        self.at_attention(layer)
        return g.attn_out[:n]


class PiecewiseGraphs:
    """Static inputs and the piecewise graphs of every token size for one model and pool.

    The eager attention between pieces is the caller's, given to :meth:`run` as
    ``attend(layer, n)``: it reads the first ``n`` rows of :attr:`queries` and writes the
    first ``n`` of :attr:`attn_out` (the runner binds it to the step's block tables and
    sequence boundaries). ``max_seqs`` bounds the sequences of a step, so the rows of
    :attr:`hidden` (and of logits) a step produces.
    """

    def __init__(self, model, kv, *, pad_slot: int, max_tokens: int, max_seqs: int) -> None:
        self.model, self.kv, self.pad_slot = model, kv, pad_slot
        self.sizes = token_sizes(max_tokens)
        self.max_seqs = check_positive_int(max_seqs, "max_seqs")
        cfg, w = model.config, model.embed.weight
        n, s = self.sizes[-1], self.rows(self.sizes[-1])

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=w.device)

        # Rows: input ids, positions, slot mapping (a packed batch's token_inputs, one copy in).
        self.token_inputs = zeros(3, n)
        self.input_ids, self.positions, self.slot_mapping = (self.token_inputs[0:1], self.token_inputs[1],
                                                             self.token_inputs[2])
        # Padding tokens: token 0 at position 0, stored in the pad slot.
        self._padding = torch.tensor([[0], [0], [pad_slot]], device=w.device).expand(3, n)
        self.logits_indices = zeros(s)
        self.queries = zeros(n, cfg.num_heads, cfg.head_dim, dtype=w.dtype)
        self.attn_out = torch.zeros_like(self.queries)
        self.hidden = zeros(s, cfg.hidden_size, dtype=w.dtype)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def rows(self, size: int) -> int:
        """Logits rows a step of ``size`` tokens needs at most: one per sequence."""
        return min(size, self.max_seqs)

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest token size that holds ``num_tokens`` (None: more than the largest)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def stage(self, batch) -> int:
        """Copy a packed batch's tokens and last-token indices into the static inputs, padded
        to its token size (padding: token 0 at position 0, stored in the pad block); that size."""
        n, b = batch.input_ids.shape[1], batch.num_seqs
        size = self.size_for(n)
        if size is None:
            raise ValueError(f"a step of {n} tokens is above the largest token size {self.sizes[-1]}")
        if b > self.rows(size):
            raise ValueError(f"a step of {b} sequences is above the {self.max_seqs} the graphs were sized for "
                             f"(max_seqs)")
        self.token_inputs[:, :n].copy_(batch.token_inputs)
        self.token_inputs[:, n:size].copy_(self._padding[:, n:size])
        self.logits_indices[:b] = batch.logits_indices
        self.logits_indices[b:self.rows(size)] = 0
        return size

    def _pass(self, size: int, at_attention: Callable[[int], None]) -> None:
        """The model over the first ``size`` static tokens, each layer's attention left to
        ``at_attention``; each sequence's last hidden state (normed) into :attr:`hidden`."""
        rows = self.rows(size)
        normed = self.model(self.input_ids[:, :size], _Pieces(self, size, at_attention),
                            positions=self.positions[:size], logits_indices=self.logits_indices[:rows],
                            hidden_only=True)
        self.hidden[:rows].copy_(normed[0])

    def run(self, batch, attend: Callable[[int, int], None]) -> torch.Tensor:
        """One step through the pieces: replayed from graphs where captured, else run inline
        (the same ops in the same order: on a CPU, what a replay computes). Logits
        ``[num_seqs, vocab]``."""
        n = batch.input_ids.shape[1]
        size = self.stage(batch)
        graphs = self._graphs.get(size)
        if graphs is None:
            self._pass(size, lambda layer: attend(layer, n))
        else:
            for layer, graph in enumerate(graphs[:-1]):
                graph.replay()
                attend(layer, n)
            graphs[-1].replay()
        return self.model.lm_head(self.hidden[:batch.num_seqs])

    def capture(self, pool) -> None:
        """Capture the pieces of every token size, largest first, into the memory pool ``pool``.

        Before each capture one inline pass of the same size (attention skipped: the static
        inputs are padding) compiles the Triton kernels and lets cuBLAS choose algorithms,
        which a capture may not do. Captures run on a side stream, as CUDA requires.
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self.token_inputs[:, :size].copy_(self._padding[:, :size])
                self.logits_indices.zero_()
                self._pass(size, lambda layer: None)  # warm-up
                stream.synchronize()
                graphs = [torch.cuda.CUDAGraph()]

                def cut(layer: int) -> None:  # end this piece's graph, begin the next one's
                    graphs[-1].capture_end()
                    graphs.append(torch.cuda.CUDAGraph())
                    graphs[-1].capture_begin(pool=pool)

                graphs[0].capture_begin(pool=pool)
                self._pass(size, cut)
                graphs[-1].capture_end()
                self._graphs[size] = graphs
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)
