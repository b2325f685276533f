"""Hidden tests of zero2-step: several steps on 3 and 4 ranks with weight decay against a
float64 AdamW over the whole vector on the averaged gradients, the state kept as one shard,
the traffic, and the update alone on random inputs."""

import math

import torch

from labkit.grade.harness import public_module

public = public_module(__file__, "test_zero2_step.py")

DECAYED = dict(lr=0.05, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1)


def reference_adamw(initial, grads_per_step, hyper):
    """Plain AdamW in float64 on the average over ranks; returns the parameters and both moments."""
    p = initial.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, grads in enumerate(grads_per_step, start=1):
        g = sum(x.double() for x in grads) / len(grads)
        p.mul_(1 - hyper["lr"] * hyper["weight_decay"])
        m = hyper["beta1"] * m + (1 - hyper["beta1"]) * g
        v = hyper["beta2"] * v + (1 - hyper["beta2"]) * g * g
        m_hat, v_hat = m / (1 - hyper["beta1"] ** step), v / (1 - hyper["beta2"] ** step)
        p = p - hyper["lr"] * m_hat / (v_hat.sqrt() + hyper["eps"])
    return p, m, v


def run_and_check(submission, seed, numel, n, steps, scale):
    initial, grads = public.make_case(seed, numel, n, steps, scale=scale)
    per_rank = submission.call("zero2_on_processes", initial, grads, *public.hyper_args(DECAYED))
    assert isinstance(per_rank, list) and len(per_rank) == n, f"expected one result per rank ({n})"
    public.check_ranks_agree(per_rank)
    want_p, want_m, want_v = reference_adamw(initial, grads, DECAYED)
    submission.expect_close(per_rank[0][0], want_p, dtype=torch.float32,
                            name=f"parameters after {steps} steps on {n} ranks")
    shard = math.ceil(numel / n)
    pad = n * shard - numel
    want_m, want_v = (torch.cat([t, t.new_zeros(pad)]) for t in (want_m, want_v))
    for r, (_, exp_avg, exp_avg_sq, step, log) in enumerate(per_rank):
        assert step == steps, f"rank {r}: state['step'] should be {steps}, got {step}"
        assert exp_avg.numel() == shard and exp_avg_sq.numel() == shard, \
            f"rank {r}: the moments must be one shard ({shard} elements), got {exp_avg.numel()}, {exp_avg_sq.numel()}"
        submission.expect_close(exp_avg, want_m[r * shard:(r + 1) * shard], dtype=torch.float32,
                                name=f"rank {r}'s exp_avg (its slice of the averaged gradient's first moment)")
        submission.expect_close(exp_avg_sq, want_v[r * shard:(r + 1) * shard], dtype=torch.float32,
                                name=f"rank {r}'s exp_avg_sq")
        public.check_collectives(log, numel, n, steps, r)


def test_three_ranks_three_steps_with_weight_decay(submission):
    """37 weights on 3 ranks (shards of 13, two of padding), three steps, decay 0.1, small gradients."""
    run_and_check(submission, seed=3, numel=37, n=3, steps=3, scale=1e-3)


def test_four_ranks_uneven_shards(submission):
    """10 weights on 4 ranks (shards of 3, the last with one real element), two steps."""
    run_and_check(submission, seed=4, numel=10, n=4, steps=2, scale=1.0)


def test_update_alone_on_random_inputs(submission):
    """adamw_update_ at step 5 on random moments: torch.optim.AdamW's formula, in place."""
    g = torch.Generator().manual_seed(5)
    param, grad = torch.randn(23, generator=g), torch.randn(23, generator=g)
    exp_avg, exp_avg_sq = 0.1 * torch.randn(23, generator=g), torch.rand(23, generator=g) * 0.01
    h = DECAYED
    _, args = submission.call_with_args("adamw_update_", param, grad, exp_avg, exp_avg_sq, 5,
                                        h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"])
    m = h["beta1"] * exp_avg.double() + (1 - h["beta1"]) * grad.double()
    v = h["beta2"] * exp_avg_sq.double() + (1 - h["beta2"]) * grad.double() ** 2
    want = (param.double() * (1 - h["lr"] * h["weight_decay"])
            - h["lr"] * (m / (1 - h["beta1"] ** 5)) / ((v / (1 - h["beta2"] ** 5)).sqrt() + h["eps"]))
    submission.expect_close(args[0], want, dtype=torch.float32, name="param after the update")
    submission.expect_close(args[2], m, dtype=torch.float32, name="exp_avg after the update")
    submission.expect_close(args[3], v, dtype=torch.float32, name="exp_avg_sq after the update")


def test_state_is_one_shard(submission):
    """init_state: zero moments of ceil(numel / world_size) elements, step 0, for several sizes."""
    for numel, n in ((10, 4), (12, 3), (1, 2), (1000, 7)):
        state = submission.call("init_state", numel, n)
        shard = math.ceil(numel / n)
        assert isinstance(state, dict) and set(state) >= {"exp_avg", "exp_avg_sq", "step"}, \
            f"init_state must return a dict with exp_avg, exp_avg_sq and step, got {state!r}"
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            assert isinstance(t, torch.Tensor) and t.shape == (shard,) and t.dtype == torch.float32, \
                f"numel {numel}, {n} ranks: {key} must be fp32 zeros of {shard} elements, got {t!r}"
            assert not t.any(), f"{key} must start at zero"
        assert state["step"] == 0, f"step must start at 0, got {state['step']!r}"
