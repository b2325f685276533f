"""Hidden tests of flce-chunk: ignored rows, vocabulary tails, chunks composing, bfloat16."""

import torch

from labkit.grade.harness import public_module

public = public_module(__file__, "test_flce_chunk.py")
problem, expected, expect_chunk = public.problem, public.expected, public.expect_chunk


def test_ignored_rows(submission):
    """Rows labelled -100 have loss 0 and no gradient; they must not read a label at -100."""
    h, w, t = problem(9, 16, 250, ignored=(0, 4, 8), seed=10)
    expect_chunk(submission, h, w, t, 1 / 6, 128, "3 of 9 rows ignored")


def test_vocabulary_tails(submission):
    """Vocabularies of 1 block exactly, less than one block, and one column past a block."""
    for seed, vocab in enumerate((128, 50, 257)):
        h, w, t = problem(4, 8, vocab, seed=20 + seed)
        expect_chunk(submission, h, w, t, 0.25, 128, f"vocabulary {vocab}, block 128")


def test_chunks_add_up_to_the_whole_loss(submission):
    """Two chunks of a 11-token batch, each scaled by 1/11: their losses and gradients add up
    to the whole batch's mean loss and its gradients (grad_hidden by rows, grad_weight summed)."""
    h, w, t = problem(11, 16, 300, seed=30)
    first = submission.call("flce_chunk", h[:6], w, t[:6], 1 / 11, 128)
    second = submission.call("flce_chunk", h[6:], w, t[6:], 1 / 11, 128)
    loss, grad_h, grad_w = expected(h, w, t, 1 / 11)
    submission.expect_close(torch.cat([first[0], second[0]]).sum().reshape(1) / 11, (loss.sum() / 11).reshape(1),
                            dtype=torch.float32, name="mean loss from two chunks")
    submission.expect_close(torch.cat([first[1], second[1]]), grad_h, dtype=torch.float32, name="grad_hidden from two chunks")
    submission.expect_close(first[2] + second[2], grad_w, dtype=torch.float32, name="grad_weight summed over chunks")


def test_bfloat16(submission):
    """bfloat16 inputs: the kernel computes in float32 and stores the gradient in bfloat16."""
    h, w, t = problem(6, 32, 300, seed=40, dtype=torch.bfloat16)
    expect_chunk(submission, h, w, t, 1 / 6, 128, "bfloat16")
