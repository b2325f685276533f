"""labkit.models.train: the shared next-token loop learns, masks targets, and rejects bad batches."""

import pytest
import torch

from labkit import models


def copy_batch(generator: torch.Generator, batch: int = 16, half: int = 6):
    """``x SEP x``: the second half is predictable only by copying the first."""
    first = torch.randint(2, models.TINY.vocab_size, (batch, half), generator=generator)
    sep = torch.ones(batch, 1, dtype=torch.int64)
    ids = torch.cat([first, sep, first], dim=1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, half + 1:] = True
    return ids, mask


def test_train_lm_learns_a_copy_task():
    gen = torch.Generator().manual_seed(0)
    model = models.Decoder(models.TINY, seed=1)
    held_out = copy_batch(torch.Generator().manual_seed(99), batch=64)
    before = models.lm_loss(model, *held_out).item()
    losses = models.train_lm(model, lambda step: copy_batch(gen), steps=300, lr=1e-2, progress=False)
    after = models.lm_loss(model, *held_out).item()
    assert len(losses) == 300
    # Chance is ln(251) ~ 5.5 nats. Over seeds 0-3 and 1-2 threads the held-out loss ends
    # at 0.0-1.3 nats (a quarter of chance at worst), so half of chance is a wide margin.
    assert before > 5.0 and after < 0.5 * before, (before, after)


def test_lm_loss_counts_only_masked_targets():
    model = models.Decoder(models.TINY)
    ids = torch.randint(0, models.TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, -1] = True
    logits = model(ids[:, :-1])[:, -1].float()
    expected = torch.nn.functional.cross_entropy(logits, ids[:, -1])
    torch.testing.assert_close(models.lm_loss(model, ids, mask), expected)


@pytest.mark.parametrize("batch, match", [
    (torch.zeros(2, 5), "int ids"),
    (torch.zeros(2, 1, dtype=torch.int64), "T >= 2"),
    ((torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 4, dtype=torch.bool)), "loss_mask"),
    ((torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.bool)), "no target"),
])
def test_bad_batches_are_refused(batch, match):
    model = models.Decoder(models.TINY)
    with pytest.raises((TypeError, ValueError), match=match):
        models.train_lm(model, lambda step: batch, steps=1, lr=1e-3, progress=False)


def test_stdlib_corpus_splits_by_file_and_windows_are_bytes():
    train, held_out = models.stdlib_corpus()
    # Every tenth file is held out; files differ in size, so the byte ratio is only roughly 9:1.
    assert train.dtype == torch.uint8 and held_out.numel() > 0 and train.numel() > 4 * held_out.numel()
    train_files, held_files = models.text.split_files()
    assert not set(train_files) & set(held_files) and len(held_files) == -(-len(models.text.stdlib_files()) // 10)
    ids = models.random_windows(train, 4, 33, torch.Generator().manual_seed(0))
    assert ids.shape == (4, 33) and ids.dtype == torch.int64 and int(ids.max()) < 256
    # Each window is a real stretch of the text: its bytes appear in that order in the corpus.
    assert bytes(ids[0].tolist()) in bytes(train.tolist())


def test_random_windows_refuses_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        models.random_windows(torch.zeros(100), 2, 8, torch.Generator())
    with pytest.raises(ValueError, match="more than"):
        models.random_windows(torch.zeros(8, dtype=torch.uint8), 2, 8, torch.Generator())
