"""Hidden tests of serve-admission: a reference on random pools, self-preemption, the order of
victims, admission after a preemption, and the block accounting of every decision."""

import random

from labkit.grade.harness import public_module

expect_step = public_module(__file__, "test_admission.py").expect_step


def reference_step(running, waiting, free_blocks, block_size, max_num_seqs, max_num_batched_tokens):
    """The rules of the notebook, written from them directly."""
    blocks = lambda tokens: (tokens + block_size - 1) // block_size  # noqa: E731
    live = [True] * len(running)
    decodes, preempted, tokens_left, newest = [], [], max_num_batched_tokens, len(running) - 1
    for i, stored in enumerate(running):
        if not live[i]:
            continue
        if stored % block_size == 0:
            while free_blocks == 0 and live[i]:
                while not live[newest]:
                    newest -= 1
                live[newest] = False
                preempted.append(newest)
                free_blocks += blocks(running[newest])
            if not live[i]:
                continue
            free_blocks -= 1
        decodes.append(i)
        tokens_left -= 1
    admitted = []
    if preempted:
        return decodes, preempted, admitted
    for k, prompt in enumerate(waiting):
        fits = (sum(live) + len(admitted) < max_num_seqs and prompt <= tokens_left and blocks(prompt) <= free_blocks)
        if not fits:
            break
        admitted.append(k)
        tokens_left -= prompt
        free_blocks -= blocks(prompt)
    return decodes, preempted, admitted


def random_case(rng):
    block_size = rng.randint(1, 6)
    running = [rng.choice([rng.randint(1, 40), block_size * rng.randint(1, 8)]) for _ in range(rng.randint(0, 8))]
    waiting = [rng.randint(1, 30) for _ in range(rng.randint(0, 6))]
    return (running, waiting, rng.randint(0, 12), block_size, rng.randint(1, 12), rng.randint(1, 80))


def test_random_pools_match_the_rules(submission):
    """Three hundred random pools, block sizes, queues and budgets: every decision as the rules say."""
    rng = random.Random(2026)
    for case in range(300):
        args = random_case(rng)
        expect_step(submission, args, reference_step(*args), f"random case {case} {args}")


def test_a_lone_sequence_preempts_itself(submission):
    """The only running sequence needs a block and none is free: it is its own victim."""
    expect_step(submission, ([4], [1], 0, 4, 8, 64), ([], [0], []), "one full sequence, no free block")


def test_preemption_order_newest_first(submission):
    """Four full sequences, no free block: the two newest go, newest first, so the two oldest decode."""
    expect_step(submission, ([4, 4, 4, 4], [], 0, 4, 8, 64), ([0, 1], [3, 2], []), "four full sequences")


def test_no_admission_after_preemption(submission):
    """A step that preempted admits nobody, even where the freed blocks would hold a waiting prompt."""
    # seq 0 needs a block: seq 1 (7 tokens, 2 blocks) is preempted; 1 block is left, the prompt needs 1
    expect_step(submission, ([4, 7], [2], 0, 4, 8, 64), ([0], [1], []), "room left after a preemption")


def test_blocks_are_never_overdrawn(submission):
    """On random pools, the blocks given out never exceed the free ones plus those preemption frees,
    and every running sequence either decodes or is preempted."""
    rng = random.Random(7)
    for case in range(200):
        running, waiting, free, block_size, max_seqs, budget = args = random_case(rng)
        decodes, preempted, admitted = submission.call("schedule_step", *args)
        blocks = lambda tokens: (tokens + block_size - 1) // block_size  # noqa: E731
        given = sum(1 for i in decodes if running[i] % block_size == 0) + sum(blocks(waiting[k]) for k in admitted)
        freed = sum(blocks(running[i]) for i in preempted)
        assert given <= free + freed, f"case {args}: {given} blocks given out, only {free} free + {freed} freed"
        assert sorted([*decodes, *preempted]) == list(range(len(running))), \
            f"case {args}: every running sequence either decodes or is preempted, got {decodes} and {preempted}"
