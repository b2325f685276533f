"""Hidden tests of collectives-ring-allreduce: more ranks, awkward sizes, other dtypes."""

import torch

from labkit.grade.harness import public_module

public = public_module(__file__, "test_collectives_ring_allreduce.py")


def test_three_ranks_awkward_sizes(submission):
    """Three ranks: sizes that 3 does not divide, fewer elements than ranks, bf16 and int64."""
    cases = [(4099, torch.float32), (2, torch.float32), (1000, torch.bfloat16), (10, torch.int64)]
    inputs, per_rank = public.run_cases(submission, 3, cases, seed=10)
    public.expect_sums(submission, inputs, per_rank)


def test_four_ranks_agree_bit_for_bit(submission):
    """Four ranks end with the same bits (DDP replicas that differ in the last bit drift apart)."""
    cases = [(1023, torch.float32), (33, torch.float64)]
    inputs, per_rank = public.run_cases(submission, 4, cases, seed=20)
    public.expect_sums(submission, inputs, per_rank)
    for c in range(len(cases)):
        for r in range(1, 4):
            assert torch.equal(per_rank[r][c], per_rank[0][c]), \
                f"case {c}: rank {r} holds different bits from rank 0; every rank must end with the same sum"
