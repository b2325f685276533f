"""Public tests of moe-dispatch-combine: what check() runs in the notebook.

They compare with values stored here for small fixed inputs (worked out once, the short
ones by hand as the comments show), never with functions that compute them: a public
reference for plain-torch routing, dispatch and combine would be the solution, ready to
paste. The hidden tests hold the references and use fresh values.
"""

import torch

W_GATE_UP = [  # 3 experts, 2 * 3 intermediate features, 4 hidden: multiples of 1/4
    [[1.0, -1.0, -0.5, 0.5], [0.75, 0.5, 0.75, -0.75], [-0.75, -1.0, 1.0, -0.5],
     [0.5, -0.25, -0.75, -0.5], [-1.0, -1.0, 0.25, -0.25], [1.0, -0.5, 1.0, -0.5]],
    [[1.0, 0.25, 0.75, 1.0], [0.5, -1.0, -0.75, -1.0], [1.0, 0.5, -0.75, 0.5],
     [-0.75, 1.0, 1.0, 0.75], [-0.5, -0.25, 0.75, 0.75], [-0.75, 0.25, 0.0, 0.75]],
    [[0.25, 0.75, 0.0, -0.5], [0.25, 0.0, 1.0, 0.25], [0.25, 0.0, -0.5, -0.5],
     [0.0, 0.0, -1.0, 0.5], [0.0, 0.25, 0.0, 0.75], [1.0, 0.0, 1.0, -0.5]],
]
W_DOWN = [
    [[0.5, 0.75, -1.0], [0.25, -0.25, 0.0], [-0.75, 1.0, 0.25], [1.0, 0.25, 0.75]],
    [[-0.25, -0.5, -0.75], [0.75, 0.75, -0.5], [0.0, 0.0, -0.75], [-0.75, -0.75, 0.25]],
    [[0.75, 0.75, 1.0], [-0.75, 0.25, -0.25], [-0.75, -0.25, 1.0], [0.5, 0.5, 0.25]],
]


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def test_route_picks_and_renormalizes(submission):
    """route keeps the top-k softmax experts, with weights summing to one per token."""
    logits = f64([[2.0, 0.5, -1.0, 1.0], [0.0, 3.0, 1.0, -2.0], [1.5, 1.0, 0.25, 0.0]])
    ids, weights = submission.call("route", logits, 2)
    want_ids = [[0, 3], [1, 2], [0, 1]]
    assert isinstance(ids, torch.Tensor) and ids.tolist() == want_ids, \
        f"expert ids: expected {want_ids}, got {ids.tolist() if isinstance(ids, torch.Tensor) else ids}"
    # renormalised over the two kept, the softmax of logits a > b is e^a / (e^a + e^b) = 1 / (1 + e^(b - a))
    want = f64([[0.7310585786300049, 0.2689414213699951], [0.8807970779778824, 0.11920292202211756],
                [0.6224593312018546, 0.3775406687981454]])
    submission.expect_close(weights, want, dtype=torch.float64, name="weights")


def test_dispatch_sorts_by_expert(submission):
    """dispatch lists the slots expert by expert, earlier slots first, and counts them."""
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 3]])  # slot = 2 * token + choice
    slots, counts = submission.call("dispatch", ids, 4, None)
    want_slots, want_counts = [1, 2, 6, 3, 5, 0, 4, 7], [3, 2, 2, 1]
    assert slots.tolist() == want_slots, f"slot_of_row: expected {want_slots}, got {slots.tolist()}"
    assert counts.tolist() == want_counts, f"counts: expected {want_counts}, got {counts.tolist()}"


def test_combine_puts_rows_back(submission):
    """combine scatters each weighted row back to its token and sums the token's choices."""
    slots = torch.tensor([1, 2, 0, 5, 3, 4])  # row r holds slot slots[r] = 2 * token + choice
    rows = f64([[r + 1.0, -(r + 1.0)] for r in range(6)])
    weights = f64([[0.5, 0.25], [1.0, 2.0], [0.75, 0.5]])
    out = submission.call("combine", rows, slots, weights, 3)
    # token 0: 0.5 * row 2 + 0.25 * row 0; token 1: 1 * row 1 + 2 * row 4; token 2: 0.75 * row 5 + 0.5 * row 3
    submission.expect_close(out, f64([[1.75, -1.75], [12.0, -12.0], [6.5, -6.5]]), dtype=torch.float64, name="combine")


def test_layer_matches_reference(submission):
    """The whole layer (your three functions in the given moe_forward) on 3 tokens, 3 experts."""
    x = f64([[1.0, -0.5, 0.25, 2.0], [0.5, 1.5, -1.0, 0.0], [-2.0, 0.75, 1.0, -0.25]])
    router = f64([[0.5, -0.25, 0.0, 0.75], [-0.5, 0.5, 0.25, 0.0], [0.25, 0.25, -0.75, -0.5]])
    out = submission.call("moe_forward", x, router, f64(W_GATE_UP), f64(W_DOWN), 2, None)
    want = f64([[-0.3287117237872286, -0.3196568632301501, 1.0195958574074921, -1.2281757823776118],
                [0.2955371174049677, -0.45914965994894213, -0.6638978303135046, 0.22863908794063945],
                [0.5427936094830267, -0.6647333119217477, 0.2203959123019008, 0.7328231111534595]])
    submission.expect_close(out, want, dtype=torch.float64, name="moe_forward")


def test_aux_loss_value(submission):
    """aux_loss is E * sum_i f_i P_i, and exactly 1 for perfectly balanced routing."""
    logits = f64([[1.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 2.0, 1.0], [-1.0, 0.0, 1.0]])
    ids = torch.tensor([[0, 1], [1, 0], [1, 2], [2, 1]])
    loss = submission.call("aux_loss", logits, ids)
    submission.expect_close(loss, f64(1.0384405554515563), dtype=torch.float64, name="aux_loss")
    balanced_ids = torch.arange(12).reshape(6, 2) % 4     # every expert gets 3 of the 12 choices
    uniform = torch.zeros(6, 4, dtype=torch.float64)      # every probability 1/4
    submission.expect_close(submission.call("aux_loss", uniform, balanced_ids), f64(1.0),
                            dtype=torch.float64, name="aux_loss of balanced routing")
