"""Benchmarks of chapter ``serving-engine``: the engine's decode step against the memory
floor (CUDA graphs against eager), its throughput against Hugging Face ``generate`` on the
same weights and requests, and the memory budget a profiling run computes.

The model is the book's decoder at the Qwen3-0.6B shape with random weights in bf16 (speed
does not depend on the weights' values); the tiny model under the interpreter.

- ``serve.engine_decode``: 64 sequences prefilled to a context of 1024, then (a) the model
  runner's step (pack the inputs, one forward, the logits) for decode batches of 1 to 64,
  replayed from CUDA graphs and run eagerly, timed with :func:`labkit.timing.measure` (the
  step is idempotent: it rewrites the same slots), and (b) whole engine steps at batch 64
  (schedule, pack, forward, sample, update), timed back to back in steady state: replayed
  from graphs with the update after each step and with asynchronous scheduling (each step
  queued before the previous one's tokens are applied), and eagerly, with the host's phases
  of those steps (``LLM.last_step_timing``: schedule, launch, wait, apply, and the launch's
  inputs, placeholders, forward and sampling); then a few graphed
  engine steps each way under the profiler (the host's CUDA calls and its time in each, the
  steps' wall time, the GPU's busy time) and as many under cProfile (the host's Python
  functions with the most time of their own), and the host's time in one launch of the
  largest batch's graph, with the GPU idle and right behind the graph's previous launch.
  The floor is what a decode step must read, the weights once and every sequence's K and V,
  at the read bandwidth measured in the same run. The runner's graphed steps are timed twice, with the
  stacked projections' matmuls through ``F.linear`` (cuBLAS) and through the split-K kernel
  (``Decoder.decode_matmul``); the faster at the largest batch runs the kernel profile and
  the engine steps. Last, (c) the graphed runner step at the smallest and largest batch
  with the projections unstacked (``Decoder.unfuse_projections``), against the stacked
  ones the engine runs.
- ``serve.engine_vs_hf``: one trace of requests with long-tailed prompt and output lengths,
  served by ``LLM.generate`` and by ``transformers``' batched ``generate`` in static batches
  of the engine's ``max_num_seqs`` (left-padded, greedy, each batch run to its longest
  output, as static batching must); output tokens per second.
- ``serve.memory_budget``: ``LLM(model)`` with ``num_blocks`` left out on the GPU: the
  profiling run's terms, the blocks they leave at ``gpu_memory_utilization`` 0.9, and the
  memory the process then holds.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time

import torch

from .. import backend, ceilings, check, models, profiling, timing
from ..benchmarks import Measurement, benchmark
from ..kvcache.bench import kernel_kind
from ..matmul import kernels as matmul_kernels
from ..results import Goal
from .engine import LLM
from .memory_budget import weight_bytes
from .model_runner import ModelRunner
from .sampler import SamplingParams
from .scheduler import Sequence

CHAPTER = "serving-engine"
MODEL_NAME = backend.pick(cpu="TINY", gpu="Qwen3-0.6B")
MODEL_CONFIG = backend.pick(cpu=models.TINY, gpu=models.QWEN3_SIZES["Qwen3-0.6B"])
DTYPE = backend.pick(cpu=torch.float32, gpu=torch.bfloat16)
BLOCK_SIZE = 16
REPS = backend.pick(cpu=1, gpu=None)
HOTSPOTS = 15  # Python functions recorded per profiled engine mode
GRAPH_LAUNCHES = 20  # launches timed each way for graph_launch_host_us
STEP_PHASES = ("schedule", "launch", "wait", "apply")  # a step's host time (StepTiming), in order
LAUNCH_PARTS = ("inputs", "placeholders", "forward", "sample")  # the launch phase's parts
# The split-K forward against the F.linear one: two roundings of the same sums, compounded over the
# layers; in float32 the book's tolerance, in bf16 five times it (see bench_engine_decode).
SPLIT_K_LOGITS_TOL = {torch.bfloat16: 5 * check.tolerance(torch.bfloat16)}


def engine_model() -> models.Decoder:
    """The benchmarks' model: random weights, this machine's shape and dtype; on a GPU with the
    norms, rotary embedding, SwiGLU and residual adds as :mod:`labkit.fused`'s kernels (fewer
    launches per step: the interpreter would only be slower)."""
    return models.Decoder(MODEL_CONFIG, dtype=DTYPE, device=backend.device(), seed=0, fused=backend.on_gpu())


def decode_floor_ms(model: models.Decoder, batch: int, context: int, read_tbps: float) -> float:
    """A decode step's bytes over the read bandwidth: every weight once (the tied embedding is
    the LM head's matrix) and ``batch`` sequences' K and V of ``context`` positions."""
    kv = model.config.kv_bytes_per_token(model.embed.weight.element_size()) * batch * context
    return (weight_bytes(model) + kv) / (read_tbps * 1e9)


@benchmark("serve.engine_decode", chapter=CHAPTER,
           title="Engine decode steps at the Qwen3-0.6B shape (bf16), context 1024: CUDA graphs and eager "
                 "against the memory floor, by batch; whole engine steps at batch 64")
@torch.no_grad()
def bench_engine_decode() -> Measurement:
    batch, context = backend.pick(cpu=(4, 24), gpu=(64, 1024))
    engine_steps = backend.pick(cpu=3, gpu=30)
    profiled_steps = backend.pick(cpu=2, gpu=10)
    batches = [b for b in backend.pick(cpu=[1, 2, 4], gpu=[1, 2, 4, 8, 16, 32, 64]) if b <= batch]
    model = engine_model()
    on_gpu = backend.on_gpu()
    # Prompts one short of the context: the first decode step stores position context - 1.
    # Enough output tokens for the timed engine steps of all three modes and the two profiles
    # of the two graphed ones (each run with a warm-up step and one in flight at the end),
    # and a few spare.
    engine_modes = {"graphed": (True, False), "graphed_async": (True, True), "eager": (False, False)}
    params = SamplingParams(max_tokens=len(engine_modes) * (engine_steps + 2) + 2 * (2 * profiled_steps + 2) + 4)
    max_model_len = context - 1 + params.max_tokens
    # Every prompt prefills in one step: with a smaller token budget the first sequences would
    # already be decoding (and growing past their blocks) while the last ones still prefill.
    llm = LLM(model, num_blocks=batch * -(-max_model_len // BLOCK_SIZE), block_size=BLOCK_SIZE, max_num_seqs=batch,
              max_num_batched_tokens=batch * context, max_model_len=max_model_len)
    rng = random.Random(0)
    prompts = [[rng.randrange(MODEL_CONFIG.vocab_size) for _ in range(context - 1)] for _ in range(batch)]
    for prompt in prompts:
        request = llm.add_request(prompt, params)
        if llm.progress(request)[1] is not None:
            raise RuntimeError(f"the engine refused a benchmark request: {llm.output(request).error}")
    while llm.scheduler.waiting or any(s.num_cached < s.num_tokens - 1 for s in llm.scheduler.running):
        llm.step()  # prefill every sequence; each ends with its first token sampled
    running: list[Sequence] = list(llm.scheduler.running)
    for seq in running:
        seq.num_new = 1
    runner = llm.runner
    limits = ceilings.limits()

    def forward(seqs, graphed):
        runner.cuda_graphs = graphed and on_gpu
        return runner.execute(seqs)

    def use_decode_matmul(how: str) -> None:
        """Run the stacked projections' matmuls through ``how``, capturing the graphs anew: a
        replay runs the kernels its capture saw (the autotuner tunes each shape in the eager
        warm-up before each capture)."""
        model.decode_matmul = how
        if on_gpu:
            runner.cuda_graphs = True
            runner.capture()

    # The graphs replay what the eager forward computes, with either matmul.
    eager_logits = forward(running, False).float()
    check.assert_close(forward(running, True), eager_logits, dtype=DTYPE, name="graphed vs eager logits")
    rows = []
    for b in batches:
        seqs = running[:b]
        t_graph = timing.measure(lambda: forward(seqs, True), reps=REPS)
        t_eager = timing.measure(lambda: forward(seqs, False), reps=REPS)
        floor = decode_floor_ms(model, b, context, limits["read_tbps"])
        rows.append({"batch": b, "context": context, "graphed_ms": t_graph.median_ms, "eager_ms": t_eager.median_ms,
                     "floor_ms": floor, "graphed/floor": t_graph.median_ms / floor,
                     "eager/floor": t_eager.median_ms / floor, "eager/graphed": t_eager.median_ms / t_graph.median_ms})
    use_decode_matmul("split_k")
    split_k_logits = forward(running, False).float()
    check.assert_close(forward(running, True), split_k_logits, dtype=DTYPE, name="graphed vs eager split-K logits")
    # Split-K sums each output in another order than cuBLAS, and in bf16 the two forwards' roundings
    # compound over the layers: at the Qwen3-0.6B shape the logits differ by about the book's bf16
    # tolerance in norm (the record keeps the figure: split_k_vs_torch_logits_rel_error), while a wrong
    # tile or a stale graph buffer shows as an error of order one. The kernel itself is checked
    # against float64 at these shapes (tests/test_matmul.py).
    split_k_vs_torch = check.rel_error(split_k_logits, eager_logits)
    check.assert_close(split_k_logits, eager_logits, tol=SPLIT_K_LOGITS_TOL.get(DTYPE), dtype=DTYPE,
                       name="eager split-K vs eager F.linear logits")
    for row in rows:
        seqs = running[:row["batch"]]
        split_ms = timing.measure(lambda: forward(seqs, True), reps=REPS).median_ms
        row.update({"graphed_split_k_ms": split_ms, "graphed_split_k/floor": split_ms / row["floor_ms"],
                    "split_k/torch": split_ms / row["graphed_ms"]})
    split_k_choices = {str(key): cfg for key, cfg in matmul_kernels.best_config("split_k").items()
                       if key[0] <= models.decoder.SPLIT_K_MAX_ROWS}  # (key: M, N, K, ...)
    # The rest of the benchmark runs the faster matmul at the largest batch.
    decode_matmul = "split_k" if rows[-1]["graphed_split_k_ms"] < rows[-1]["graphed_ms"] else "torch"
    use_decode_matmul(decode_matmul)
    step_key = "graphed_split_k" if decode_matmul == "split_k" else "graphed"

    def engine_step_ms(graphed: bool, async_scheduling: bool) -> tuple[float, float, dict]:
        """Steady state: ``engine_steps`` steps back to back, wall clock over their count (a
        step's own wall clock would wait for the device at its end and hide any overlap), the
        floor at their mean context, and the host's phases per step (``LLM.last_step_timing``,
        in ms, averaged over the same steps)."""
        runner.cuda_graphs = graphed and on_gpu
        llm.async_scheduling = async_scheduling
        llm.step()  # warm-up; with async scheduling it also puts a step in flight
        start_context = running[0].num_cached + 1
        phases = dict.fromkeys(STEP_PHASES + LAUNCH_PARTS, 0.0)

        def steps():
            for _ in range(engine_steps):
                llm.step()
                for phase in phases:
                    phases[phase] += getattr(llm.last_step_timing, phase)

        _, total_ms = timing.timed_call(steps)
        llm.async_scheduling = False  # applies the step in flight
        mean_context = start_context + (engine_steps - 1) / 2
        return (total_ms / engine_steps, decode_floor_ms(model, batch, mean_context, limits["read_tbps"]),
                {phase: seconds * 1e3 / engine_steps for phase, seconds in phases.items()})

    # The host's time in one launch of the largest batch's graph (cudaGraphLaunch), without a
    # profiler: with the GPU idle, and issued right behind the same graph's previous launch (as
    # an asynchronous engine issues step k while step k - 1 runs), median over the launches.
    graph_launch_us = {}
    if on_gpu:
        forward(running, True)  # stages the largest batch: each replay reruns that step
        graph = runner.graph(runner.capture_size(batch))
        idle, behind = [], []
        for _ in range(GRAPH_LAUNCHES):
            torch.cuda.synchronize()
            started = time.perf_counter()
            graph.replay()
            idle.append(time.perf_counter() - started)
            started = time.perf_counter()
            graph.replay()
            behind.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        graph_launch_us = {"gpu_idle": statistics.median(idle) * 1e6, "behind_itself": statistics.median(behind) * 1e6}

    # Where the graphed step at the largest batch spends its GPU time, by kind of kernel.
    profile_calls = backend.pick(cpu=1, gpu=20)
    forward(running, True)
    kernels = profiling.kernels_run(lambda: forward(running, True), profile_calls)
    by_kind: dict[str, float] = {}
    for k in kernels:
        by_kind[kernel_kind(k.name)] = by_kind.get(kernel_kind(k.name), 0.0) + k.us / profile_calls
    launches = sum(k.launches for k in kernels) / profile_calls

    def host_profile(async_scheduling: bool) -> dict:
        """``profiled_steps`` graphed engine steps, per step: the host's CUDA runtime and driver
        calls, with the steps' wall time and the GPU's busy time in the same run (which calls wait
        for the GPU; whether the GPU or the host bounds the step; how much of it is outside any
        CUDA call); then, over as many steps under cProfile, the Python functions that take the
        host's time."""
        runner.cuda_graphs = on_gpu
        llm.async_scheduling = async_scheduling
        llm.step()
        profile = profiling.runtime_calls(llm.step, calls=profiled_steps)
        hotspots = profiling.python_hotspots(llm.step, calls=profiled_steps, top=HOTSPOTS)
        llm.async_scheduling = False
        return {"calls": [{"call": c.name, "per_step": c.count / profiled_steps, "us_per_step": c.us / profiled_steps}
                          for c in profile.calls],
                "wall_us_per_step": profile.wall_us / profiled_steps,
                "outside_us_per_step": profile.outside_us / profiled_steps,
                "device_busy_us_per_step": profile.device_busy_us / profiled_steps,
                "python_hotspots": [{"function": h.function, "calls_per_step": h.calls / profiled_steps,
                                     "own_us_per_step": h.own_us / profiled_steps,
                                     "cumulative_us_per_step": h.cumulative_us / profiled_steps} for h in hotspots]}

    engine = {mode: engine_step_ms(*flags) for mode, flags in engine_modes.items()}
    (step_graphed, floor_graphed, _), (step_async, floor_async, _) = engine["graphed"], engine["graphed_async"]
    step_eager, floor_eager, _ = engine["eager"]
    step_phases = {mode: {p: phases[p] for p in STEP_PHASES} for mode, (_, _, phases) in engine.items()}
    launch_parts = {mode: {p: phases[p] for p in LAUNCH_PARTS} for mode, (_, _, phases) in engine.items()}
    host_calls = {"graphed": host_profile(False), "graphed_async": host_profile(True)}
    runner.cuda_graphs = on_gpu
    model.decode_matmul = "torch"  # (the unstacked projections below run F.linear either way)

    # The same runner step with the projections unstacked (three matmuls for q, k, v, two for
    # gate and up, the norms, rotation and stores separate): a runner of its own, decode graphs
    # only, over the same pool. Last: the engine's graphs read the stacked weights freed here.
    stacked = model.projections_fused
    separate_rows = []
    if stacked:
        model.unfuse_projections()
        separate = ModelRunner(model, llm.kv, pad_block=runner.pad_block, max_num_seqs=batch,
                               max_model_len=max_model_len, cuda_graphs=on_gpu)
        if on_gpu:
            separate.capture()
        for b in (batches[0], batches[-1]):
            stacked_ms = next(r["graphed_ms"] for r in rows if r["batch"] == b)
            separate_ms = timing.measure(lambda: separate.execute(running[:b]), reps=REPS).median_ms
            separate_rows.append({"batch": b, "graphed_ms_separate": separate_ms, "graphed_ms_stacked": stacked_ms,
                                  "separate/stacked": separate_ms / stacked_ms})
    largest = rows[-1]
    return Measurement(
        rows=rows, metric="ms per decode step of the model runner (pack, forward, logits); floor: weights + KV "
                          "at the read bandwidth", limits=limits,
        goals=[Goal(f"engine step / floor at batch {batch}, context {context} (CUDA graphs, asynchronous scheduling)",
                    step_async / floor_async, "<=", 1.4),
               Goal(f"runner step / floor at batch {batch} (CUDA graphs)", largest[f"{step_key}/floor"], "<=", 1.4)],
        config={"model": MODEL_NAME, "model_config": repr(MODEL_CONFIG), "dtype": str(DTYPE).replace("torch.", ""),
                "block_size": BLOCK_SIZE, "batch": batch, "context": context, "weight_bytes": weight_bytes(model),
                "kv_bytes_per_token": MODEL_CONFIG.kv_bytes_per_token(model.embed.weight.element_size()),
                "engine_steps_timed": engine_steps,
                "engine_step_graphed_ms": step_graphed, "engine_step_eager_ms": step_eager,
                "engine_floor_graphed_ms": floor_graphed, "engine_floor_eager_ms": floor_eager,
                "engine_step_graphed/floor": step_graphed / floor_graphed,
                "engine_step_graphed_async_ms": step_async, "engine_floor_graphed_async_ms": floor_async,
                "engine_step_graphed_async/floor": step_async / floor_async,
                "engine_step_eager/floor": step_eager / floor_eager,
                "decode_matmul": decode_matmul, "split_k_autotuned": split_k_choices,
                "split_k_vs_torch_logits_rel_error": split_k_vs_torch,
                "capture_sizes": runner.graph_sizes, "cuda_graphs": on_gpu, "fused": model.fused,
                "projections_stacked": stacked, "separate_projections": separate_rows,
                "kernel_us_per_step_by_kind": by_kind, "kernel_us_per_step": sum(by_kind.values()),
                "kernel_launches_per_step": launches,
                # per mode: the calls, the profiled steps' wall time, time outside any call and the GPU's busy
                # time (the profiler's own synchronization as it stops is left out: labkit.profiling.runtime_calls),
                # and the Python functions with the most own time under cProfile (labkit.profiling.python_hotspots)
                "host_runtime_profile": host_calls, "host_runtime_calls_steps": profiled_steps,
                # what the GPU's busy time counts (records before it also counted the profiler's span of the
                # whole window on the GPU's timeline, first kernel to last: labkit.profiling.device_spans)
                "host_runtime_device_busy": "kernels, copies and memsets (labkit.profiling.device_spans)",
                # per mode: the timed steps' host phases, ms per step (labkit.serve.StepTiming; no profiler)
                "engine_step_phases_ms": step_phases,
                # per mode: the launch phase in its parts, ms per step (StepTiming's inputs, placeholders,
                # forward, sample)
                "engine_step_launch_parts_ms": launch_parts,
                # host time of one graph launch at the largest batch, GPU idle or behind the same graph (no profiler)
                "graph_launch_host_us": graph_launch_us,
                "timing": "runner rows: labkit.timing.measure (CUDA events, L2 flushed); engine steps: wall clock "
                          "of consecutive steps over their count, device synchronised before the first and after "
                          "the last"},
    )


