"""Public tests of collectives-ring-allreduce: what check() runs in the notebook.

Each test starts real gloo processes through the submission's ``all_reduce_on_processes``
and compares every rank's result with the float64 sum of all ranks' inputs, computed here.
"""

import torch


def rank_inputs(n, numel, dtype, seed):
    """Every rank's input for one case. Low-precision floats are positive, so that the
    sum does not cancel and the dtype's tolerance means what it says."""
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return [torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype) for _ in range(n)]
    xs = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(n)]
    if dtype in (torch.float16, torch.bfloat16):
        xs = [x.abs() + 0.5 for x in xs]
    return [x.to(dtype) for x in xs]


def run_cases(submission, n, cases, seed=0):
    """All-reduce each ``(numel, dtype)`` case on ``n`` processes; return inputs [case][rank], outputs [rank][case]."""
    inputs = [rank_inputs(n, numel, dtype, seed + i) for i, (numel, dtype) in enumerate(cases)]
    per_rank = submission.call("all_reduce_on_processes", [[case[r] for case in inputs] for r in range(n)])
    assert isinstance(per_rank, list) and len(per_rank) == n, \
        f"all_reduce_on_processes must return one list per rank ({n}), got {type(per_rank).__name__}"
    return inputs, per_rank


def expect_sums(submission, inputs, per_rank):
    for c, xs in enumerate(inputs):
        want = torch.stack([x.double() for x in xs]).sum(0)
        dtype = xs[0].dtype
        for r, outputs in enumerate(per_rank):
            submission.expect_close(outputs[c], want, dtype=dtype, tol=0.0 if not dtype.is_floating_point else None,
                                    name=f"rank {r} of {len(per_rank)}, {xs[0].numel()} elements of {dtype}")


def test_two_ranks(submission):
    """Two ranks, an odd size (chunks of 4 and 3) and a tiny one (1 element: one chunk empty)."""
    inputs, per_rank = run_cases(submission, 2, [(7, torch.float32), (1, torch.float32)])
    expect_sums(submission, inputs, per_rank)
