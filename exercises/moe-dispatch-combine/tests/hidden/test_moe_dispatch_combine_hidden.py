"""Hidden tests of moe-dispatch-combine: fresh values, capacity, drops, odd sizes, float32."""

import torch
import torch.nn.functional as F

# The float64 references live here, not in the public tests: there they would be the solution.


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


def expected_aux_loss(logits, ids):
    """Switch's E * sum_i f_i * P_i in float64: f from the assignments, P the mean softmax."""
    num_experts = logits.shape[1]
    probs = torch.softmax(logits.double(), dim=-1)
    fraction = torch.bincount(ids.reshape(-1), minlength=num_experts).double() / ids.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()




def test_route_renormalizes_in_float32(submission):
    """With top-3 of 7 in float32, the kept weights sum to one and keep logits' dtype."""
    logits = torch.randn(13, 7, generator=torch.Generator().manual_seed(3))
    ids, weights = submission.call("route", logits, 3)
    want_ids, want_weights = expected_route(logits, 3)
    assert ids.dtype == torch.int64 and ids.tolist() == want_ids.tolist(), "expert ids differ from the top-3"
    submission.expect_close(weights, want_weights, dtype=torch.float32, name="weights")


def test_capacity_drops_later_slots(submission):
    """With a capacity, each expert keeps its first slots only, and counts are clipped."""
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0]])
    slots, counts = submission.call("dispatch", ids, 3, 2)
    want_slots, want_counts = expected_dispatch(ids, 3, 2)
    assert slots.tolist() == want_slots.tolist(), f"slot_of_row: expected {want_slots.tolist()}, got {slots.tolist()}"
    assert counts.tolist() == want_counts.tolist(), f"counts: expected {want_counts.tolist()}, got {counts.tolist()}"


def test_dropped_slots_contribute_zero(submission):
    """A layer with a tight capacity: dropped (token, choice) pairs add nothing."""
    x, router, gate_up, down = layer_inputs(tokens=11, experts=4, seed=4)
    out = submission.call("moe_forward", x, router, gate_up, down, 2, 3)
    submission.expect_close(out, expected_layer(x, router, gate_up, down, 2, 3), dtype=torch.float64,
                            name="moe_forward with capacity 3")


def test_layer_odd_sizes_float32(submission):
    """An odd-sized layer in float32, top-3, no capacity."""
    x, router, gate_up, down = layer_inputs(tokens=17, hidden=9, inter=5, experts=6, seed=5, dtype=torch.float32)
    out = submission.call("moe_forward", x, router, gate_up, down, 3, None)
    submission.expect_close(out, expected_layer(x, router, gate_up, down, 3), dtype=torch.float32,
                            name="moe_forward float32")


def test_aux_loss_gradient_reaches_logits(submission):
    """The loss's gradient flows through the mean probabilities (not the counts) to the logits."""
    logits = torch.randn(9, 5, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ids, _ = expected_route(logits, 2)
    leaf = logits.clone().requires_grad_(True)
    expected_aux_loss(leaf, ids).backward()
    value, grad = submission.call("aux_loss_and_grad", logits, ids)
    submission.expect_close(value, expected_aux_loss(logits, ids), dtype=torch.float64, name="aux_loss")
    submission.expect_close(grad, leaf.grad, dtype=torch.float64, name="gradient with respect to the logits")


def test_layer_on_fresh_values(submission):
    """The whole layer on fresh random values, against the token-by-token reference."""
    x, router, gate_up, down = layer_inputs(seed=5)
    out = submission.call("moe_forward", x, router, gate_up, down, 2, None)
    submission.expect_close(out, expected_layer(x, router, gate_up, down, 2), dtype=torch.float64, name="moe_forward")
