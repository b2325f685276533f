"""Hidden tests of grpo-loss: padding, uniform groups, the KL term, gradients, clipping.

The float64 reference lives here, not in the public tests: there it would be the solution.
"""

import math

import torch


def expected_advantages(rewards, group_size, eps=1e-4):
    out = torch.empty(len(rewards), dtype=torch.float64)
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size].double()
        mean = group.sum() / group_size
        std = (((group - mean) ** 2).sum() / group_size).sqrt()
        out[start:start + group_size] = (group - mean) / (std + eps)
    return out


def expected_loss(logp, ref, adv, mask, old=None, clip_eps=0.2, beta=0.04):
    """Token by token, in float64: the value and d loss / d logp."""
    old = logp if old is None else old
    total, grad = 0.0, torch.zeros_like(logp, dtype=torch.float64)
    count = float(mask.sum())
    for i in range(logp.shape[0]):
        a = float(adv[i])
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            lo, hi = 1 - clip_eps, 1 + clip_eps
            surrogate = min(r * a, min(max(r, lo), hi) * a)
            clipped_active = (a > 0 and r > hi) or (a < 0 and r < lo)
            x = float(ref[i, t] - logp[i, t])
            k3 = math.exp(x) - x - 1
            total += -(surrogate - beta * k3)
            d_surrogate = 0.0 if clipped_active else r * a
            grad[i, t] = (-d_surrogate + beta * (1 - math.exp(x))) / count
    return torch.tensor(total / count, dtype=torch.float64), grad


def batch(n=6, t=5, seed=0, group_size=3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2 - 0.05
    ref = logp + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    rewards[:group_size] = torch.tensor([1.0] + [0.0] * (group_size - 1))
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    return logp, ref, rewards, mask


def test_advantages_of_uniform_groups_are_zero(submission):
    """A group whose rewards are all equal teaches nothing: advantage exactly 0, never NaN."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    out = submission.call("group_advantages", rewards, 3)
    submission.expect_close(out, expected_advantages(rewards, 3), dtype=torch.float64, tol=1e-9,
                            name="group_advantages with uniform groups")


def test_padding_never_counts(submission):
    """Changing log-probs at masked positions changes neither the loss nor its gradient."""
    logp, ref, rewards, mask = batch(n=8, t=7, seed=3, group_size=4)
    adv = expected_advantages(rewards, 4)
    noise = 5.0 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    noisy = logp + noise * (1 - mask)
    value, grad = submission.call("loss_and_grad", noisy, ref + noise * (1 - mask), adv, mask)
    want, want_grad = expected_loss(logp, ref, adv, mask)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="loss with noise in the padding")
    submission.expect_close(grad, want_grad, dtype=torch.float64, tol=1e-9, name="gradient (zero on padding)")


def test_kl_term_alone(submission):
    """Zero advantages leave only beta * K3, with x = ref_logp - logp."""
    logp, ref, _, mask = batch(n=4, t=6, seed=5)
    adv = torch.zeros(4, dtype=torch.float64)
    value, _ = submission.call("loss_and_grad", logp, ref, adv, mask, None, 0.2, 0.5)
    want, _ = expected_loss(logp, ref, adv, mask, beta=0.5)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="beta * mean K3")


def test_on_policy_gradient(submission):
    """old_logp=None: the ratio is 1 but its gradient is not zero."""
    logp, ref, rewards, mask = batch(n=6, t=5, seed=7)
    adv = expected_advantages(rewards, 3)
    _, grad = submission.call("loss_and_grad", logp, ref, adv, mask)
    _, want = expected_loss(logp, ref, adv, mask)
    submission.expect_close(grad, want, dtype=torch.float64, tol=1e-9, name="d loss / d logp, on-policy")


def test_clipped_tokens_get_no_gradient(submission):
    """Ratios far outside [0.8, 1.2] in the direction the advantage favours get zero surrogate gradient."""
    logp = torch.tensor([[0.0, -0.1, -2.0], [-0.3, -1.0, -0.2]], dtype=torch.float64)
    old = logp + torch.tensor([[-0.5, 0.05, 0.4], [0.6, -0.6, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    value, grad = submission.call("loss_and_grad", logp, logp.clone(), adv, mask, old, 0.2, 0.0)
    want_value, want_grad = expected_loss(logp, logp, adv, mask, old=old, beta=0.0)
    submission.expect_close(value, want_value, dtype=torch.float64, tol=1e-9, name="clipped loss")
    submission.expect_close(grad, want_grad, dtype=torch.float64, tol=1e-9, name="gradient with clipping")


def test_odd_shapes_and_old_logp(submission):
    """15 completions of 11 tokens in groups of 5, with an explicit old policy."""
    logp, ref, rewards, mask = batch(n=15, t=11, seed=11, group_size=5)
    old = logp + 0.2 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    adv = submission.call("group_advantages", rewards, 5)
    submission.expect_close(adv, expected_advantages(rewards, 5), dtype=torch.float64, tol=1e-9, name="advantages")
    value, grad = submission.call("loss_and_grad", logp, ref, expected_advantages(rewards, 5), mask, old, 0.2, 0.04)
    want, want_grad = expected_loss(logp, ref, expected_advantages(rewards, 5), mask, old=old)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="loss")
    submission.expect_close(grad, want_grad, dtype=torch.float64, tol=1e-9, name="gradient")


def test_loss_on_a_fresh_batch(submission):
    """A fresh batch of 6 completions with padding: the loss value, token-level normalised."""
    logp, ref, rewards, mask = batch(seed=1)
    adv = expected_advantages(rewards, 3)
    value, _ = submission.call("loss_and_grad", logp, ref, adv, mask)
    want, _ = expected_loss(logp, ref, adv, mask)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="loss")
