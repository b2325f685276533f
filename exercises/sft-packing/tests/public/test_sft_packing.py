"""Public tests of sft-packing: what check() runs in the notebook.

They compare with values stored here for fixed inputs, worked out by hand from the rules
in the notebook (first-fit decreasing, then each row left to right); the hidden tests have
their own reference, on fresh random documents.
"""

import torch

# Three documents: prompt tokens (mask false) then answer tokens (mask true).
DOCS = [torch.tensor([5, 6, 7, 8]), torch.tensor([1, 2, 3]), torch.tensor([9, 9, 9, 9, 9])]
MASKS = [torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1]), torch.tensor([0, 0, 0, 1, 1])]
# Rows of 8: longest first, document 2 (5 tokens) opens row 0, document 0 (4) does not fit
# beside it and opens row 1, document 1 (3) fills row 0. Row 1 ends with 4 padding tokens.


def expect_equal(got, want, name):
    assert isinstance(got, torch.Tensor), f"{name}: expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, f"{name}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}"
    assert got.dtype == want.dtype, f"{name}: expected dtype {want.dtype}, got {got.dtype}"
    assert torch.equal(got, want), f"{name}: expected\n{want.int().tolist()}\ngot\n{got.int().tolist()}"


def packed(submission):
    out = submission.call("pack_documents", DOCS, MASKS, 8, 0)
    assert isinstance(out, (tuple, list)) and len(out) == 4, \
        "pack_documents must return (tokens, loss_mask, position_ids, document_ids)"
    return out


def test_first_fit_decreasing_on_fixed_lengths(submission):
    """Lengths [3, 7, 2, 5, 4] into bins of 10: longest first, each into the first bin with room."""
    bins = submission.call("first_fit_decreasing", [3, 7, 2, 5, 4], 10)
    # 7 opens bin 0 (room 3), 5 opens bin 1 (room 5), 4 joins bin 1, 3 joins bin 0, 2 opens bin 2
    assert [list(b) for b in bins] == [[1, 0], [3, 4], [2]], f"expected [[1, 0], [3, 4], [2]], got {bins}"


def test_prompt_tokens_never_train(submission):
    """The loss mask keeps each document's own mask: prompt tokens and padding are not targets."""
    tokens, loss_mask, _, _ = packed(submission)
    expect_equal(tokens, torch.tensor([[9, 9, 9, 9, 9, 1, 2, 3], [5, 6, 7, 8, 0, 0, 0, 0]]), "tokens")
    want = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    expect_equal(loss_mask, want, "loss_mask")


def test_positions_restart_in_every_document(submission):
    """Position ids count from 0 in each document (and in a row's padding)."""
    _, _, position_ids, _ = packed(submission)
    expect_equal(position_ids, torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]), "position_ids")


def test_block_mask_on_fixed_documents(submission):
    """Documents [0, 0, 1, 1, 1, 2]: causal within each, nothing across."""
    mask = submission.call("block_diagonal_mask", torch.tensor([0, 0, 1, 1, 1, 2]))
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    expect_equal(mask, want, "block_diagonal_mask")
