"""Hidden tests of sft-packing: fresh random documents against a reference written here."""

import torch

from labkit.grade.harness import public_module

expect_equal = public_module(__file__, "test_sft_packing.py").expect_equal


def reference(ids, masks, seq_len, pad_id):
    order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
    bins, room = [], []
    for i in order:
        b = next((b for b in range(len(bins)) if room[b] >= len(ids[i])), None)
        if b is None:
            bins.append([])
            room.append(seq_len)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= len(ids[i])
    rows = []
    number = 0
    for members in bins:
        tok, mask, pos, doc = [], [], [], []
        for i in members:
            tok += ids[i].tolist()
            mask += [False] + [m == 1 for m in masks[i].tolist()[1:]]
            pos += list(range(len(ids[i])))
            doc += [number] * len(ids[i])
            number += 1
        if len(tok) < seq_len:
            rest = seq_len - len(tok)
            tok, mask, pos, doc = tok + [pad_id] * rest, mask + [False] * rest, pos + list(range(rest)), doc + [number] * rest
            number += 1
        rows.append((tok, mask, pos, doc))
    return (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=torch.bool),
            torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]))


def random_documents(n, seq_len, seed, all_targets=False):
    gen = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n):
        length = int(torch.randint(2, seq_len + 1, (1,), generator=gen))
        ids.append(torch.randint(1, 500, (length,), generator=gen))
        if all_targets:
            masks.append(torch.ones(length, dtype=torch.int64))
        else:
            prompt = int(torch.randint(1, length, (1,), generator=gen))
            masks.append((torch.arange(length) >= prompt).long())
    return ids, masks


NAMES = ("tokens", "loss_mask", "position_ids", "document_ids")


def test_packing_matches_the_reference(submission):
    """23 random documents of 2..37 tokens into rows of 37: all four outputs, exactly."""
    ids, masks = random_documents(23, 37, seed=1)
    out = submission.call("pack_documents", ids, masks, 37, 0)
    for got, want, name in zip(out, reference(ids, masks, 37, 0), NAMES):
        expect_equal(got, want, name)


def test_first_token_is_never_a_target(submission):
    """Pretraining-style documents (every token a target): only each document's first token is dropped."""
    ids, masks = random_documents(11, 29, seed=2, all_targets=True)
    _, loss_mask, position_ids, _ = submission.call("pack_documents", ids, masks, 29, 0)
    expect_equal(loss_mask, reference(ids, masks, 29, 0)[1], "loss_mask")
    real = loss_mask | (position_ids > 0)
    assert not (loss_mask & (position_ids == 0)).any(), "a document's first token is marked as a target"
    assert real.any()


def test_padding_is_a_document_of_its_own(submission):
    """A row's padding gets a new document number, positions from 0, no targets."""
    ids = [torch.arange(1, 6), torch.arange(1, 4)]
    masks = [torch.ones(5, dtype=torch.int64), torch.ones(3, dtype=torch.int64)]
    tokens, loss_mask, position_ids, document_ids = submission.call("pack_documents", ids, masks, 11, 99)
    expect_equal(document_ids, torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]]), "document_ids")
    expect_equal(position_ids, torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2]]), "position_ids")
    assert not loss_mask[0, 8:].any(), "padding must never be a target"


def test_block_mask_on_a_packed_batch(submission):
    """The mask of a random packed row: causal inside each document, zero across."""
    ids, masks = random_documents(9, 31, seed=3)
    # The row with the most documents: a row that one document fills exactly has a plain
    # causal mask, which the stub returns; with salted seeds that happens about one grading in four.
    documents = max(reference(ids, masks, 31, 0)[3], key=lambda row: row.unique().numel())
    assert documents.unique().numel() >= 2
    mask = submission.call("block_diagonal_mask", documents)
    n = documents.numel()
    want = torch.tensor([[j <= i and documents[i] == documents[j] for j in range(n)] for i in range(n)])
    expect_equal(mask, want, "block_diagonal_mask")
