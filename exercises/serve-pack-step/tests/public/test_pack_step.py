"""Public tests of serve-pack-step: what check() runs in the notebook.

They compare with values stored here for fixed steps, worked out by hand from the rules
of the notebook (position = index in the sequence; slot = block * block_size + offset),
never with a function that computes them: that function would be the solution. The
hidden tests have their own reference, on fresh random steps.
"""

import torch

FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q", "lengths", "logits_indices")
DTYPES = (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32, torch.int32, torch.int64)


def expect_step(submission, args, want: dict, what: str) -> None:
    """Call pack_step(*args) and compare each of the seven tensors with ``want``'s lists."""
    out = submission.call("pack_step", *args)
    assert isinstance(out, (tuple, list)) and len(out) == len(FIELDS), \
        f"pack_step must return the {len(FIELDS)} tensors {FIELDS}, got {type(out).__name__} of {len(out)}"
    for name, dtype, got in zip(FIELDS, DTYPES, out):
        expected = torch.tensor(want[name], dtype=dtype)
        assert isinstance(got, torch.Tensor), f"{what}: {name} must be a tensor, got {type(got).__name__}"
        assert got.dtype == dtype, f"{what}: {name} must be {dtype}, got {got.dtype}"
        assert got.shape == expected.shape and torch.equal(got, expected), \
            f"{what}: {name} should be {expected.tolist()}, got {got.tolist()}"


def test_one_decode(submission):
    """One sequence of 5 tokens, 4 cached: its fifth token at position 4, in block 1's first slot."""
    args = ([[5, 6, 7, 8, 9]], [4], [1], [[3, 1]], 4, 9)
    # position 4 -> block table[4 // 4] = 1, offset 0 -> slot 1 * 4 + 0 = 4
    want = dict(input_ids=[9], positions=[4], slot_mapping=[4], block_tables=[[3, 1]], cu_seqlens_q=[0, 1],
                lengths=[5], logits_indices=[0])
    expect_step(submission, args, want, "one decode")


def test_fresh_prefill(submission):
    """A 6-token prompt with nothing cached, in blocks 2 and 0 of size 4."""
    args = ([[11, 12, 13, 14, 15, 16]], [0], [6], [[2, 0]], 4, 7)
    # positions 0..3 in block 2 (slots 8..11), 4..5 in block 0 (slots 0, 1); its last token is index 5
    want = dict(input_ids=[11, 12, 13, 14, 15, 16], positions=[0, 1, 2, 3, 4, 5], slot_mapping=[8, 9, 10, 11, 0, 1],
                block_tables=[[2, 0]], cu_seqlens_q=[0, 6], lengths=[6], logits_indices=[5])
    expect_step(submission, args, want, "fresh prefill")


def test_mixed_step(submission):
    """The chapter's step: a decode at position 7, a chunk of 3 after 3 cached, a fresh 2-token prompt."""
    tokens = [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25], [30, 31]]
    args = (tokens, [7, 3, 0], [1, 3, 2], [[2, 3], [4, 5], [6]], 4, 24)
    # decode: position 7 -> block 3, offset 3 -> slot 15; chunk: positions 3, 4, 5 -> slots 19 (block 4),
    # 20, 21 (block 5); prefill: positions 0, 1 -> slots 24, 25 (block 6); the prefill's table is padded with 24
    want = dict(input_ids=[17, 23, 24, 25, 30, 31], positions=[7, 3, 4, 5, 0, 1],
                slot_mapping=[15, 19, 20, 21, 24, 25], block_tables=[[2, 3], [4, 5], [6, 24]],
                cu_seqlens_q=[0, 1, 4, 6], lengths=[8, 6, 2], logits_indices=[0, 3, 5])
    expect_step(submission, args, want, "mixed step")


def test_tables_are_padded_with_the_pad_block(submission):
    """Block tables of 1, 3 and 2 blocks become one [3, 3] tensor padded with pad_block (never 0)."""
    tokens = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16]]
    args = (tokens, [1, 8, 4], [1, 1, 1], [[0], [5, 1, 2], [4, 3]], 4, 6)
    # decodes at positions 1 (block 0), 8 (block 2), 4 (block 3): slots 1, 8, 12
    want = dict(input_ids=[2, 11, 16], positions=[1, 8, 4], slot_mapping=[1, 8, 12],
                block_tables=[[0, 6, 6], [5, 1, 2], [4, 3, 6]], cu_seqlens_q=[0, 1, 2, 3], lengths=[2, 9, 5],
                logits_indices=[0, 1, 2])
    expect_step(submission, args, want, "padding")
