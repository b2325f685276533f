"""Public tests of moe-dispatch-combine: what check() runs in the notebook.

Expected values are computed here, slot by slot, in float64.
"""

import torch
import torch.nn.functional as F


def expected_route(logits, top_k):
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def expected_dispatch(ids, num_experts, capacity=None):
    flat = ids.reshape(-1).tolist()
    kept, counts = [], [0] * num_experts
    for e in range(num_experts):
        for slot, chosen in enumerate(flat):
            if chosen == e and (capacity is None or counts[e] < capacity):
                kept.append(slot)
                counts[e] += 1
    return torch.tensor(kept, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)


def expected_layer(x, router_weight, w_gate_up, w_down, top_k, capacity=None):
    """Token by token: each kept (token, choice) adds its weighted expert output."""
    x, router_weight = x.double(), router_weight.double()
    ids, weights = expected_route(F.linear(x, router_weight), top_k)
    kept = set(expected_dispatch(ids, router_weight.shape[0], capacity)[0].tolist())
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            if t * top_k + j in kept:
                e = int(ids[t, j])
                gate, up = F.linear(x[t], w_gate_up[e].double()).chunk(2)
                out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w_down[e].double())
    return out


def layer_inputs(tokens=9, hidden=12, inter=7, experts=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    router = torch.randn(experts, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    return tuple(t.to(dtype) for t in (x, router, gate_up, down))


def test_route_picks_and_renormalizes(submission):
    """route keeps the top-k softmax experts, with weights summing to one per token."""
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids, weights = submission.call("route", logits, 2)
    want_ids, want_weights = expected_route(logits, 2)
    assert isinstance(ids, torch.Tensor) and ids.tolist() == want_ids.tolist(), \
        f"expert ids: expected {want_ids.tolist()}, got {ids.tolist() if isinstance(ids, torch.Tensor) else ids}"
    submission.expect_close(weights, want_weights, dtype=torch.float64, name="weights")


def test_dispatch_sorts_by_expert(submission):
    """dispatch lists the slots expert by expert, earlier slots first, and counts them."""
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 3]])
    slots, counts = submission.call("dispatch", ids, 4, None)
    want_slots, want_counts = expected_dispatch(ids, 4)
    assert slots.tolist() == want_slots.tolist(), f"slot_of_row: expected {want_slots.tolist()}, got {slots.tolist()}"
    assert counts.tolist() == want_counts.tolist(), f"counts: expected {want_counts.tolist()}, got {counts.tolist()}"


def test_combine_puts_rows_back(submission):
    """combine scatters each weighted row back to its token and sums the token's choices."""
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([[1, 0], [0, 2], [2, 1]])
    weights = torch.rand(3, 2, generator=g, dtype=torch.float64)
    slots, _ = expected_dispatch(ids, 3)
    rows = torch.randn(len(slots), 4, generator=g, dtype=torch.float64)
    want = torch.zeros(3, 4, dtype=torch.float64)
    for r, slot in enumerate(slots.tolist()):
        want[slot // 2] += weights[slot // 2, slot % 2] * rows[r]
    out = submission.call("combine", rows, slots, weights, 3)
    submission.expect_close(out, want, dtype=torch.float64, name="combine")


def test_layer_matches_reference(submission):
    """The whole layer (your three functions in the given moe_forward) matches the reference."""
    x, router, gate_up, down = layer_inputs()
    out = submission.call("moe_forward", x, router, gate_up, down, 2, None)
    submission.expect_close(out, expected_layer(x, router, gate_up, down, 2), dtype=torch.float64, name="moe_forward")


def expected_aux_loss(logits, ids):
    """Switch's E * sum_i f_i * P_i in float64: f from the assignments, P the mean softmax."""
    num_experts = logits.shape[1]
    probs = torch.softmax(logits.double(), dim=-1)
    fraction = torch.bincount(ids.reshape(-1), minlength=num_experts).double() / ids.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def test_aux_loss_value(submission):
    """aux_loss is E * sum_i f_i P_i, and exactly 1 for perfectly balanced routing."""
    logits = torch.randn(11, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ids, _ = expected_route(logits, 2)
    loss = submission.call("aux_loss", logits, ids)
    submission.expect_close(loss, expected_aux_loss(logits, ids), dtype=torch.float64, name="aux_loss")
    balanced_ids = torch.arange(12).reshape(6, 2) % 4     # every expert gets 3 of the 12 choices
    uniform = torch.zeros(6, 4, dtype=torch.float64)      # every probability 1/4
    submission.expect_close(submission.call("aux_loss", uniform, balanced_ids), torch.tensor(1.0, dtype=torch.float64),
                            dtype=torch.float64, name="aux_loss of balanced routing")
