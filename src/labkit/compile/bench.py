"""Benchmarks of chapter ``torch-compile``.

- ``compile.piecewise_decode``: decode steps of the book's model (Qwen3-4B layer shapes,
  8 layers, bf16; the tiny model under the interpreter) over the serving engine's paged
  pool, every sequence at a context near ``CONTEXT``, for batches 1 to 8. Four ways over
  the same pool and weights: eager (the model's plain torch ops, the engine's decode
  kernel), one CUDA graph of that eager step per capture size (the engine's runner),
  piecewise-compiled without graphs (Inductor's code per size, launched from Python), and
  piecewise-compiled with piecewise CUDA graphs (vLLM's default shape of it). Each step
  includes packing the inputs (the same host work for all four). Every way's logits are
  checked before and after timing against an fp32 copy of the model: no further from it than
  eager bf16 is (twice eager's error, or the bf16 tolerance). The compile time of each piece at each size is
  kept in the record's config, with the wrapper code Inductor generated for each distinct
  piece at the smallest size (the pieces of the middle layers are one graph, compiled once).
- ``compile.reduce_overhead``: one of the model's blocks at batch 1 (an MLP with its norm
  and residual, small enough that launches dominate): eager, ``torch.compile`` and
  ``torch.compile(mode="reduce-overhead")`` (Inductor's code replayed from CUDA graphs).
- ``compile.inductor_code``: not a timing: the Triton kernels Inductor generates for that
  block, recorded so that the chapter can show GPU code on a machine without one.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time

import torch

from .. import backend, check, models, timing
from ..benchmarks import Measurement, benchmark
from ..models.config import DecoderConfig
from ..results import Goal
from ..serve.model_runner import ModelRunner
from ..serve.paged_cache import PagedKVCache
from ..serve.sampler import SamplingParams
from ..serve.scheduler import Sequence
from .inductor import captured_code, fresh_function, generated_code
from .piecewise import CompiledModelRunner

CHAPTER = "torch-compile"
CONFIG = models.book_config()
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
BLOCK_SIZE = 16
CONTEXT = backend.pick(cpu=40, gpu=1024)
MAX_BATCH = backend.pick(cpu=4, gpu=8)
BATCHES = backend.pick(cpu=[1, 3, 4], gpu=[1, 2, 3, 4, 5, 6, 7, 8])
REPS = backend.pick(cpu=1, gpu=None)
SPEEDUP_GOAL = 1.3


def decode_setup(config: DecoderConfig, *, max_batch: int, context: int, dtype: torch.dtype,
                 device: torch.device | str, cuda_graphs: bool, sizes=None, seed: int = 0):
    """A model, a paged pool holding ``max_batch`` sequences' worth of random K/V, the
    sequences (contexts from ``context`` down, each about to decode one token), and a
    :class:`CompiledModelRunner` over them."""
    model = models.Decoder(config, dtype=dtype, device=device, seed=seed)
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    pad_block = max_batch * blocks_per_seq
    kv = PagedKVCache(config, pad_block + 1, BLOCK_SIZE, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    rng = random.Random(seed)
    seqs = []
    for i in range(max_batch):
        length = context - 3 * i  # unequal contexts: each row reads its own number of blocks
        prompt = [rng.randrange(config.vocab_size) for _ in range(length)]
        seqs.append(Sequence(i, prompt, SamplingParams(max_tokens=1),
                             block_table=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                             num_cached=length - 1, num_new=1))
    runner = CompiledModelRunner(model, kv, pad_block=pad_block, max_num_seqs=max_batch,
                                 max_model_len=blocks_per_seq * BLOCK_SIZE, cuda_graphs=cuda_graphs, sizes=sizes)
    return model, kv, seqs, runner


def _fp32_reference(runner: ModelRunner) -> ModelRunner:
    """An eager runner over fp32 copies of ``runner``'s model and pool (itself if they are fp32)."""
    if runner.model.embed.weight.dtype == torch.float32:
        return runner
    kv = copy.copy(runner.kv)
    kv.k, kv.v = runner.kv.k.float(), runner.kv.v.float()
    return ModelRunner(copy.deepcopy(runner.model).float(), kv, pad_block=runner.pad_block,
                       max_num_seqs=runner.graph_sizes[-1], max_model_len=runner.max_blocks_per_seq * BLOCK_SIZE,
                       cuda_graphs=False)


