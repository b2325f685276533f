"""Benchmark of chapter ``serving-engine``: why a decode step's matmuls take several times the
time their weights take to read.

- ``serve.decode_matmuls``: the four matmuls of every layer of the engine's model (stacked
  q/k/v, output, stacked gate/up, down; Qwen3-0.6B's shape in bf16, random weights), each
  layer with its own weights, at a decode batch of 1 and of 64 sequences. Each way of
  running them is captured as one CUDA graph over all the layers, as the runner's graphed
  step replays them: no launch gaps from the host, and no weight read twice from L2 (the
  graph reads far more than L2 holds, and L2 is flushed before each replay). The ways:

  - the layers' matmuls in the order a step runs them, through ``F.linear`` (cuBLAS) and
    through the split-K kernel (:func:`labkit.models.decoder.inference_linear`, the engine's
    own two paths);
  - each matmul replaced by a bare read of its weight's bytes (:func:`labkit.memory.read_sum`):
    the same kernels, in number and in bytes, doing nothing but reading;
  - one bare read per layer of its four weights' bytes (the launches a fused layer would
    make), and one bare read of every layer's (one launch);
  - and each matmul shape alone, its 28 launches in one graph, both ways and as bare reads.

  Against the floor the engine's benchmarks use: the bytes at the read bandwidth measured in
  the same run. Times are per layer (a step's 28 in one graph, divided) or per launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, memory, timing
from ..benchmarks import Measurement, benchmark
from ..models.decoder import inference_linear
from .bench_engine import CHAPTER, DTYPE, MODEL_NAME, engine_model

BATCHES = backend.pick(cpu=(1, 4), gpu=(1, 64))
MATMULS = ("qkv", "o", "gate_up", "down")  # a layer's matmuls in the order a decode step runs them
WAYS = ("torch", "split_k")  # inference_linear's decode_matmul: F.linear (cuBLAS), labkit's split-K kernel
REPS = backend.pick(cpu=1, gpu=None)


def layer_weights(model) -> list[dict[str, torch.Tensor]]:
    """Each layer's four matmul weights ``[N, K]`` (stacked where the engine stacks them), by name."""
    if not model.projections_fused:
        raise ValueError("layer_weights reads the stacked q/k/v and gate/up weights: call model.fuse_projections() "
                         "first, as the engine does")
    return [{"qkv": b.attn.qkv_weight, "o": b.attn.wo.weight, "gate_up": b.mlp.gate_up_weight, "down": b.mlp.down.weight}
            for b in model.blocks]


def bare_read(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call that only reads ``t``'s bytes (:func:`labkit.memory.read_sum`), its partial sums
    allocated here, once, outside any capture."""
    out = memory.read_sum(t)
    return lambda: memory.read_sum(t, out=out)


def graphed(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that replays ``calls`` in order: a CUDA graph of them on a GPU (run once
    first, to compile and autotune outside the capture), the calls themselves under the interpreter."""
    for call in calls:
        call()
    if not backend.on_gpu():
        return lambda: [call() for call in calls]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay


def _time_us(calls: list[Callable[[], object]]) -> float:
    return timing.measure(graphed(calls), reps=REPS).median_ms * 1e3


@benchmark("serve.decode_matmuls", chapter=CHAPTER,
           title="A decode step's matmuls (Qwen3-0.6B shape, bf16, batches 1 and 64) in one CUDA graph of all "
                 "layers, against bare reads of the same weights in as many launches, in one a layer, and in one")
@torch.no_grad()
def bench_decode_matmuls() -> Measurement:
    model = engine_model()
    model.fuse_projections()
    weights = layer_weights(model)
    layers = len(weights)
    read_tbps = ceilings.read_bandwidth_tbps()
    # Every layer's four weights' bytes once more, back to back: a layer's slice is one bare read
    # of its four weights, the whole buffer one bare read of them all.
    flat = torch.cat([w.reshape(-1) for layer in weights for w in layer.values()])
    layer_slices = flat.split([sum(w.numel() for w in layer.values()) for layer in weights])
    rows = []
    for batch in BATCHES:
        gen = torch.Generator(device=backend.device()).manual_seed(batch)
        inputs = {name: torch.randn(batch, w.shape[1], generator=gen, device=backend.device(), dtype=DTYPE)
                  for name, w in weights[0].items()}
        for way in WAYS:  # both paths give the matmul, at every layer's shape
            for name, w in weights[-1].items():
                check.assert_close(inference_linear(inputs[name], w, way), F.linear(inputs[name].double(), w.double()),
                                   dtype=DTYPE, name=f"{way} {name} at batch {batch}")

        def matmuls(way, names=MATMULS):
            return [lambda x=inputs[n], w=layer[n]: inference_linear(x, w, way) for layer in weights for n in names]

        step = {way: _time_us(matmuls(way)) / layers for way in WAYS}
        step["read"] = _time_us([bare_read(layer[n]) for layer in weights for n in MATMULS]) / layers
        step["read_per_layer"] = _time_us([bare_read(s) for s in layer_slices]) / layers
        step["read_once"] = _time_us([bare_read(flat)]) / layers
        layer_bytes = flat.nbytes / layers
        rows.append({"batch": batch, "matmul": "layer (all four)", "launches": len(MATMULS), "bytes": layer_bytes,
                     "floor_us": layer_bytes / (read_tbps * 1e6), **{f"{k}_us": v for k, v in step.items()}})
        for name in MATMULS:
            nbytes = weights[0][name].nbytes
            alone = {way: _time_us(matmuls(way, (name,))) / layers for way in WAYS}
            alone["read"] = _time_us([bare_read(layer[name]) for layer in weights]) / layers
            rows.append({"batch": batch, "matmul": name, "launches": 1, "N": weights[0][name].shape[0],
                         "K": weights[0][name].shape[1], "bytes": nbytes, "floor_us": nbytes / (read_tbps * 1e6),
                         **{f"{k}_us": v for k, v in alone.items()}})
    for row in rows:
        row["torch/read"] = row["torch_us"] / row["read_us"]
        row["torch/floor"] = row["torch_us"] / row["floor_us"]
        row["split_k/torch"] = row["split_k_us"] / row["torch_us"]
    return Measurement(
        rows=rows,
        metric="us per layer (a step's layers in one CUDA graph, divided by their number) or per launch (a "
               "matmul shape alone: its layers' launches in one graph); floor: the bytes at the read bandwidth",
        limits=ceilings.limits(),
        goals=[],
        config={"model": MODEL_NAME, "model_config": repr(model.config), "dtype": str(DTYPE).replace("torch.", ""),
                "layers": layers, "batches": list(BATCHES), "matmuls": list(MATMULS),
                "torch": "inference_linear(x, w, 'torch'): F.linear, cuBLAS on a GPU",
                "split_k": "inference_linear(x, w, 'split_k'): labkit.matmul's split-K kernel, autotuned per shape",
                "read": "labkit.memory.read_sum over each matmul's weight: the same launches and bytes, reading only",
                "read_per_layer": "one read_sum a layer over its four weights' bytes (a copy, back to back)",
                "read_once": "one read_sum over every layer's weights' bytes",
                "cuda_graphs": backend.on_gpu(), "checked": "each way's product against float64 F.linear, "
                                                             "every shape, each batch"},
    )
