"""labkit.ddp: torch's bucket assignment, and DataParallel's gradients against torch's
DistributedDataParallel on 2 and 3 gloo processes (bit for bit, buckets included)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

import labkit  # noqa: F401  (sets the mode before anything else)
from labkit.collectives import launch
from labkit.ddp import (DEFAULT_FIRST_BUCKET_BYTES, MIB, NO_LIMIT, DataParallel, assign_buckets, bucket_limits,
                        parameters_reached, programs)
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
