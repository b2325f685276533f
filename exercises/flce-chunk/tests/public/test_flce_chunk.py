"""Public tests of flce-chunk: what check() runs in the notebook.

The expected values come from torch's own cross-entropy and autograd in float64; a
submission cannot paste them, since the exercise forbids softmax, log_softmax, exp and
nll_loss outside the kernel.
"""

import torch
import torch.nn.functional as F

from labkit import check


def problem(tokens, hidden, vocab, *, logit_scale=1.0, ignored=(), seed=0, dtype=torch.float32):
    """hidden [T, H], weight [V, H] (logits of order logit_scale), labels (ignored rows -100)."""
    h = check.randn(tokens, hidden, seed=seed, dtype=dtype)
    w = check.randn(vocab, hidden, seed=seed + 1, scale=logit_scale * hidden ** -0.5, dtype=dtype)
    t = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed + 2))
    t[list(ignored)] = -100
    return h, w, t


def expected(h, w, t, scale):
    """(loss of each row, d(scale * total)/d hidden, d(scale * total)/d weight), in float64."""
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    rows = F.cross_entropy(hd @ wd.T, t, reduction="none", ignore_index=-100)
    grads = torch.autograd.grad(scale * rows.sum(), (hd, wd))
    return (rows.detach(), *grads)


def expect_chunk(submission, h, w, t, scale, block, name, parts=("loss", "grad_hidden", "grad_weight")):
    got = submission.call("flce_chunk", h, w, t, scale, block)
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        raise AssertionError(f"{name}: flce_chunk must return (loss_rows, grad_hidden, grad_weight), got {type(got).__name__}")
    want = expected(h, w, t, scale)
    # The loss is float32 whatever the inputs, but computed from logits rounded to h's dtype.
    dtypes = (torch.float32, h.dtype, h.dtype)
    for part, g, e, dt in zip(("loss", "grad_hidden", "grad_weight"), got, want, dtypes):
        if part in parts:
            submission.expect_close(g, e, dtype=dt, name=f"{name}: {part}", tol=check.tolerance(h.dtype))


def test_loss_of_each_row(submission):
    """7 tokens, vocabulary 300 in blocks of 128: three blocks a row, the last one ragged."""
    h, w, t = problem(7, 16, 300)
    expect_chunk(submission, h, w, t, 1 / 7, 128, "7 x 300, block 128", parts=("loss",))


def test_gradients_of_hidden_and_weight(submission):
    """The same chunk, scaled by 1/7 (a mean over 7 tokens): softmax minus one-hot, then two matmuls."""
    h, w, t = problem(7, 16, 300, seed=1)
    expect_chunk(submission, h, w, t, 1 / 7, 128, "7 x 300 gradients", parts=("grad_hidden", "grad_weight"))


def test_large_logits(submission):
    """Logits of magnitude ~60: exp overflows float32 without the running maximum."""
    h, w, t = problem(5, 16, 400, logit_scale=60.0, seed=2)
    expect_chunk(submission, h, w, t, 0.2, 64, "large logits")
