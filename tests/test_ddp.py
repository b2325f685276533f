"""labkit.ddp: torch's bucket assignment, and DataParallel's gradients against torch's
DistributedDataParallel on 2 and 3 gloo processes (bit for bit, buckets included)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

import labkit  # noqa: F401  (sets the mode before anything else)
from labkit.collectives import launch
from labkit.ddp import (DEFAULT_FIRST_BUCKET_BYTES, MIB, NO_LIMIT, DataParallel, assign_buckets, bucket_limits,
                        figures, parameters_reached, programs)
from labkit.models import TINY

TINY_CONFIG = dataclasses.asdict(TINY)


# --- bucket assignment (one process) -------------------------------------------------------

def _random_tensors(rng: random.Random, count: int) -> list[torch.Tensor]:
    dtypes = [torch.float32, torch.float32, torch.float16, torch.float64]
    return [torch.empty(rng.randint(1, 3000), dtype=rng.choice(dtypes)) for _ in range(count)]


@pytest.mark.parametrize("seed", range(6))
def test_assignment_matches_torch_compute_bucket_assignment_by_size(seed):
    rng = random.Random(seed)
    tensors = _random_tensors(rng, rng.randint(1, 40))
    limits = sorted(rng.sample([64, 500, 4096, 20_000, NO_LIMIT], rng.randint(1, 3)))
    want, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    assert assign_buckets(tensors, limits) == [list(b) for b in want]


@pytest.mark.parametrize("seed", range(4))
def test_rebuild_assignment_keeps_the_arrival_order(seed):
    """With an explicit order (gradients' arrival), buckets are not re-sorted, as in torch's rebuild."""
    rng = random.Random(100 + seed)
    tensors = _random_tensors(rng, 25)
    order = list(range(len(tensors)))
    rng.shuffle(order)
    walked = [tensors[i] for i in order]
    limits = [3000, 9000]
    want, _ = dist._compute_bucket_assignment_by_size(walked, limits, [False] * len(tensors), order)
    assert assign_buckets(walked, limits, order=order) == [list(b) for b in want]


def test_bucket_limits_follow_torch_defaults():
    assert bucket_limits(None) == (DEFAULT_FIRST_BUCKET_BYTES, 25 * MIB)
    assert DEFAULT_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert bucket_limits(4) == (4 * MIB, 4 * MIB)  # an explicit cap applies to the first bucket too


@pytest.mark.parametrize("bad", [0, -1.5, "25", True])
def test_bucket_limits_reject_bad_caps(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_limits(bad)


def test_assign_buckets_rejects_bad_arguments():
    t = [torch.empty(3), torch.empty(4)]
    with pytest.raises(ValueError, match="size_limits"):
        assign_buckets(t, [])
    with pytest.raises(ValueError, match="size_limits"):
        assign_buckets(t, [0])
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        assign_buckets([t[0], "x"], [10])
    with pytest.raises(ValueError, match="order"):
        assign_buckets(t, [10], order=[0, 0])


def test_parameters_reached_finds_the_unused_branch():
    used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    reached = parameters_reached({"out": [used(torch.randn(2, 3)).sum()]})
    assert {id(used.weight), id(used.bias)} <= reached
    assert not {id(unused.weight), id(unused.bias)} & reached


def test_data_parallel_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no process group"):
        DataParallel(torch.nn.Linear(2, 2))


# --- against torch's DDP, on real processes --------------------------------------------------

def _check_report(report: dict) -> None:
    assert all(report["none_grads_agree"]), "a gradient is None in one implementation and set in the other"
    assert all(report["bitwise"]), f"gradients differ from torch DDP's by up to {report['max_diff']}"
    assert report["params_equal_after"]


def test_decoder_gradients_bitwise_equal_to_torch_ddp_two_ranks():
    """Small buckets (many, rebuilt after step 1) and gradient accumulation under no_sync."""
    reports = launch.run(programs.compare_with_torch_ddp, 2, args=("decoder", TINY_CONFIG, 2, 2, 0.05))
    for report in reports:
        _check_report(report)
        assert len(report["our_bucket_bytes"]) > 3
        assert report["our_bucket_bytes"] == report["torch_bucket_bytes"]
        assert report["our_bucket_indices"] == report["torch_bucket_indices"]  # torch's rebuilt buckets
    assert reports[0]["our_bucket_indices"] == reports[1]["our_bucket_indices"]


def test_three_ranks_unused_parameters_and_default_buckets():
    """Three ranks sum in an order that depends on the buffer layout, so bitwise equality
    needs torch's buckets exactly. Case 1: find_unused_parameters, each rank skips a head
    (locally unused) and nobody uses ``spare`` (its gradient stays None), all-reduce after
    backward (overlap off). Case 2: the decoder with the default 25 MiB cap, overlapped."""
    cases = [("two-heads", None, 2, 1, 0.001, True, False), ("decoder", TINY_CONFIG, 2, 1)]
    for unused, default in launch.run(programs.compare_cases, 3, args=(cases,)):
        _check_report(unused)
        assert unused["our_bucket_bytes"] == unused["torch_bucket_bytes"]
        assert len(unused["our_bucket_bytes"]) > 1
        assert unused["torch_bucket_indices"] is None  # with unused parameters, torch never rebuilds
        _check_report(default)
        assert default["our_bucket_indices"] == default["torch_bucket_indices"]


# --- one rank in this process: errors, the overlap model -------------------------------------

@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_missing_gradient_without_find_unused_parameters_names_it(one_rank_group):
    model = DataParallel(programs.TwoHeads())  # rank 0 uses head 0: head 1 and spare get no gradient
    loss = model(torch.arange(6)).square().mean()
    with pytest.raises(RuntimeError, match=r"find_unused_parameters=True.*heads\.1\.weight"):
        loss.backward()


def test_one_rank_gradients_are_the_local_ones(one_rank_group):
    reference = programs.TwoHeads()
    model = DataParallel(copy.deepcopy(reference), find_unused_parameters=True, bucket_cap_mb=0.001)
    ids = torch.arange(10)
    model(ids).square().mean().backward()
    reference(ids).square().mean().backward()
    for (name, ours), theirs in zip(model.module.named_parameters(), reference.parameters()):
        assert (ours.grad is None) == (theirs.grad is None), name
        if ours.grad is not None:
            assert torch.equal(ours.grad, theirs.grad), name


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    (dict(find_unused_parameters=1), TypeError, "find_unused_parameters"),
    (dict(overlap="yes"), TypeError, "overlap"),
    (dict(all_reduce=3), TypeError, "all_reduce"),
])
def test_data_parallel_rejects_bad_arguments(one_rank_group, kwargs, error, match):
    with pytest.raises(error, match=match):
        DataParallel(torch.nn.Linear(2, 2), **kwargs)


def test_data_parallel_rejects_a_model_without_trainable_parameters(one_rank_group):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        DataParallel(lambda x: x)
    with pytest.raises(ValueError, match="no parameter"):
        DataParallel(torch.nn.ReLU())


def test_overlap_model_hides_all_but_the_last_bucket():
    link = figures.LinkFit(fixed_s=0.001, per_byte_s=1e-6)
    sizes = [1000, 2000, 3000]
    after = figures.simulate_step(sizes, backward_s=10.0, link=link, overlap=False)
    assert after["synced_s"] == pytest.approx(10.0 + sum(link.seconds(s) for s in sizes))
    overlapped = figures.simulate_step(sizes, backward_s=10.0, link=link, overlap=True)
    assert overlapped["exposed_s"] == pytest.approx(link.seconds(3000))  # earlier buckets finish under backward


def test_fit_link_recovers_a_line_from_back_to_back_all_reduces():
    sizes, fixed, per_byte = [1000, 4000, 2500], 0.002, 3e-7
    t, launched, reduced = 1.0, [], []
    for s in sizes:  # all launched at 1.0, run one after another
        launched.append(1.0)
        t += fixed + per_byte * s
        reduced.append(t)
    fit = figures.fit_link({"launched": launched, "reduced": reduced}, sizes)
    assert fit.fixed_s == pytest.approx(fixed) and fit.per_byte_s == pytest.approx(per_byte)
