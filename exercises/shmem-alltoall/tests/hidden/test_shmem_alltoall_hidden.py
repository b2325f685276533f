"""Hidden tests of shmem-alltoall: random routings against a reference, dtypes, exact counts,
one PE, a full capacity."""

import torch

from labkit import check
from labkit.grade.harness import public_module

pub = public_module(__file__, "test_shmem_alltoall.py")


def reference(tokens, dest):
    """``want[d][s]``: PE ``s``'s tokens whose dest row names PE ``d``, each once, in order."""
    n = len(tokens)
    return [[tokens[s][(dest[s] == d).any(dim=1)] for s in range(n)] for d in range(n)]


def routing(n, t, k, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        tokens = [check.randn(t, h, seed=seed * 10 + p).to(dtype) for p in range(n)]
    else:
        tokens = [torch.randint(-10**6, 10**6, (t, h), generator=g, dtype=dtype) for _ in range(n)]
    dest = [torch.randint(0, n, (t, k), generator=g) for _ in range(n)]
    return tokens, dest


def capacity_for(dest, n):
    return max(1, max(int((d == p).any(dim=1).sum()) for d in dest for p in range(n)))


def expect(received, tokens, dest):
    want = reference(tokens, dest)
    n = len(tokens)
    for d in range(n):
        for s in range(n):
            got = received[d][s]
            assert got.shape == want[d][s].shape and torch.equal(got, want[d][s]), \
                (f"PE {d}'s rows from PE {s}: expected {tuple(want[d][s].shape)} rows equal to the sender's routed "
                 f"tokens in order, got {tuple(got.shape)} (nan or a wrong value: a row read before it landed, "
                 "or put at the wrong slot)")


def test_random_routings_float32(submission):
    """4 and 5 PEs, odd token counts and widths, top-2 and top-3 routings."""
    for n, t, k, h in ((4, 7, 2, 5), (5, 11, 3, 3)):
        tokens, dest = routing(n, t, k, h, torch.float32, seed=n * t)
        received, _ = pub.dispatch(submission, tokens, dest, capacity_for(dest, n))
        expect(received, tokens, dest)


def test_low_precision_and_integer_rows(submission):
    """bf16 and int64 rows move unchanged (no arithmetic on them)."""
    for dtype in (torch.bfloat16, torch.int64):
        tokens, dest = routing(3, 6, 2, 4, dtype, seed=5)
        received, _ = pub.dispatch(submission, tokens, dest, capacity_for(dest, 3))
        expect(received, tokens, dest)


def test_exact_puts_signals_and_ordering(submission):
    """A random routing in which PE 3 sends PE 0 nothing: puts = distinct (token, PE) pairs, signals and
    waits = n * n, and the rows right."""
    n, t, k, h = 4, 9, 3, 2
    tokens, dest = routing(n, t, k, h, torch.float32, seed=21)
    dest[3] = 1 + dest[3] % (n - 1)  # PEs 1..3 only: PE 0 must still hear "0 rows" from PE 3
    received, counts = pub.dispatch(submission, tokens, dest, capacity_for(dest, n))
    expect(received, tokens, dest)
    puts, signals, fences, quiets, waits = counts
    pairs = sum(int((d == p).any(dim=1).sum()) for d in dest for p in range(n))
    assert puts == pairs, f"expected {pairs} puts (one per token and distinct PE), got {puts}"
    assert signals == n * n, f"expected {n * n} signals (every PE tells every PE), got {signals}"
    assert waits == n * n, f"expected {n * n} waits (every PE waits once per source), got {waits}"
    assert fences + quiets >= n, f"every PE must order its rows before its signals: {fences} fences, {quiets} quiets"


def test_one_pe_and_a_full_capacity(submission):
    """One PE sends to itself; then 2 PEs where one sends all its tokens to the other, filling its capacity."""
    tokens, dest = routing(1, 5, 2, 3, torch.float32, seed=2)
    received, _ = pub.dispatch(submission, tokens, dest, 5)
    expect(received, tokens, dest)
    tokens, _ = routing(2, 6, 1, 3, torch.float32, seed=3)
    dest = [torch.ones(6, 1, dtype=torch.int64), torch.zeros(6, 1, dtype=torch.int64)]
    received, _ = pub.dispatch(submission, tokens, dest, 6)
    expect(received, tokens, dest)
