"""Public tests of grpo-loss: what check() runs in the notebook.

They compare with values stored here for fixed inputs, worked out once from the formulas of
the notebook, never with a function that computes them: a public reference would be the
solution, ready to paste. The hidden tests have their own reference, on fresh inputs.
"""

import torch


def test_advantages_are_per_group(submission):
    """Rewards of 2 prompts x 4 completions: each group centred and scaled on its own."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    out = submission.call("group_advantages", rewards, 4)
    # one reward of 1 in a group of 4: mean 1/4, std sqrt(3)/4, so (1 - 1/4) / (sqrt(3)/4 + 1e-4)
    # for the 1 and -(1/4) / (sqrt(3)/4 + 1e-4) for each 0; the second group is the mirror image
    high, low = 1.731650899923592, 0.5772169666411974
    want = torch.tensor([high, -low, -low, -low, low, low, -high, low], dtype=torch.float64)
    submission.expect_close(out, want, dtype=torch.float64, tol=1e-9, name="group_advantages([1,0,0,0, 1,1,0,1], 4)")


def test_loss_on_a_small_batch(submission):
    """Two completions of 3 tokens, the last one padding: the loss value, token-level normalised."""
    logp = torch.tensor([[-0.25, -1.5, -0.75], [-2.0, -0.5, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.5, -1.25, -0.75], [-1.5, -0.75, -1.25]], dtype=torch.float64)
    adv = torch.tensor([1.5, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    value, grad = submission.call("loss_and_grad", logp, ref, adv, mask)
    # on-policy (ratio 1): the mean over the 5 real tokens of -(A - 0.04 * (e^x - x - 1)), x = ref - logp
    submission.expect_close(value, torch.tensor(-0.6980772139717546, dtype=torch.float64), dtype=torch.float64,
                            tol=1e-9, name="loss")
    assert isinstance(grad, torch.Tensor) and grad.shape == logp.shape, \
        f"the gradient must have logp's shape {tuple(logp.shape)}, got {getattr(grad, 'shape', type(grad).__name__)}"
    assert grad[1, 2] == 0, f"the padded token's gradient must be 0, got {grad[1, 2].item()}"
