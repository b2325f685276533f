"""Hidden tests of serve-block-manager: running out of blocks, requests larger than the pool,
double frees, and property tests over random operation sequences."""

import torch

from labkit.grade.harness import public_module

pub = public_module(__file__, "test_block_manager.py")


def random_operations(count, seed, *, max_tokens, fork_weight=1):
    """``count`` operations on fresh sequence ids, drawn with torch's generator (the grader salts
    its seed); operations on sequences that failed to allocate or were freed come out as
    KeyError outcomes, which check_trace expects as failures that change nothing."""
    gen = torch.Generator().manual_seed(seed)
    ops, live, next_id = [], [], 0

    def draw(n):
        return int(torch.randint(0, n, (1,), generator=gen))

    for _ in range(count):
        kind = draw(4 + fork_weight)
        if kind == 0 or not live:
            ops.append(["allocate", next_id, 1 + draw(max_tokens)])
            live.append(next_id)
            next_id += 1
        elif kind == 1:
            ops.append(["free", live.pop(draw(len(live)))])
        elif kind >= 4:
            ops.append(["fork", live[draw(len(live))], next_id])
            live.append(next_id)
            next_id += 1
        else:
            ops.append(["append", live[draw(len(live))]])
    return ops


def check_random(submission, num_blocks, block_size, ops):
    trace = submission.call("replay", num_blocks, block_size, ops)
    # Operations on sequences that do not exist (their allocation failed) report KeyError and
    # change nothing: drop them from both lists before checking the rules.
    kept = [(op, report) for op, report in zip(ops, trace) if report[0] != "KeyError"]
    assert kept, "no operation ran"
    pub.check_trace(num_blocks, block_size, [op for op, _ in kept], [report for _, report in kept])
    return trace


def test_no_free_blocks_leaves_everything_unchanged(submission):
    """A pool of 5 blocks: an allocation of 3 blocks with 2 free fails whole, and an append
    that needs a block with none free fails and changes nothing; freeing makes room again."""
    pub.run(submission, 5, 4, [["allocate", 0, 12], ["allocate", 1, 9], ["allocate", 2, 4], ["append", 0],
                               ["free", 2], ["append", 0], ["allocate", 3, 1]])


def test_request_larger_than_the_pool_is_a_value_error(submission):
    """33 tokens in blocks of 4 need 9 blocks, more than the 8 the pool has: ValueError, not NoFreeBlocks."""
    pub.run(submission, 8, 4, [["allocate", 0, 33], ["allocate", 1, 32]])


def test_double_free_is_an_error(submission):
    """Releasing a block that is already free is a ValueError and changes nothing."""
    trace = pub.run(submission, 4, 4, [["allocate", 0, 4]])
    block = trace[0][0][0]
    pub.run(submission, 4, 4, [["allocate", 0, 4], ["free", 0], ["release", block]])


def test_copy_on_write_when_no_block_is_free(submission):
    """The shared partial block must be copied but the pool is empty: NoFreeBlocks, nothing changed."""
    pub.run(submission, 2, 4, [["allocate", 0, 6], ["fork", 0, 1], ["append", 1], ["free", 0], ["append", 1]])


def test_full_shared_blocks_stay_shared(submission):
    """A fork at a block boundary: each child's next token takes a fresh block, and the full
    blocks stay shared (no copies)."""
    trace = pub.run(submission, 8, 4, [["allocate", 0, 8], ["fork", 0, 1], ["append", 0], ["append", 1]])
    assert trace[-1][0] is None and trace[-2][0] is None, "appending after a full block never copies"


def test_random_operations_keep_the_invariants(submission):
    """400 random allocations, appends, forks and frees in a pool of 40 blocks of 4."""
    check_random(submission, 40, 4, random_operations(400, seed=1, max_tokens=30))


def test_random_forks_and_frees_never_leak(submission):
    """Fork-heavy random sequences in a small pool (it runs out often), then every table is
    freed: every block must be free again."""
    for seed in (2, 3):
        ops = random_operations(300, seed=seed, max_tokens=12, fork_weight=3)
        ids = {op[1] for op in ops if op[0] == "allocate"} | {op[2] for op in ops if op[0] == "fork"}
        freed = {op[1] for op in ops if op[0] == "free"}
        ops += [["free", s] for s in sorted(ids - freed)]
        trace = check_random(submission, 16, 3, ops)
        assert trace[-1][3] == 16, f"after freeing every table, {trace[-1][3]} of 16 blocks are free"


def test_block_size_one(submission):
    """Blocks of one token (SGLang's default page size): every append takes a block or copies none."""
    check_random(submission, 30, 1, random_operations(200, seed=4, max_tokens=5))
