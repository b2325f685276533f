"""Hidden tests of rl-tis-correction: padding, a float64 loop reference, gradients, clipping."""

import math

import torch


def expected_weights(trainer, rollout, mask, cap):
    out = torch.zeros(trainer.shape, dtype=torch.float64)
    for i in range(trainer.shape[0]):
        for t in range(trainer.shape[1]):
            if mask[i, t] != 0:
                out[i, t] = min(math.exp(float(trainer[i, t] - rollout[i, t])), cap)
    return out


def expected_loss(logp, old, rollout, adv, mask, cap, clip_eps):
    """Token by token, in float64: the value and d loss / d logp (the weights are constants)."""
    weights = expected_weights(old, rollout, mask, cap)
    total, grad = 0.0, torch.zeros(logp.shape, dtype=torch.float64)
    count = float(mask.sum())
    for i in range(logp.shape[0]):
        a = float(adv[i])
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            r = math.exp(float(logp[i, t] - old[i, t]))
            lo, hi = 1 - clip_eps, 1 + clip_eps
            surrogate = min(r * a, min(max(r, lo), hi) * a)
            clipped = (a > 0 and r > hi) or (a < 0 and r < lo)
            w = float(weights[i, t])
            total += -w * surrogate
            grad[i, t] = 0.0 if clipped else -w * r * a / count
    return torch.tensor(total / count, dtype=torch.float64), grad


def batch(n, t, seed, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3 - 0.01
    rollout = old + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    logp = old + 0.1 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    return logp, old, rollout, adv, mask


def test_padding_gets_no_weight(submission):
    """Padded positions get weight 0 whatever their log-probs."""
    _, old, rollout, _, mask = batch(7, 9, seed=1)
    mask[0, 1:] = 0  # a sequence of one token, built explicitly
    out = submission.call("tis_weights", old, rollout, mask, 2.0)
    assert isinstance(out, torch.Tensor) and out.shape == old.shape, f"weights must be shaped {tuple(old.shape)}"
    assert (out[mask == 0] == 0).all(), "every padded position must have weight exactly 0"


def test_weights_against_a_loop(submission):
    """Odd sizes, caps of 1.2 and 5: the weights against a token-by-token loop."""
    _, old, rollout, _, mask = batch(11, 13, seed=2, spread=1.0)
    for cap in (1.2, 5.0):
        out = submission.call("tis_weights", old, rollout, mask, cap)
        submission.expect_close(out, expected_weights(old, rollout, mask, cap), dtype=torch.float64, tol=1e-9,
                                name=f"tis_weights, cap {cap}")


def test_loss_and_gradient_against_a_loop(submission):
    """A fresh batch, the current policy near the old one: loss and gradient against the loop."""
    logp, old, rollout, adv, mask = batch(9, 7, seed=3)
    value, grad = submission.call("loss_and_grad", logp, old, rollout, adv, mask, 2.0, 0.2)
    want, want_grad = expected_loss(logp, old, rollout, adv, mask, 2.0, 0.2)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="loss")
    submission.expect_close(grad, want_grad, dtype=torch.float64, tol=1e-9, name="d loss / d logp")


def test_weights_carry_no_gradient(submission):
    """The weights come from the trainer's old log-probs and are constants: with old_logp equal to
    logp in value, the gradient is -w * A / count, with no term from differentiating w."""
    logp, _, rollout, adv, mask = batch(6, 8, seed=4)
    value, grad = submission.call("loss_and_grad", logp, logp.clone(), rollout, adv, mask, 3.0, 0.2)
    want, want_grad = expected_loss(logp, logp, rollout, adv, mask, 3.0, 0.2)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="loss")
    submission.expect_close(grad, want_grad, dtype=torch.float64, tol=1e-9, name="gradient (weights held constant)")


def test_clipping_still_applies(submission):
    """Ratios pi/pi_old far outside [0.8, 1.2] in the advantage's favoured direction get no gradient,
    whatever the weight: the weight multiplies the clipped surrogate, it is not part of the ratio."""
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor([[0.5, 0.05, -0.5], [-0.5, 0.5, 0.0]], dtype=torch.float64)
    rollout = old + torch.tensor([[0.4, -0.3, 0.2], [-0.6, 0.1, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    value, grad = submission.call("loss_and_grad", logp, old, rollout, adv, mask, 2.0, 0.2)
    want, want_grad = expected_loss(logp, old, rollout, adv, mask, 2.0, 0.2)
    submission.expect_close(value, want, dtype=torch.float64, tol=1e-9, name="clipped, weighted loss")
    submission.expect_close(grad, want_grad, dtype=torch.float64, tol=1e-9, name="gradient with clipping")
