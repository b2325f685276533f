"""Public tests of dpo-loss: what check() runs in the notebook.

They compare with values stored here for fixed inputs, worked out once from the formulas of
the notebook, or check properties; never with a function that computes the loss (that would
be the solution, ready to paste). The hidden tests have their own reference, on fresh inputs.
"""

import math

import torch


def test_sequence_logps_skip_padding(submission):
    """Two rows of 4 tokens: only the masked-in tokens count, and they are summed."""
    token_logps = torch.tensor([[-0.5, -1.25, -0.75, -2.0], [-0.25, -3.0, -1.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    out = submission.call("sequence_logps", token_logps, mask)
    # -1.25 - 0.75 and -3.0 - 1.5 - 0.5
    submission.expect_close(out, torch.tensor([-2.0, -5.0], dtype=torch.float64), dtype=torch.float64, tol=1e-12,
                            name="sequence_logps")


def test_loss_on_three_pairs(submission):
    """Three pairs at beta = 0.5: the loss value and its gradient on the chosen log-probs."""
    chosen = torch.tensor([-3.0, -5.5, -2.25], dtype=torch.float64)
    rejected = torch.tensor([-4.0, -5.0, -6.5], dtype=torch.float64)
    ref_chosen = torch.tensor([-3.5, -5.0, -2.75], dtype=torch.float64)
    ref_rejected = torch.tensor([-3.75, -5.25, -6.0], dtype=torch.float64)
    loss, d_chosen, _, _, _ = submission.call("loss_and_grads", chosen, rejected, ref_chosen, ref_rejected, 0.5)
    # margins of log-ratios 0.75, -0.75, 1.0, so z = 0.375, -0.375, 0.5 and the loss is the
    # mean of log(1 + e^-z); d loss / d chosen_i = -0.5 * sigmoid(-z_i) / 3
    submission.expect_close(loss, torch.tensor(0.6317745041532623, dtype=torch.float64), dtype=torch.float64,
                            tol=1e-9, name="loss")
    want = torch.tensor([-0.06788890000765503, -0.09877776665901163, -0.0629234447996909], dtype=torch.float64)
    submission.expect_close(d_chosen, want, dtype=torch.float64, tol=1e-9, name="d loss / d policy_chosen")


def test_loss_at_the_reference_is_log_2(submission):
    """A policy equal to its reference has every implicit reward 0: the loss is log 2, whatever beta."""
    chosen = torch.tensor([-3.0, -7.5, -1.25, -4.0], dtype=torch.float64)
    rejected = torch.tensor([-2.0, -9.0, -6.0, -4.5], dtype=torch.float64)
    for beta in (0.1, 1.0):
        loss, _, _, _, _ = submission.call("loss_and_grads", chosen, rejected, chosen, rejected, beta)
        assert isinstance(loss, torch.Tensor) and abs(float(loss) - math.log(2)) < 1e-9, \
            f"at the reference the loss must be log 2 = {math.log(2):.6f} for beta={beta}, got {float(loss):.6f}"
