"""Hidden tests of compile-graph-breaks: the sign flip taken, empty rows, fresh shapes and dtypes.

Each case is built explicitly (a negative total, a row that keeps nothing), so any salted
seed makes a fair test. Each goes through Dynamo and also runs eagerly: both must match.
"""

import torch

from labkit import check
from labkit.grade.harness import public_module

public = public_module(__file__, "test_graph_breaks.py")


def both_ways_match(submission, x, w, threshold, dtype):
    public.expect_one_graph(submission, x, w, threshold)
    want = public.original(x.double(), w.double(), threshold)
    for way, out in (("compiled with fullgraph=True", submission.call_fullgraph("scaled_projection", x, w, threshold)),
                     ("eager", submission.call("scaled_projection", x, w, threshold))):
        submission.expect_close(out, want, dtype=dtype, name=f"output ({way})")


def test_negative_total_flips_the_sign(submission):
    """A projection whose total is negative: the original flips its sign before scaling."""
    x, w = check.randn(7, 5, seed=11), check.randn(5, 6, seed=12)
    if (x.double() @ w.double()).sum() > 0:
        w = -w
    both_ways_match(submission, x, w, 0.2, torch.float32)


def test_rows_with_nothing_kept(submission):
    """Rows of zeros keep no entry: their count is clamped to 1 and their output is 0, not NaN."""
    x, w = check.randn(9, 4, seed=13), check.randn(4, 5, seed=14)
    x[2] = 0.0
    x[7] = 0.0
    both_ways_match(submission, x, w, 0.3, torch.float32)


def test_fresh_shapes_in_float64(submission):
    """Odd shapes (13x29 by 29x11) in float64, a negative total and a positive one."""
    for seed, sign in ((21, 1.0), (22, -1.0)):
        x = check.randn(13, 29, dtype=torch.float64, seed=seed)
        w = check.randn(29, 11, dtype=torch.float64, seed=seed + 100)
        if torch.sign((x @ w).sum()) != sign:
            w = -w
        both_ways_match(submission, x, w, 0.15, torch.float64)
