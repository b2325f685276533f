"""Hidden tests of spec-tree-mask: random trees, a lone root, deep and wide trees, against a brute force."""

import random

import torch

from labkit.grade.harness import public_module

public = public_module(__file__, "test_spec_tree_mask.py")


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def reference(parents: list[int], prefix_len: int) -> tuple[list[list[int]], list[int]]:
    """Walk up from every node: its row sees the prefix, itself and each ancestor; its depth counts the steps."""
    n = len(parents)
    rows, positions = [], []
    for i in range(n):
        row = [1] * prefix_len + [0] * n
        node, depth = i, 0
        row[prefix_len + node] = 1
        while parents[node] >= 0:
            node = parents[node]
            depth += 1
            row[prefix_len + node] = 1
        rows.append(row)
        positions.append(prefix_len + depth)
    return rows, positions


def check_tree(submission, parents, prefix_len, what, mask_only=False, positions_only=False):
    mask, positions = public.call(submission, parents, prefix_len)
    rows, want = reference(parents, prefix_len)
    if not positions_only:
        public.expect_mask(mask, rows, f"{what} (parents {parents}, prefix {prefix_len})")
    if not mask_only:
        public.expect_positions(positions, want, f"{what} (parents {parents}, prefix {prefix_len})")


def seed_rng() -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=torch.Generator().manual_seed(17))))


def test_random_trees_mask(submission):
    """Twenty random trees of 2..24 nodes after random prefixes: every row of the mask."""
    rng = seed_rng()
    for _ in range(20):
        check_tree(submission, random_parents(rng.randrange(2, 25), rng), rng.randrange(0, 9), "random tree",
                   mask_only=True)


def test_random_trees_positions(submission):
    """The same kind of trees: every node's position."""
    rng = seed_rng()
    for _ in range(20):
        check_tree(submission, random_parents(rng.randrange(2, 25), rng), rng.randrange(0, 9), "random tree",
                   positions_only=True)


def test_root_alone(submission):
    """A tree of one node: the root sees the prefix and itself, at position prefix_len."""
    check_tree(submission, [-1], 5, "the root alone")


def test_deep_and_wide_trees(submission):
    """A star (every node a child of the root) and a long chain with side branches."""
    check_tree(submission, [-1] + [0] * 15, 2, "a star")
    parents = [-1]
    for i in range(1, 30):
        parents.append(i - 2 if i % 3 == 0 and i >= 2 else i - 1)
    check_tree(submission, parents, 1, "a chain with branches")


def test_prefix_is_visible_to_every_node(submission):
    """Every node sees every committed prefix key."""
    mask, _ = public.call(submission, [-1, 0, 1, 1, 0], 6)
    assert isinstance(mask, torch.Tensor) and mask.shape == (5, 11), "mask must be [5, 11]"
    assert bool(mask[:, :6].all()), f"the first 6 columns (the prefix) must be all true, got\n{mask[:, :6].int()}"
