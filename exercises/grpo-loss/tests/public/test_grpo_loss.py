"""Public tests of grpo-loss: what check() runs in the notebook."""

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


def test_advantages_are_per_group(submission):
    """Rewards of 2 prompts x 4 completions: each group centred and scaled on its own."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    out = submission.call("group_advantages", rewards, 4)
    submission.expect_close(out, expected_advantages(rewards, 4), dtype=torch.float64, tol=1e-9,
                            name="group_advantages([1,0,0,0, 1,1,0,1], 4)")


def test_loss_on_a_small_batch(submission):
    """A batch of 6 completions with padding: the loss value, token-level normalised."""
    logp, ref, rewards, mask = batch()
    adv = expected_advantages(rewards, 3)
    value, _ = submission.call("loss_and_grad", logp, ref, adv, mask)
    want, _ = expected_loss(logp, ref, adv, mask)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="loss")
