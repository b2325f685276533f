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


# -- the grader's way through Dynamo (labkit.grade.dynamo), which exercise compile-graph-breaks uses --

def _graph_breaks_exercise():
    from labkit.grade import exercise, notebook

    ex = exercise.load("compile-graph-breaks")
    return ex, notebook.submission_source(notebook.read(ex.notebook))


def test_a_submission_that_replaces_explain_still_shows_its_breaks():
    """A submission that swaps torch._dynamo.explain (and torch.compile) for fakes reporting one
    clean graph is measured by the functions the grader took before loading it."""
    from labkit.grade import runner

    ex, solution = _graph_breaks_exercise()
    forged = solution + '''
import types
def _clean(fn):
    return lambda *a, **k: types.SimpleNamespace(graph_count=1, graph_break_count=0, break_reasons=[])
torch._dynamo.explain = _clean
torch.compile = lambda fn, **kw: fn
def scaled_projection(x, w, threshold):
    h = x @ w
    if h.sum() < 0:
        h = -h
    return torch.where(h.abs() >= threshold * h.abs().max().item(), h / h.abs().max(), 0.0)
'''
    report = runner.grade(ex, forged, hidden=False)
    assert report.score == 0, report.results["tests"]
    assert any("break" in t["output"] for t in report.results["tests"])


def _sign_fixed_clean(x):
    return torch.where(x.sum() > 0, x, -x)


def _sign_fixed_broken(x):
    return x if x.sum() > 0 else -x


def test_in_process_explain_and_fullgraph():
    """check()'s in-process submission answers explain and fullgraph calls as the sandbox does."""
    from labkit.grade.harness import InProcessSubmission, SubmissionFailed

    sub = InProcessSubmission({"clean": _sign_fixed_clean, "broken": _sign_fixed_broken})
    x = torch.randn(3, 4)
    assert sub.explain("clean", x) == {"graph_count": 1, "graph_break_count": 0, "break_reasons": []}
    # explain counts a break by the graphs it leaves (none after a branch that returns x
    # untouched), while break_reasons lists every break: check that, whatever the sign
    for sign in (1.0, -1.0):
        report = sub.explain("broken", sign * x.abs())
        assert len(report["break_reasons"]) == 1 and "jump" in report["break_reasons"][0], report
    torch.testing.assert_close(sub.call_fullgraph("clean", x), torch.where(x.sum() > 0, x, -x))
    with pytest.raises(SubmissionFailed):
        sub.call_fullgraph("broken", x)


def test_through_rejects_an_unknown_mode():
    from labkit.grade import dynamo

    with pytest.raises(ValueError, match="mode must be one of"):
        dynamo.through(lambda x: x, "inductor")
