"""Hidden tests of moe-dispatch-combine: capacity, drops, odd sizes, float32."""

import importlib.util
import pathlib

import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location(
    "moe_public", pathlib.Path(__file__).parents[1] / "public" / "test_moe_dispatch_combine.py")
_public = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_public)
expected_route, expected_dispatch = _public.expected_route, _public.expected_dispatch
expected_layer, layer_inputs = _public.expected_layer, _public.layer_inputs


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
    _public.expected_aux_loss(leaf, ids).backward()
    value, grad = submission.call("aux_loss_and_grad", logits, ids)
    submission.expect_close(value, _public.expected_aux_loss(logits, ids), dtype=torch.float64, name="aux_loss")
    submission.expect_close(grad, leaf.grad, dtype=torch.float64, name="gradient with respect to the logits")
