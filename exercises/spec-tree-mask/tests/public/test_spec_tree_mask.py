"""Public tests of spec-tree-mask: what check() runs in the notebook.

Small trees whose mask and positions are written out by hand (no function here computes
them: the hidden tests check random trees against a reference).
"""

import torch


def call(submission, parents, prefix_len):
    out = submission.call("tree_attention", torch.tensor(parents, dtype=torch.int64), prefix_len)
    assert isinstance(out, (tuple, list)) and len(out) == 2, "tree_attention must return (mask, positions)"
    return out


def expect_mask(mask, want, what):
    want = torch.tensor(want, dtype=torch.bool)
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == want.shape, \
        f"{what}: the mask must be a bool tensor of shape {tuple(want.shape)}, got " \
        f"{getattr(mask, 'dtype', type(mask))} {tuple(getattr(mask, 'shape', ()))}"
    bad = (mask != want).nonzero().tolist()
    assert not bad, f"{what}: mask wrong at (node, key) {bad[:6]}; expected rows\n{want.int()}\ngot\n{mask.int()}"


def expect_positions(positions, want, what):
    assert isinstance(positions, torch.Tensor) and positions.dtype == torch.int64, \
        f"{what}: positions must be an int64 tensor, got {getattr(positions, 'dtype', type(positions))}"
    assert positions.tolist() == want, f"{what}: expected positions {want}, got {positions.tolist()}"


def test_shapes_and_dtypes(submission):
    """A bool mask [n, prefix_len + n] and int64 positions [n]."""
    mask, positions = call(submission, [-1, 0, 0], 4)
    assert isinstance(mask, torch.Tensor) and mask.shape == (3, 7) and mask.dtype == torch.bool, \
        f"mask must be bool [3, 7], got {getattr(mask, 'dtype', None)} {tuple(getattr(mask, 'shape', ()))}"
    assert isinstance(positions, torch.Tensor) and positions.shape == (3,) and positions.dtype == torch.int64, \
        f"positions must be int64 [3], got {getattr(positions, 'dtype', None)} {tuple(getattr(positions, 'shape', ()))}"


def test_a_chain_is_causal(submission):
    """A chain (each node's parent is the node before) gives the ordinary causal mask."""
    mask, positions = call(submission, [-1, 0, 1, 2], 2)
    expect_mask(mask, [[1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 1, 0],
                       [1, 1, 1, 1, 1, 1]], "chain after 2 prefix tokens")
    expect_positions(positions, [2, 3, 4, 5], "chain after 2 prefix tokens")


# Root 0; children 1, 2; node 3 and 4 under 1; node 5 under 2.
SMALL = [-1, 0, 0, 1, 1, 2]


def test_small_tree_mask(submission):
    """Each node sees itself and its ancestors only (siblings and cousins are other continuations)."""
    mask, _ = call(submission, SMALL, 0)
    expect_mask(mask, [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [1, 0, 1, 0, 0, 0],
                       [1, 1, 0, 1, 0, 0],
                       [1, 1, 0, 0, 1, 0],
                       [1, 0, 1, 0, 0, 1]], "tree [-1, 0, 0, 1, 1, 2], no prefix")


def test_small_tree_positions(submission):
    """A node's position is the prefix length plus its depth: siblings share one."""
    _, positions = call(submission, SMALL, 3)
    expect_positions(positions, [3, 4, 4, 5, 5, 5], "tree [-1, 0, 0, 1, 1, 2] after 3 prefix tokens")
