"""labkit.compile: graph-break inspection, Inductor's output read back, piecewise compilation."""

import dataclasses

import pytest
import torch

import labkit
from labkit import models
from labkit.compile import bench as compile_bench
from labkit.compile.piecewise import CompiledModelRunner, split_at


def _one_layer():
    return dataclasses.replace(models.TINY, num_layers=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_piecewise_follows_eager_over_advancing_steps(device):
    """Compiled pieces (on CUDA replayed from their graphs) step after step, with new
    positions, lengths and padded sizes, give eager's logits: stale static inputs, a wrong
    copy or a wrong size's code would show."""
    on_cuda = device == "cuda"
    config = models.TINY if on_cuda else _one_layer()
    _, kv, seqs, runner = compile_bench.decode_setup(config, max_batch=4, context=24, dtype=torch.float32,
                                                     device=device, cuda_graphs=on_cuda,
                                                     sizes=None if on_cuda else (2, 4))
    runner.compile()
    for batch in (3, 1, 4, 2) if on_cuda else (3, 1):
        steps = seqs[:batch]
        for seq in steps:
            seq.output.clear()
            seq.num_cached = len(seq.prompt) - 1
        for step in range(4):
            compiled = runner.execute(steps).clone()
            # eager over the same state (it rewrites the same slots with the same tokens' K/V)
            eager = runner.forward(runner.prepare(steps))
            labkit.check.assert_close(compiled, eager, dtype=torch.float32, name=f"batch {batch}, step {step}")
            for seq, token in zip(steps, compiled.argmax(-1).tolist()):
                seq.output.append(token)
                seq.num_cached += 1
    assert all(p.graphs if on_cuda else p.compiled for p in runner.backend.pieces)
