"""Public tests of zero2-step: what check() runs in the notebook.

They check properties a correct step must have, not a copy of the answer: Adam's first
step moves every weight by ``lr`` against the sign of its (averaged) gradient, whatever its
size; after one step the moments are ``(1 - beta1) g`` and ``(1 - beta2) g^2`` of the
averaged gradient ``g``; every rank ends with the same parameters; the state is one shard;
the step calls one reduce-scatter and one all-gather of the padded vector.
"""

import math

import torch

HYPER = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def hyper_args(hyper):
    """AdamW's settings in zero2_on_processes's argument order."""
    return [hyper[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")]


def make_case(seed, numel, world_size, steps, scale=1.0):
    """Flat parameters and ``steps`` rounds of one gradient per rank."""
    g = torch.Generator().manual_seed(seed)
    initial = torch.randn(numel, generator=g)
    grads = [[scale * torch.randn(numel, generator=g) for _ in range(world_size)] for _ in range(steps)]
    return initial, grads


def check_collectives(log, numel, world_size, steps, rank):
    padded = world_size * math.ceil(numel / world_size)
    want = [("reduce_scatter", padded), ("all_gather", padded)] * steps
    got = [(str(name), int(n)) for name, n in log]
    assert got == want, (f"rank {rank}: expected one reduce-scatter and one all-gather of the padded vector "
                         f"({padded} elements) per step, in that order: {want}; got {got}")


def check_ranks_agree(per_rank):
    for r, result in enumerate(per_rank[1:], start=1):
        assert torch.equal(result[0], per_rank[0][0]), \
            f"rank {r}'s parameters differ from rank 0's: every rank must end with every new parameter (all-gather)"


def test_adamw_first_step_by_hand(submission):
    """One AdamW step of three weights, worked out by hand (see the comment)."""
    # Step 1: m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps) = lr * sign(g)
    # (to 1e-7 here); decoupled decay first multiplies by 1 - lr * wd = 1 - 0.1 * 0.01 = 0.999:
    # 1.0 * 0.999 - 0.1 = 0.899; -2.0 * 0.999 + 0.1 = -1.898; 0.5 * 0.999 - 0.1 = 0.3995.
    param = torch.tensor([1.0, -2.0, 0.5])
    grad = torch.tensor([0.3, -0.2, 0.7])
    _, args = submission.call_with_args("adamw_update_", param, grad, torch.zeros(3), torch.zeros(3), 1,
                                        0.1, 0.9, 0.999, 1e-8, 0.01)
    submission.expect_close(args[0], torch.tensor([0.899, -1.898, 0.3995], dtype=torch.float64),
                            dtype=torch.float32, name="param after one AdamW step")
    submission.expect_close(args[2], 0.1 * grad.double(), dtype=torch.float32, name="exp_avg after one step")
    submission.expect_close(args[3], 0.001 * grad.double() ** 2, dtype=torch.float32, name="exp_avg_sq after one step")


def test_two_ranks_first_step(submission):
    """11 weights on 2 ranks (shards of 6): Adam's first step on the averaged gradient, on both ranks."""
    numel, n = 11, 2
    initial, grads = make_case(1, numel, n, steps=1)
    per_rank = submission.call("zero2_on_processes", initial, grads, *hyper_args(HYPER))
    assert isinstance(per_rank, list) and len(per_rank) == n, f"expected one result per rank ({n}), got {per_rank!r}"
    check_ranks_agree(per_rank)
    mean = sum(g.double() for g in grads[0]) / n
    submission.expect_close(per_rank[0][0], initial.double() - HYPER["lr"] * mean.sign(), dtype=torch.float32,
                            name="parameters after one step (each moves by lr against the sign of the averaged gradient)")
    shard = math.ceil(numel / n)
    padded_mean = torch.cat([mean, mean.new_zeros(n * shard - numel)])
    for r, (_, exp_avg, exp_avg_sq, step, _) in enumerate(per_rank):
        assert step == 1, f"rank {r}: state['step'] should count one step, got {step}"
        own = padded_mean[r * shard:(r + 1) * shard]
        submission.expect_close(exp_avg, 0.1 * own, dtype=torch.float32,
                                name=f"rank {r}'s exp_avg: (1 - beta1) times its slice of the averaged gradient")
        submission.expect_close(exp_avg_sq, 0.001 * own**2, dtype=torch.float32,
                                name=f"rank {r}'s exp_avg_sq: (1 - beta2) times its slice of the squared average")


def test_one_reduce_scatter_one_all_gather(submission):
    """Two steps on 2 ranks: each step is one reduce-scatter and one all-gather of the padded vector."""
    numel, n, steps = 9, 2, 2
    initial, grads = make_case(2, numel, n, steps)
    per_rank = submission.call("zero2_on_processes", initial, grads, *hyper_args(HYPER))
    for r, result in enumerate(per_rank):
        check_collectives(result[4], numel, n, steps, r)