# The trace both systems serve: prompts and outputs log-uniform over wide ranges (chat traces
# have long tails), more requests than run at once. The engine runs up to MAX_SEQS at a time;
# transformers runs the requests in arrival order in static batches of the same size.
TRACE = backend.pick(cpu=dict(requests=12, prompt=(3, 12), output=(2, 16), max_seqs=4),
                     gpu=dict(requests=128, prompt=(32, 1024), output=(8, 512), max_seqs=64))


def trace_requests(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The benchmark's prompts (random token ids) and each request's output length, both log-uniform."""
    rng = random.Random(seed)

    def log_uniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(high))))

    prompts = [[rng.randrange(MODEL_CONFIG.vocab_size) for _ in range(log_uniform(*TRACE["prompt"]))]
               for _ in range(TRACE["requests"])]
    return prompts, [log_uniform(*TRACE["output"]) for _ in prompts]


def hf_twin(model: models.Decoder):
    """``transformers``' Qwen3ForCausalLM holding ``model``'s weights, on its device and dtype."""
    import transformers

    config = transformers.Qwen3Config(**models.hf_config_kwargs(model.config))
    config._attn_implementation = "sdpa"
    with torch.device(model.embed.weight.device):
        hf = transformers.Qwen3ForCausalLM(config).to(model.embed.weight.dtype).eval()
    hf.load_state_dict(models.to_hf_state_dict(model), strict=True)
    hf.generation_config.eos_token_id = None  # run every row to max_new_tokens, as a static batch does
    hf.generation_config.pad_token_id = 0
    return hf


def hf_static_batches(hf, prompts: list[list[int]], outputs: list[int], batch: int) -> int:
    """Serve the trace with ``generate``: static batches of ``batch`` requests in arrival order, each
    left-padded and run to its longest output. Returns the tokens generated (useful or not)."""
    device = hf.device
    generated = 0
    for start in range(0, len(prompts), batch):
        rows, wanted = prompts[start:start + batch], outputs[start:start + batch]
        width = max(len(p) for p in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(rows):  # left padding: every row's last prompt token in the last column
            ids[row, width - len(prompt):] = torch.tensor(prompt, device=device)
            mask[row, width - len(prompt):] = 1
        new = max(wanted)
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        generated += len(rows) * new
    return generated


@benchmark("serve.engine_vs_hf", chapter=CHAPTER,
           title="The engine against transformers' generate in static batches: one trace of long-tailed lengths, "
                 "same weights, same concurrency, output tokens per second")
@torch.no_grad()
def bench_engine_vs_hf() -> Measurement:
    import transformers

    model = engine_model()
    prompts, outputs = trace_requests()
    max_seqs = TRACE["max_seqs"]
    longest = TRACE["prompt"][1] + TRACE["output"][1]
    llm = LLM(model, num_blocks=max_seqs * -(-longest // BLOCK_SIZE), block_size=BLOCK_SIZE, max_num_seqs=max_seqs,
              max_num_batched_tokens=backend.pick(cpu=256, gpu=8192), max_model_len=longest)
    params = [SamplingParams(max_tokens=n) for n in outputs]
    llm.generate(prompts[:max_seqs], params[:max_seqs])  # warm-up: Triton compiles, cuBLAS picks, graphs capture
    ours_ms = timing.timed_call(lambda: llm.generate(prompts, params))[1]
    useful = sum(outputs)
    del llm

    hf = hf_twin(model)
    hf_static_batches(hf, prompts[:2], [2, 2], 2)  # warm-up
    generated, hf_ms = timing.timed_call(lambda: hf_static_batches(hf, prompts, outputs, max_seqs))
    rows = [{"system": "ours (labkit.serve.LLM.generate)", "wall_ms": ours_ms, "tokens_generated": useful,
             "useful_tokens": useful, "useful_tokens_per_s": useful / ours_ms * 1e3},
            {"system": f"transformers generate (static batches of {max_seqs})", "wall_ms": hf_ms,
             "tokens_generated": generated, "useful_tokens": useful, "useful_tokens_per_s": useful / hf_ms * 1e3}]
    return Measurement(
        rows=rows, metric="output tokens the requests asked for, per second of wall clock",
        goals=[Goal("ours/hf throughput", hf_ms / ours_ms, ">=", 10.0)],
        config={"model": MODEL_NAME, "dtype": str(DTYPE).replace("torch.", ""), "requests": len(prompts),
                "prompt_lens": TRACE["prompt"], "output_lens": TRACE["output"], "distribution": "log-uniform",
                "trace_seed": 0, "max_concurrency": max_seqs, "ours/hf": hf_ms / ours_ms,
                "prompt_tokens": sum(len(p) for p in prompts), "transformers": transformers.__version__,
                "hf": f"Qwen3ForCausalLM, sdpa attention, the trace in arrival order in static batches of {max_seqs}, "
                      f"each left-padded and run greedily to its longest output",
                "ours": f"LLM(max_num_seqs={max_seqs}, block_size={BLOCK_SIZE}), greedy, each request its own "
                        f"max_tokens; CUDA graphs: {backend.on_gpu()}; fused model: {model.fused}"},
    )


@benchmark("serve.memory_budget", chapter=CHAPTER,
           title="The KV budget of LLM(model) on this GPU at gpu_memory_utilization 0.9: weights, the profiling "
                 "run's activation peak, non-torch memory, and the blocks left")
@torch.no_grad()
def bench_memory_budget() -> Measurement:
    if not backend.on_gpu():  # nothing to budget on a CPU: the chapter shows the recorded GPU run
        return Measurement(rows=[], metric="bytes", config={"skipped": "no CUDA device"})
    gc.collect()  # what earlier benchmarks of this process left must not count against the budget
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used_before = total - free  # the CUDA context and anything not this engine's, as vLLM's first snapshot
    model = engine_model()
    utilization, max_tokens, max_seqs = 0.9, 8192, 256
    llm = LLM(model, block_size=BLOCK_SIZE, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
              gpu_memory_utilization=utilization, cuda_graphs=False)
    budget = llm.memory_budget
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used_after = total - free
    pool_bytes = llm.kv.k.nbytes + llm.kv.v.nbytes
    rows = [{"term": name, "bytes": value, "GiB": value / 2**30} for name, value in budget.table()]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return Measurement(
        rows=rows, metric="bytes of device memory",
        goals=[Goal("the engine's device memory (in use after allocating the pool, less what was in use before the "
                    "model) / requested", (used_after - used_before) / budget.requested, "<=", 1.0)],
        config={"model": MODEL_NAME, "dtype": str(DTYPE).replace("torch.", ""), "gpu_memory_utilization": utilization,
                "max_num_batched_tokens": max_tokens, "max_num_seqs": max_seqs, "block_size": BLOCK_SIZE,
                "block_bytes": budget.block_bytes, "num_blocks": budget.num_blocks,
                "tokens_in_cache": budget.num_blocks * BLOCK_SIZE, "pool_bytes": pool_bytes,
                "device_total": total, "device_used_before_model": used_before, "device_used_after_pool": used_after,
                "weights": budget.weights, "activation_peak": budget.activation_peak, "non_torch": budget.non_torch},
    )
