"""Public tests of serve-admission: what check() runs in the notebook.

Each case is small enough to work out by hand from the rules in the notebook; the comment
above each expected value says how. The hidden tests hold a reference and random pools.
"""


def expect_step(submission, args, want, what):
    got = submission.call("schedule_step", *args)
    assert isinstance(got, (list, tuple)) and len(got) == 3, \
        f"schedule_step must return (decodes, preempted, admitted), got {got!r}"
    got = tuple(list(part) for part in got)
    assert got == want, f"{what}: expected (decodes, preempted, admitted) = {want}, got {got}"


def test_roomy_pool_decodes_all_and_admits_in_order(submission):
    """No block is full and the pool has room: everyone decodes, every waiting request joins."""
    # 5, 9 and 2 tokens in blocks of 4: none at a block boundary; the prompts of 3, 6 and 2
    # tokens take 1 + 2 + 1 of the 10 free blocks and 11 of the 61 tokens left after 3 decodes
    expect_step(submission, ([5, 9, 2], [3, 6, 2], 10, 4, 8, 64), ([0, 1, 2], [], [0, 1, 2]), "roomy pool")


def test_full_blocks_take_new_blocks(submission):
    """Sequences at a block boundary take a free block each; the last free block goes to decodes."""
    # 4 and 8 tokens fill their blocks: each takes one of the 2 free blocks; 6 has room;
    # the waiting prompt of 1 token needs a block and none is left
    expect_step(submission, ([4, 8, 6], [1], 2, 4, 8, 64), ([0, 1, 2], [], []), "two full blocks, two free")


def test_preempts_newest_and_admits_nobody(submission):
    """No free block: the newest running sequences are preempted, newest first; nobody is admitted."""
    # seq 0 (8 tokens) needs a block: preempt seq 2 (3 tokens, 1 block), take it. seq 1 (4 tokens)
    # needs a block: the newest left is seq 1 itself, preempted (1 block back). Nobody joins.
    expect_step(submission, ([8, 4, 3], [5], 0, 4, 8, 64), ([0], [2, 1], []), "an empty pool")


def test_first_come_first_served(submission):
    """A waiting request that does not fit blocks the ones behind it, even if they would fit."""
    # seq 0 (1 token) decodes in its own block; the first prompt (9 tokens) needs 3 blocks, 2 are
    # free: it waits, and so do the two behind it
    expect_step(submission, ([1], [9, 2, 2], 2, 4, 8, 64), ([0], [], []), "a large request first in line")


def test_step_budgets(submission):
    """max_num_seqs caps running + admitted; max_num_batched_tokens counts decodes and prompts."""
    # 2 decodes leave 6 of 8 tokens: prompts of 3 and 3 join, and 2 running + 2 admitted = max_num_seqs 4
    expect_step(submission, ([1, 1], [3, 3, 3], 10, 4, 4, 8), ([0, 1], [], [0, 1]), "4 sequences at most")
    # 2 decodes leave 5 of 7 tokens: one prompt of 3 joins, 2 left are too few for the next
    expect_step(submission, ([1, 1], [3, 3, 3], 10, 4, 8, 7), ([0, 1], [], [0]), "7 tokens per step")
