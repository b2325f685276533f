"""Public tests of ddp-bucketed-reducer: what check() runs in the notebook.

The gradient tests run the submission's reducer on real gloo processes through its
``ddp_gradients_on_processes`` and compare every rank's gradients with what torch's DDP
computes: the average over ranks of each rank's own gradient (a parameter a rank does not
use contributes zeros), computed here in float64 from the model's formula.
"""

import torch


def make_case(seed, n, layers, width, rows=5):
    """Weights of a ``layers``-deep chain of width ``width``, and one input per rank."""
    g = torch.Generator().manual_seed(seed)
    weights = []
    for _ in range(layers):
        weights.append(torch.randn(width, width, generator=g) / width**0.5)
        weights.append(torch.randn(width, generator=g) / 4)
    return weights, [torch.randn(rows, width, generator=g) for _ in range(n)]


def local_gradients(weights, x, skip):
    """One rank's gradients in float64 (zeros for the layers it skips): the model's formula,
    ``mean(chain(x)^2)`` with ``chain`` the unskipped ``tanh(x W^T + b)`` layers."""
    params = [w.double().requires_grad_() for w in weights]
    h = x.double()
    for layer in range(len(params) // 2):
        if layer not in skip:
            h = torch.tanh(h @ params[2 * layer].T + params[2 * layer + 1])
    h.square().mean().backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def expected_buckets(sizes, bucket_bytes, first_bucket_bytes):
    """DDP's rule (torch's compute_bucket_assignment_by_size over the reverse order)."""
    buckets, current, size, limit = [], [], 0, first_bucket_bytes
    for i in reversed(range(len(sizes))):
        current.append(i)
        size += sizes[i]
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, bucket_bytes
    return buckets + ([current] if current else [])


def run_and_check(submission, seed, n, layers, width, skips, bucket_bytes, first_bucket_bytes):
    """Run the reducer on ``n`` processes; check each rank's gradients; return the per-rank results."""
    weights, inputs = make_case(seed, n, layers, width)
    per_rank = submission.call("ddp_gradients_on_processes", weights, inputs, skips, bucket_bytes, first_bucket_bytes)
    assert isinstance(per_rank, list) and len(per_rank) == n, \
        f"ddp_gradients_on_processes must return one result per rank ({n}), got {type(per_rank).__name__}"
    local = [local_gradients(weights, inputs[r], skips[r]) for r in range(n)]
    for k in range(len(weights)):
        want = sum(local[r][k] for r in range(n)) / n
        for r, (grads, _) in enumerate(per_rank):
            assert grads[k] is not None, f"rank {r}: parameter {k} has no gradient after finish()"
            submission.expect_close(grads[k], want, dtype=torch.float32,
                                    name=f"rank {r} of {n}, gradient of parameter {k} (the average over ranks)")
    return weights, inputs, local, per_rank


def test_buckets_of_a_small_model(submission):
    """Sizes of (W0, b0, W1, b1, W2, b2); 1000-byte first bucket, then 5000: [[5, 4], [3, 2, 1, 0]]."""
    # Walking back from parameter 5: 64 + 1024 >= 1000 closes the first bucket; then
    # 256 + 4096 + 256 + 4096 >= 5000 closes the second with parameter 0.
    got = submission.call("assign_buckets", [4096, 256, 4096, 256, 1024, 64], 5000, 1000)
    assert got == [[5, 4], [3, 2, 1, 0]], f"expected [[5, 4], [3, 2, 1, 0]], got {got}"


def test_two_ranks_average(submission):
    """Two ranks, three layers of width 16, buckets of about 1200 bytes: every rank gets the average."""
    run_and_check(submission, seed=1, n=2, layers=3, width=16, skips=[[], []], bucket_bytes=1200,
                  first_bucket_bytes=100)
