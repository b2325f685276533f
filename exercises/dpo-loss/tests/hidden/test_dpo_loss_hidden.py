"""Hidden tests of dpo-loss: fresh pairs, gradients, direction, extreme margins, rewards.

The float64 reference lives here, not in the public tests: there it would be the solution.
"""

import math

import torch


def expected(chosen, rejected, ref_chosen, ref_rejected, beta):
    """Pair by pair in float64: the loss, d/d chosen, d/d rejected."""
    b = len(chosen)
    total, d_chosen, d_rejected = 0.0, torch.zeros(b, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
    for i in range(b):
        z = beta * ((float(chosen[i]) - float(ref_chosen[i])) - (float(rejected[i]) - float(ref_rejected[i])))
        total += max(-z, 0.0) + math.log1p(math.exp(-abs(z)))  # log(1 + e^-z), stable
        weight = math.exp(-z) / (1 + math.exp(-z)) if z >= 0 else 1 / (1 + math.exp(z))  # sigmoid(-z), stable
        d_chosen[i] = -beta * weight / b
        d_rejected[i] = beta * weight / b
    return torch.tensor(total / b, dtype=torch.float64), d_chosen, d_rejected


def pairs(b, seed, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    chosen = -torch.rand(b, generator=g, dtype=torch.float64) * 10 - 0.5
    rejected = -torch.rand(b, generator=g, dtype=torch.float64) * 10 - 0.5
    ref_chosen = chosen + spread * torch.randn(b, generator=g, dtype=torch.float64)
    ref_rejected = rejected + spread * torch.randn(b, generator=g, dtype=torch.float64)
    return chosen, rejected, ref_chosen, ref_rejected


def test_loss_and_gradient_on_fresh_pairs(submission):
    """Seven fresh pairs at beta = 0.3: the loss and both gradients."""
    chosen, rejected, ref_chosen, ref_rejected = pairs(7, seed=1)
    loss, d_chosen, d_rejected, _, _ = submission.call("loss_and_grads", chosen, rejected, ref_chosen, ref_rejected, 0.3)
    want, want_chosen, want_rejected = expected(chosen, rejected, ref_chosen, ref_rejected, 0.3)
    submission.expect_close(loss, want, dtype=torch.float64, tol=1e-9, name="loss")
    submission.expect_close(d_chosen, want_chosen, dtype=torch.float64, tol=1e-9, name="d loss / d policy_chosen")
    submission.expect_close(d_rejected, want_rejected, dtype=torch.float64, tol=1e-9, name="d loss / d policy_rejected")


def test_chosen_preferred_lowers_the_loss(submission):
    """Raising the policy's log-prob of the chosen answers must lower the loss, step after step."""
    chosen, rejected, ref_chosen, ref_rejected = pairs(5, seed=2)
    losses = []
    for shift in (0.0, 1.0, 2.0, 4.0):
        loss, _, _, _, _ = submission.call("loss_and_grads", chosen + shift, rejected, ref_chosen, ref_rejected, 0.5)
        losses.append(float(loss))
    assert all(a > b for a, b in zip(losses, losses[1:])), \
        f"the loss must fall as the chosen answers get likelier, got {[round(x, 4) for x in losses]}"


def test_extreme_margins_stay_finite(submission):
    """Margins of +-10^4 nats at beta = 0.1 (z = +-1000): log(1 + e^-z), never inf or NaN."""
    chosen = torch.tensor([-1.0, -1e4 - 1.0], dtype=torch.float64)
    rejected = torch.tensor([-1e4 - 1.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    loss, d_chosen, _, _, _ = submission.call("loss_and_grads", chosen, rejected, ref, ref, 0.1)
    want, want_chosen, _ = expected(chosen, rejected, ref, ref, 0.1)
    submission.expect_close(loss, want, dtype=torch.float64, tol=1e-9, name="loss at extreme margins")
    submission.expect_close(d_chosen, want_chosen, dtype=torch.float64, tol=1e-9, name="d loss / d policy_chosen")


def test_implicit_rewards(submission):
    """The rewards are beta * (log pi - log pi_ref), per completion."""
    chosen, rejected, ref_chosen, ref_rejected = pairs(6, seed=3)
    _, _, _, r_chosen, r_rejected = submission.call("loss_and_grads", chosen, rejected, ref_chosen, ref_rejected, 0.25)
    submission.expect_close(r_chosen, 0.25 * (chosen - ref_chosen), dtype=torch.float64, tol=1e-12, name="chosen rewards")
    submission.expect_close(r_rejected, 0.25 * (rejected - ref_rejected), dtype=torch.float64, tol=1e-12,
                            name="rejected rewards")


def test_sequence_logps_on_fresh_masks(submission):
    """Odd shapes, masks of any lengths (a row may be all prompt)."""
    g = torch.Generator().manual_seed(4)
    token_logps = -torch.rand(7, 13, generator=g, dtype=torch.float64) * 3
    starts = torch.randint(0, 6, (7, 1), generator=g)
    ends = starts + torch.randint(0, 8, (7, 1), generator=g)
    positions = torch.arange(13)[None]
    mask = ((positions >= starts) & (positions < ends)).double()
    out = submission.call("sequence_logps", token_logps, mask)
    want = torch.tensor([sum(float(token_logps[i, t]) for t in range(13) if mask[i, t]) for i in range(7)],
                        dtype=torch.float64)
    submission.expect_close(out, want, dtype=torch.float64, tol=1e-12, name="sequence_logps")
