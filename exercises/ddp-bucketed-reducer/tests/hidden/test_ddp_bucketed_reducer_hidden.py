"""Hidden tests of ddp-bucketed-reducer: the bucket rule on random sizes, three ranks,
unused parameters, and what each bucket held when its all-reduce was launched."""

import random

import torch

from labkit.grade.harness import public_module

public = public_module(__file__, "test_ddp_bucketed_reducer.py")


def test_bucket_count_follows_ddp_rule(submission):
    """Random sizes and caps: the same buckets (and so the same count) as DDP's rule."""
    rng = random.Random(torch.Generator().manual_seed(7).initial_seed())
    for case in range(12):
        sizes = [rng.randint(1, 5000) for _ in range(rng.randint(1, 30))]
        cap = rng.choice([1, 800, 4000, 20000, 10**9])
        first = rng.choice([1, cap // 2 or 1, cap])
        want = public.expected_buckets(sizes, cap, first)
        got = submission.call("assign_buckets", sizes, cap, first)
        assert isinstance(got, list) and len(got) == len(want), \
            f"case {case}: sizes {sizes}, cap {cap}, first {first}: expected {len(want)} buckets, got {got}"
        assert got == want, f"case {case}: sizes {sizes}, cap {cap}, first {first}: expected {want}, got {got}"


def test_three_ranks_many_buckets(submission):
    """Three ranks, four layers of width 12, one parameter per bucket at worst."""
    public.run_and_check(submission, seed=2, n=3, layers=4, width=12, skips=[[], [], []], bucket_bytes=300,
                         first_bucket_bytes=1)


def test_unused_parameters_do_not_hang(submission):
    """Rank 0 skips layer 1, rank 1 skips layer 2: their buckets must still fill and launch."""
    public.run_and_check(submission, seed=3, n=2, layers=4, width=16, skips=[[1], [2]], bucket_bytes=1500,
                         first_bucket_bytes=200)


def test_buckets_are_full_when_launched(submission):
    """Each all-reduce must be given its whole bucket: every gradient in it, divided by the world size."""
    n, bucket_bytes, first = 2, 1200, 100
    weights, inputs, local, per_rank = public.run_and_check(submission, seed=4, n=n, layers=3, width=16,
                                                            skips=[[], []], bucket_bytes=bucket_bytes,
                                                            first_bucket_bytes=first)
    buckets = public.expected_buckets([w.numel() * w.element_size() for w in weights], bucket_bytes, first)
    for r, (_, launched) in enumerate(per_rank):
        assert len(launched) == len(buckets), \
            f"rank {r}: expected {len(buckets)} all-reduces (one per bucket), got {len(launched)}"
        for b, (indices, sent) in enumerate(zip(buckets, launched)):
            want = torch.cat([local[r][i].reshape(-1) / n for i in indices])
            submission.expect_close(sent, want, dtype=torch.float32,
                                    name=f"rank {r}: bucket {b} as handed to all_reduce_async")
