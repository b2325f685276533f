"""Hidden tests of serve-pack-step: fresh random steps against a reference written here."""

import random

import torch

from labkit.grade.harness import public_module

expect_step = public_module(__file__, "test_pack_step.py").expect_step


def reference(tokens, num_cached, num_new, block_tables, block_size, pad_block) -> dict:
    """The packed step, one token at a time: the rules of the notebook, written out plainly."""
    want = {k: [] for k in ("input_ids", "positions", "slot_mapping", "lengths", "logits_indices")}
    cu = [0]
    width = max(len(t) for t in block_tables)
    for seq, start, new, table in zip(tokens, num_cached, num_new, block_tables):
        for position in range(start, start + new):
            want["input_ids"].append(seq[position])
            want["positions"].append(position)
            want["slot_mapping"].append(table[position // block_size] * block_size + position % block_size)
        cu.append(cu[-1] + new)
        want["lengths"].append(start + new)
        want["logits_indices"].append(cu[-1] - 1)
    want["cu_seqlens_q"] = cu
    want["block_tables"] = [t + [pad_block] * (width - len(t)) for t in block_tables]
    return want


def random_step(rng: random.Random, num_seqs: int, block_size: int, num_blocks: int):
    """A step of ``num_seqs`` sequences whose blocks are scattered over a pool of ``num_blocks``."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tokens, cached, new, tables = [], [], [], []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "prefill", "chunk"])
        length = rng.randint(1, 5 * block_size)
        start = {"decode": length - 1, "prefill": 0, "chunk": rng.randint(0, length - 1)}[kind]
        tokens.append([rng.randrange(1000) for _ in range(length)])
        cached.append(start)
        new.append(length - start)
        tables.append([free.pop() for _ in range(-(-length // block_size))])
    return tokens, cached, new, tables, block_size, num_blocks  # the pad block: one past the pool


def test_random_mixed_steps(submission):
    """Ten random steps of decodes, prefills and chunks over scattered blocks, odd block sizes."""
    rng = random.Random(torch.randint(0, 2**31, (1,), generator=torch.Generator().manual_seed(5)).item())
    for _ in range(10):
        args = random_step(rng, rng.randint(1, 7), rng.choice([1, 3, 4, 5, 16]), 200)
        expect_step(submission, args, reference(*args), f"random step {args[1:4]}")


def test_chunk_starting_mid_block(submission):
    """A chunk whose first token is at offset 1 of its block and whose last spills into the next."""
    args = ([list(range(100, 111))], [5], [6], [[7, 2, 9]], 4, 12)
    expect_step(submission, args, reference(*args), "chunk from position 5")


def test_block_size_one(submission):
    """Blocks of one token: every position is its own block."""
    args = ([[1, 2, 3], [4, 5]], [0, 1], [3, 1], [[8, 6, 4], [0, 3]], 1, 9)
    expect_step(submission, args, reference(*args), "block size 1")


def test_many_decodes(submission):
    """64 decodes at different positions: the shape of a large decode step."""
    rng = random.Random(11)
    tokens = [[rng.randrange(50) for _ in range(rng.randint(1, 40))] for _ in range(64)]
    blocks = list(range(64 * 3))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-len(t) // 16))] for t in tokens]
    args = (tokens, [len(t) - 1 for t in tokens], [1] * 64, tables, 16, 500)
    expect_step(submission, args, reference(*args), "64 decodes")