def _eager_step(runner: ModelRunner, seqs) -> torch.Tensor:
    # The unchecked, graph-safe kernel path: the very kernel the compiled step's op calls.
    return runner.forward(runner.prepare(seqs))


@benchmark("compile.piecewise_decode", chapter=CHAPTER,
           title="Decode steps of the book's model (bf16, context ~1024) by batch: eager, one CUDA graph, "
                 "piecewise-compiled, piecewise-compiled with piecewise CUDA graphs")
@torch.no_grad()
def bench_piecewise_decode() -> Measurement:
    on_gpu = backend.on_gpu()
    device = backend.device()
    model, kv, seqs, graphed = decode_setup(CONFIG, max_batch=MAX_BATCH, context=CONTEXT, dtype=DTYPE,
                                            device=device, cuda_graphs=on_gpu)
    # The same weights and pool; pieces compiled per size but launched from Python.
    plain = CompiledModelRunner(model, kv, pad_block=graphed.pad_block, max_num_seqs=MAX_BATCH,
                                max_model_len=graphed.max_blocks_per_seq * BLOCK_SIZE, cuda_graphs=False)
    if on_gpu:
        # The engine's whole-step graphs first: capturing them re-allocates the runner's
        # static inputs, which the piecewise graphs would otherwise have to copy from.
        ModelRunner.capture(graphed)
    start = time.perf_counter()
    graphed.compile()
    trace_s = time.perf_counter() - start
    plain.compile()
    ways = {
        "eager": lambda s: _eager_step(graphed, s),
        "piecewise": plain.execute,
        "piecewise_graphs": graphed.execute,
    }
    if on_gpu:
        ways["cuda_graph"] = lambda s: ModelRunner.execute(graphed, s)
    reference = _fp32_reference(graphed)
    # The code of each distinct piece at the smallest size, kept for the chapter to read.
    with captured_code(fresh=False) as piece_wrappers:
        plain.execute(seqs[:BATCHES[0]])
    rows = []
    for b in BATCHES:
        batch = seqs[:b]
        ref = _eager_step(reference, batch).float()
        row = {"batch": b, "padded_to": graphed.padded_size(b)}
        # Rounding differs between ways in bf16 (Inductor keeps a fused kernel's
        # intermediates in fp32; eager rounds after every op), so each way is held to the
        # fp32 model: at least as close to it as eager is (or within the bf16 tolerance).
        row["eager_rel_err"] = check.rel_error(_eager_step(graphed, batch).float(), ref)
        limit = max(check.tolerance(DTYPE), 2 * row["eager_rel_err"])
        for name, step in ways.items():
            for _ in range(2):  # first call compiles the size, second captures its graphs
                out = step(batch)
            check.assert_close(out.float(), ref, tol=limit, name=f"{name} logits at batch {b}")
            row[f"{name}_rel_err"] = check.rel_error(out.float(), ref)
            row[f"{name}_ms"] = timing.measure(lambda: step(batch), reps=REPS).median_ms
            # and after many replays (stale static inputs would show here)
            check.assert_close(step(batch).float(), ref, tol=limit, name=f"{name} logits at batch {b}, after timing")
        for name in ways:
            if name != "eager":
                row[f"{name}/eager"] = row["eager_ms"] / row[f"{name}_ms"]
        rows.append(row)
    goals = [Goal(f"piecewise_graphs/eager speedup at batch {r['batch']}", r["piecewise_graphs/eager"], ">=",
                  SPEEDUP_GOAL) for r in rows]
    compile_seconds = {f"{p.name}@{size}": round(seconds, 3) for p in graphed.backend.pieces
                       for size, seconds in sorted(p.compile_seconds.items())}
    return Measurement(
        rows=rows, metric="ms per decode step (ratios: eager time / this way's time, higher is faster)",
        goals=goals,
        config={"model": "BOOK_GPU" if on_gpu else "TINY", "dtype": str(DTYPE), "context": CONTEXT,
                "block_size": BLOCK_SIZE, "sizes": list(graphed.sizes), "num_layers": CONFIG.num_layers,
                "num_pieces": len(graphed.backend.pieces), "num_attention_ops": graphed.backend.num_attention,
                "trace_and_first_compile_s": round(trace_s, 3), "compile_seconds": compile_seconds,
                "graph_nodes": len(graphed.backend.graph.graph.nodes),
                "piece_wrappers": {"size": graphed.padded_size(BATCHES[0]), "code": piece_wrappers}},
    )


