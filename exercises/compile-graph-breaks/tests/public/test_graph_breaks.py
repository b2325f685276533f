"""Public tests of compile-graph-breaks: what check() runs in the notebook.

The function as it was given (with its graph breaks) is the reference: it is the problem,
not the solution. Every test goes through Dynamo, so a function that still breaks scores
nothing, however right its numbers.
"""

import torch

from labkit import check


def original(x, w, threshold):
    """The function as the exercise gives it, graph breaks and all (run eagerly here)."""
    h = x @ w
    if h.sum() < 0:
        h = -h
    peak = h.abs().max().item()
    h = h / peak
    counts = (h.abs() >= threshold).sum(dim=1, keepdim=True).tolist()
    counts = torch.tensor(counts, dtype=h.dtype, device=h.device).clamp(min=1)
    return torch.where(h.abs() >= threshold, h, 0.0) / counts


def expect_one_graph(submission, *args):
    report = submission.explain("scaled_projection", *args)
    reasons = "\n  ".join(report["break_reasons"])
    # break_reasons too: explain counts breaks by the graphs they leave, and a break
    # followed by no tensor op leaves none
    ok = report["graph_break_count"] == 0 and report["graph_count"] == 1 and not report["break_reasons"]
    assert ok, (
        f"expected one graph and no break, got {report['graph_count']} graphs and "
        f"{report['graph_break_count']} breaks, {len(report['break_reasons'])} break reasons:\n  {reasons}")


def test_no_graph_breaks(submission):
    """torch._dynamo.explain finds one graph and no break (x 5x7, w 7x3, threshold 0.3)."""
    expect_one_graph(submission, check.randn(5, 7, seed=1), check.randn(7, 3, seed=2), 0.3)


def test_fullgraph_matches_the_original(submission):
    """One graph, and compiled with fullgraph=True it gives the original's numbers."""
    x, w = check.randn(6, 9, seed=3), check.randn(9, 4, seed=4)
    expect_one_graph(submission, x, w, 0.25)
    out = submission.call_fullgraph("scaled_projection", x, w, 0.25)
    submission.expect_close(out, original(x.double(), w.double(), 0.25), dtype=torch.float32, name="output")
