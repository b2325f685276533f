"""Hidden tests of nccl-pipelined-ring: the exact sends against a reference over random sizes,
bytes per link, a buffer smaller than the ring, many channels, and a single rank."""

import torch

from labkit.grade.harness import public_module

pub = public_module(__file__, "test_pipelined_ring.py")


def split(length, parts):
    base, longer = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < longer else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reference(n, nbytes, channels, chunk_bytes, slices):
    sends = []
    for channel, (lo, hi) in enumerate(split(nbytes, channels)):
        for rnd, r0 in enumerate(range(lo, hi, n * chunk_bytes)):
            r1 = min(r0 + n * chunk_bytes, hi)
            chunks = split(r1 - r0, n)
            for step in range(2 * (n - 1)):
                for src in range(n):
                    chunk = (src - step - 1) % n if step < n - 1 else (src - step + n - 1) % n
                    c0, c1 = chunks[chunk]
                    for piece, (a, b) in enumerate(split(c1 - c0, slices)):
                        sends.append((channel, rnd, step, piece, src, (src + 1) % n, r0 + c0 + a, r0 + c0 + b))
    return sends


def per_rank(sends):
    """Each (channel, rank)'s sends in the order it issues them: what must match exactly."""
    out = {}
    for s in sends:
        out.setdefault((s[0], s[4]), []).append(s)
    return out


def configs(seed, count):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    out = []
    for _ in range(count):
        n, channels, chunk, slices = draw(2, 7), draw(1, 4), draw(1, 40), draw(1, 4)
        out.append((n, draw(1, 5 * n * channels * chunk), channels, chunk, slices))
    return out


def test_exact_sends_over_random_sizes(submission):
    """Every rank's sends, in issue order, for random ring sizes, buffers, channels, chunks and slices."""
    for cfg in configs(1, 8):
        got = per_rank(pub.validated(submission.call("pipelined_ring_sends", *cfg), cfg[0], cfg[1]))
        want = per_rank(reference(*cfg))
        assert got.keys() == want.keys(), f"{cfg}: expected sends from (channel, rank) {sorted(want)}, got {sorted(got)}"
        for key in want:
            assert got[key] == want[key], f"{cfg}, channel {key[0]} rank {key[1]}: expected {want[key]}, got {got[key]}"


def test_bytes_per_link_and_step_counts(submission):
    """Per link, the bytes of the reference; per (channel, round), 2(n-1) steps of every rank's every slice."""
    for n, nbytes, channels, chunk, slices in configs(2, 8):
        sends = pub.validated(submission.call("pipelined_ring_sends", n, nbytes, channels, chunk, slices), n, nbytes)
        want = reference(n, nbytes, channels, chunk, slices)
        got_links = [sum(s[7] - s[6] for s in sends if s[4] == r) for r in range(n)]
        want_links = [sum(s[7] - s[6] for s in want if s[4] == r) for r in range(n)]
        assert got_links == want_links, f"n = {n}, {nbytes} B: bytes per link expected {want_links}, got {got_links}"
        for key in {(s[0], s[1]) for s in want}:
            count = sum(1 for s in sends if (s[0], s[1]) == key)
            assert count == 2 * (n - 1) * n * slices, \
                f"n = {n}, channel {key[0]} round {key[1]}: expected {2 * (n - 1) * n * slices} sends, got {count}"
        assert pub.reduced_everywhere(sends, n, nbytes), f"n = {n}, {nbytes} B: not every byte reduced everywhere"


def test_fewer_bytes_than_ranks(submission):
    """3 bytes on 5 ranks: two chunks are empty, and their (empty) slices are still sent, every step."""
    sends = pub.validated(submission.call("pipelined_ring_sends", 5, 3, 1, 4, 2), 5, 3)
    assert per_rank(sends) == per_rank(reference(5, 3, 1, 4, 2))
    assert pub.reduced_everywhere(sends, 5, 3)


def test_one_rank_sends_nothing(submission):
    """A ring of one has no step, so no sends; the same buffer on two ranks has the reference's."""
    sends = submission.call("pipelined_ring_sends", 1, 64, 2, 8, 2)
    assert list(sends) == [], f"one rank has nobody to send to; expected [], got {sends}"
    two = pub.validated(submission.call("pipelined_ring_sends", 2, 64, 2, 8, 2), 2, 64)
    assert per_rank(two) == per_rank(reference(2, 64, 2, 8, 2)), "two ranks, 64 bytes: not the reference's sends"