def block_example(config: DecoderConfig, dtype: torch.dtype, device, tokens: int = 1):
    """One transformer block's MLP half as a function, and inputs for it: ``x + mlp(norm(x))``
    with the model's own modules, at ``tokens`` tokens (a decode step's shape)."""
    one_layer = dataclasses.replace(config, num_layers=1)  # the block's weights, not the whole model's
    block = models.Decoder(one_layer, dtype=dtype, device=device, seed=0).blocks[0]
    x = check.randn(1, tokens, config.hidden_size, dtype=dtype, device=device, seed=1)

    def mlp_half(x):
        return x + block.mlp(block.mlp_norm(x))

    return mlp_half, x


@benchmark("compile.reduce_overhead", chapter=CHAPTER,
           title="One block's MLP half at batch 1 (bf16): eager, torch.compile, torch.compile reduce-overhead")
@torch.no_grad()
def bench_reduce_overhead() -> Measurement:
    fn, x = block_example(CONFIG, DTYPE, backend.device())
    ref = fn(x)
    rows = []
    # each compiled way of its own function: Dynamo's cache would hand the second the first's graph
    ways = {"eager": fn, "compile": torch.compile(fresh_function(fn))}
    if backend.on_gpu():  # CUDA graphs need a GPU; on a CPU the mode only compiles
        ways["reduce_overhead"] = torch.compile(fresh_function(fn), mode="reduce-overhead")
    for name, way in ways.items():
        for _ in range(3):  # compile, then (reduce-overhead) record and capture the graph
            out = way(x)
        check.assert_close(out, ref, dtype=DTYPE, name=name)
        rows.append({"way": name, "ms": timing.measure(lambda: way(x), reps=REPS).median_ms})
    eager_ms = rows[0]["ms"]
    for row in rows:
        row["speedup_vs_eager"] = eager_ms / row["ms"]
    return Measurement(rows=rows, metric="ms per call", config={"hidden": CONFIG.hidden_size,
                                                               "intermediate": CONFIG.intermediate_size,
                                                               "dtype": str(DTYPE), "tokens": 1})


@benchmark("compile.inductor_code", chapter=CHAPTER,
           title="The code Inductor generates for one block's MLP half at batch 1 (kernels and wrapper)")
@torch.no_grad()
def bench_inductor_code() -> Measurement:
    fn, x = block_example(CONFIG, DTYPE, backend.device())
    out, code = generated_code(fn, x)
    check.assert_close(out, fn(x), dtype=DTYPE, name="compiled block")
    rows = [{"kernel": name, "lines": source.count("\n") + 1, "source": source}
            for name, source in code.kernels.items()]
    return Measurement(rows=rows, metric="generated source",
                       config={"language": code.language, "call": code.call_code, "dtype": str(DTYPE),
                               "hidden": CONFIG.hidden_size, "intermediate": CONFIG.intermediate_size})
