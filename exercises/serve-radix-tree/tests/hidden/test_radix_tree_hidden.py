"""Hidden tests of serve-radix-tree: other block sizes, eviction beyond what is cached, and long
random sequences of operations against a reference model of the cache."""

import torch

from labkit.grade.harness import public_module

pub = public_module(__file__, "test_radix_tree.py")


def reference_replay(block_size, operations):
    """The rules as plainly as they can be said: the cache is a dict from a prefix (every token up
    to the end of a block) to its block id and the tick it was last used. No tree at all."""
    cache, trace, clock = {}, [], 0

    def prefixes(tokens, num_blocks):
        return [tuple(tokens[:(i + 1) * block_size]) for i in range(num_blocks)]

    for op in operations:
        if op[0] == "match":
            clock += 1
            found = []
            for p in prefixes(op[1], (len(op[1]) - 1) // block_size):
                if p not in cache:
                    break
                cache[p][1] = clock
                found.append(cache[p][0])
            outcome = found
        elif op[0] == "insert":
            clock += 1
            outcome = 0
            for p, block in zip(prefixes(op[1], len(op[1]) // block_size), op[2]):
                if p not in cache:
                    cache[p] = [block, clock]
                    outcome += 1
                cache[p][1] = clock
        else:
            outcome = []
            while len(outcome) < op[1]:
                parents = {p[:-block_size] for p in cache}
                leaves = [p for p in cache if p not in parents and cache[p][0] not in op[2]]
                if not leaves:
                    break
                victim = min(leaves, key=lambda p: (cache[p][1], -len(p), cache[p][0]))
                outcome.append(cache.pop(victim)[0])
        trace.append([outcome, sorted(b for b, _ in cache.values())])
    return trace


def random_operations(count, seed, block_size):
    """Prompts that share prefixes (a few system prompts, then turns), matches of them and of their
    extensions, and evictions with the blocks of a random live prompt's match pinned."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n):
        return int(torch.randint(0, n, (1,), generator=gen))

    systems = [[draw(3) for _ in range(block_size * (1 + draw(3)))] for _ in range(2)]
    prompts, ops, next_block = [], [], 100
    for _ in range(count):
        kind = draw(5)
        if kind <= 1 or not prompts:
            base = systems[draw(2)] if not prompts or draw(2) else prompts[draw(len(prompts))]
            prompt = base + [draw(3) for _ in range(1 + draw(3 * block_size))]
            blocks = list(range(next_block, next_block + len(prompt) // block_size + 1))
            next_block += len(blocks)
            prompts.append(prompt)
            ops.append(["insert", prompt, blocks])
        elif kind <= 3:
            prompt = prompts[draw(len(prompts))]
            ops.append(["match", prompt[:1 + draw(len(prompt) + 2)] + [draw(3)] * draw(2)])
        else:
            # Half the time a running request holds what the latest match returned: those stay.
            matches = [i for i, op in enumerate(ops) if op[0] == "match"]
            pinned = reference_replay(block_size, ops[:matches[-1] + 1])[-1][0] if matches and draw(2) else []
            ops.append(["evict", 1 + draw(4), pinned])
    return ops


def check_against_reference(submission, block_size, ops):
    pub.run(submission, block_size, ops, reference_replay(block_size, ops))


def test_block_size_one_is_a_token_trie(submission):
    """Blocks of one token: every token is a block; matches, a branch and an eviction."""
    check_against_reference(submission, 1, [["insert", [5, 6, 7], [1, 2, 3]], ["insert", [5, 6, 8, 9], [1, 2, 4, 5]],
                                            ["match", [5, 6, 7, 0]], ["evict", 2, []], ["match", [5, 6, 8, 9, 1]]])


def test_evicting_more_than_is_cached_empties_the_tree(submission):
    """Asking for more blocks than are cached evicts them all (children before parents) and stops."""
    check_against_reference(submission, 3, [["insert", list(range(10)), [1, 2, 3, 4]],
                                            ["insert", list(range(6)) + [0, 0, 0], [7, 8, 9]],
                                            ["evict", 50, []], ["match", list(range(10))],
                                            ["insert", list(range(7)), [11, 12, 13]]])


def test_random_operations_match_the_reference(submission):
    """Two hundred operations in blocks of 2: every outcome and the cached set after each."""
    check_against_reference(submission, 2, random_operations(200, seed=1, block_size=2))


def test_random_operations_in_larger_blocks(submission):
    """The same in blocks of 3 and of 4, other prompts."""
    check_against_reference(submission, 3, random_operations(150, seed=2, block_size=3))
    check_against_reference(submission, 4, random_operations(150, seed=3, block_size=4))
