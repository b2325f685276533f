"""Public tests of rl-tis-correction: what check() runs in the notebook.

They compare with values stored here for fixed inputs, worked out once by hand from
min(exp(trainer - rollout), cap) and the weighted clipped surrogate, never with a function
that computes them (that would be the solution, ready to paste). The hidden tests have
their own reference, on fresh inputs.
"""

import math

import torch

TRAINER = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -3.0, -0.75]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-0.75, -0.5, -2.5], [-0.25, -1.5, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def test_weights_on_a_small_batch(submission):
    """Two sequences of 3 tokens, the last one padding: each weight is exp(trainer - rollout)."""
    out = submission.call("tis_weights", TRAINER, ROLLOUT, MASK, 2.0)
    # exp(0.25), exp(-0.5), exp(0.5); exp(0), exp(-1.5), and 0 on the padded token
    want = torch.tensor([[1.2840254166877414, 0.6065306597126334, 1.6487212707001282],
                         [1.0, 0.22313016014842982, 0.0]], dtype=torch.float64)
    submission.expect_close(out, want, dtype=torch.float64, tol=1e-9, name="tis_weights")


def test_weights_are_truncated_at_the_cap(submission):
    """Ratios e^1 and e^3 above a cap of 2 become 2; a ratio below it is kept."""
    trainer = torch.tensor([[0.0, 1.0, -0.5]], dtype=torch.float64)
    rollout = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    out = submission.call("tis_weights", trainer, rollout, torch.ones(1, 3, dtype=torch.float64), 2.0)
    want = torch.tensor([[2.0, 2.0, math.exp(-0.5)]], dtype=torch.float64)
    submission.expect_close(out, want, dtype=torch.float64, tol=1e-9, name="tis_weights with cap 2")


def test_loss_on_a_small_batch(submission):
    """The trainer's old log-probs are the current ones (ratio 1): the loss is -mean(w * A)."""
    adv = torch.tensor([1.5, -0.5], dtype=torch.float64)
    value, grad = submission.call("loss_and_grad", TRAINER, TRAINER.clone(), ROLLOUT, adv, MASK, 2.0, 0.2)
    # -(1.5 * (w00 + w01 + w02) - 0.5 * (w10 + w11)) / 5 with the weights of the test above
    submission.expect_close(value, torch.tensor(-0.9394701881153079, dtype=torch.float64), dtype=torch.float64,
                            tol=1e-9, name="loss")
    assert grad.shape == TRAINER.shape and grad[1, 2] == 0, "the padded token must get no gradient"
