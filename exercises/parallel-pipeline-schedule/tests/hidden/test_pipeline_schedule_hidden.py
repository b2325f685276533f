"""Hidden tests of parallel-pipeline-schedule: exact order, in-flight micro-batches and the bubble
over many pipeline depths and micro-batch counts, fewer micro-batches than stages, and one stage."""

import torch

from labkit.grade.harness import public_module

pub = public_module(__file__, "test_pipeline_schedule.py")


def reference(num_stages, num_microbatches):
    """PipeDream-Flush / Megatron 1F1B: p - s - 1 warm-up forwards, alternate, drain."""
    schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        actions = [("F", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions += [("F", warmup + i), ("B", i)]
        schedule.append(actions + [("B", i) for i in range(num_microbatches - warmup, num_microbatches)])
    return schedule


def sizes(seed, count):
    """``count`` (stages, micro-batches) pairs with at least as many micro-batches as stages."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        p = int(torch.randint(2, 9, (1,), generator=gen))
        pairs.append((p, p + int(torch.randint(0, 12, (1,), generator=gen))))
    return pairs


def test_exact_order_over_many_sizes(submission):
    """The 1F1B order itself (warm-up, steady state, cool-down) for random depths and micro-batch counts."""
    for p, m in sizes(1, 6):
        got = pub.validated(submission.call("one_f_one_b", p, m), p, m)
        want = reference(p, m)
        for s in range(p):
            assert got[s] == want[s], f"p = {p}, m = {m}, stage {s}: expected {want[s]}, got {got[s]}"


def test_in_flight_is_bounded_by_the_stage_depth(submission):
    """Stage s never holds more than p - s micro-batches' activations (GPipe would hold all m)."""
    for p, m in sizes(2, 6):
        schedule = pub.validated(submission.call("one_f_one_b", p, m), p, m)
        held = [pub.in_flight(a) for a in schedule]
        assert held == [min(p - s, m) for s in range(p)], \
            f"p = {p}, m = {m}: stage s should hold at most min(p - s, m) micro-batches, holds {held}"


def test_dependencies_never_deadlock(submission):
    """Every stage's order can run: no backward before its forward, no wait on a pass queued behind it."""
    for p, m in sizes(3, 6):
        pub.simulate(pub.validated(submission.call("one_f_one_b", p, m), p, m), m)


def test_bubble_is_p_minus_one_slots_each_way(submission):
    """With one slot per pass, each stage idles exactly 2(p - 1) slots: the step takes 2(m + p - 1)."""
    for p, m in sizes(4, 6):
        starts = pub.simulate(pub.validated(submission.call("one_f_one_b", p, m), p, m), m)
        makespan = max(start + 1 for stage in starts for _, start in stage)
        assert makespan == 2 * (m + p - 1), \
            f"p = {p}, m = {m}: the step should take 2(m + p - 1) = {2 * (m + p - 1)} slots, took {makespan} " \
            f"(each stage idle {makespan - 2 * m} slots instead of {2 * (p - 1)})"


def test_fewer_microbatches_than_stages(submission):
    """m < p: the warm-up cannot be longer than the micro-batches there are."""
    for p, m in ((6, 2), (5, 1), (8, 3)):
        schedule = pub.validated(submission.call("one_f_one_b", p, m), p, m)
        pub.simulate(schedule, m)
        assert schedule == reference(p, m), f"p = {p}, m = {m}: expected {reference(p, m)}, got {schedule}"


def test_one_stage(submission):
    """p = 1: no pipeline; forward and backward alternate."""
    schedule = pub.validated(submission.call("one_f_one_b", 1, 4), 1, 4)
    assert schedule[0] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)], \
        f"one stage, 4 micro-batches: expected F0 B0 F1 B1 F2 B2 F3 B3, got {schedule[0]}"
