"""Public tests of kvcache-split-decode: what check() runs in the notebook.

Expected values are computed split by split in float64: the softmax of a split's scores
alone, and the natural log of its sum of exponentials.
"""

import math

import torch

from labkit import check
from labkit.grade.harness import poisoned


def problem(batch, n_heads, n_kv_heads, head_dim, max_len, seed, *, dtype=torch.float32, q_scale=1.0):
    """A query per (sequence, head) and a cache [B, Hkv, L, d] of random keys and values."""
    gen = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(batch, n_heads, head_dim, generator=gen)
    k = torch.randn(batch, n_kv_heads, max_len, head_dim, generator=gen)
    v = torch.randn(batch, n_kv_heads, max_len, head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def expected_partials(q, k, v, lengths, split_size):
    """Each split's normalized output and log-sum-exp, float64; empty splits get (0, -inf)."""
    b, hq, d = q.shape
    hkv, max_len = k.shape[1], k.shape[2]
    splits = math.ceil(max_len / split_size)
    o = torch.zeros(b, hq, splits, d, dtype=torch.float64)
    lse = torch.full((b, hq, splits), -math.inf, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for s in range(splits):
                lo, hi = s * split_size, min((s + 1) * split_size, int(lengths[i]))
                if lo >= hi:
                    continue
                scores = k[i, kv, lo:hi].double() @ q[i, h].double() / math.sqrt(d)
                lse[i, h, s] = torch.logsumexp(scores, 0)
                o[i, h, s] = scores.softmax(0) @ v[i, kv, lo:hi].double()
    return o, lse


def full_attention(q, k, v, lengths):
    """Attention of each query over its sequence's first lengths[b] positions, float64: [B, Hq, d]."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i])
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = k[i, kv, :n].double() @ q[i, h].double() / math.sqrt(d)
            out[i, h] = scores.softmax(0) @ v[i, kv, :n].double()
    return out


def run(submission, q, k, v, lengths, split_size):
    splits = math.ceil(k.shape[2] / split_size)
    o_parts = poisoned((q.shape[0], q.shape[1], splits, q.shape[2]))
    lses = poisoned((q.shape[0], q.shape[1], splits))
    return submission.call("split_decode", q, k, v, lengths, split_size, o_parts, lses)


def expect_partials(submission, q, k, v, lengths, split_size, name):
    o_parts, lses = run(submission, q, k, v, lengths, split_size)
    want_o, want_lse = expected_partials(q, k, v, lengths, split_size)
    submission.expect_close(o_parts, want_o, dtype=torch.float32, name=f"{name}: o_parts")
    empty = want_lse == -math.inf
    if not torch.equal(lses == -math.inf, empty):
        raise check.CheckFailed(f"{name}: lses should be -inf exactly for the {int(empty.sum())} empty splits, "
                                f"and finite elsewhere; got -inf at {int((lses == -math.inf).sum())} places")
    submission.expect_close(lses[~empty], want_lse[~empty], dtype=torch.float32, name=f"{name}: lses")
    return o_parts, lses


def test_one_split_is_full_attention(submission):
    """A split as long as the cache: its output is attention over the whole sequence."""
    q, k, v = problem(2, 2, 2, 16, 40, seed=1)
    lengths = torch.tensor([40, 40])
    o_parts, _ = expect_partials(submission, q, k, v, lengths, 48, "one split of 48")
    submission.expect_close(o_parts[:, :, 0], full_attention(q, k, v, lengths), dtype=torch.float32,
                            name="the single split against full attention")


def test_partials_of_equal_splits(submission):
    """64 positions in 4 splits of 16: each split's output and log-sum-exp on its own."""
    q, k, v = problem(2, 2, 2, 16, 64, seed=2)
    expect_partials(submission, q, k, v, torch.tensor([64, 64]), 16, "4 splits of 16")


def test_partials_merge_into_full_attention(submission):
    """Merged by their log-sum-exps, 3 splits of 32 give attention over all 96 positions."""
    q, k, v = problem(1, 4, 4, 32, 96, seed=3)
    lengths = torch.tensor([96])
    o_parts, lses = run(submission, q, k, v, lengths, 32)
    merged = torch.einsum("bhs,bhsd->bhd", torch.softmax(lses.double(), dim=2), o_parts.double())
    submission.expect_close(merged.float(), full_attention(q, k, v, lengths), dtype=torch.float32,
                            name="merged splits against full attention")
