"""Public tests of nccl-pipelined-ring: what check() runs in the notebook.

A send is ``(channel, round, step, slice, src, dst, start, stop)``: ``src`` sends bytes
``[start, stop)`` of the buffer to ``dst`` at that step of that round of that channel.
"""

FIELDS = ("channel", "round", "step", "slice", "src", "dst", "start", "stop")


def validated(sends, world_size, nbytes):
    """Raise AssertionError unless ``sends`` is a list of 8-int tuples inside the buffer, each to the next rank."""
    assert isinstance(sends, (list, tuple)), f"expected a list of sends, got {type(sends).__name__}"
    out = []
    for s in sends:
        s = tuple(s) if isinstance(s, (list, tuple)) else s
        assert isinstance(s, tuple) and len(s) == 8 and all(isinstance(v, int) for v in s), \
            f"every send must be 8 ints {FIELDS}, got {s!r}"
        channel, rnd, step, piece, src, dst, start, stop = s
        assert 0 <= src < world_size and dst == (src + 1) % world_size, \
            f"a ring send goes from rank r to rank r+1 (mod {world_size}); got src {src}, dst {dst} in {s}"
        assert 0 <= start <= stop <= nbytes, f"bytes [{start}, {stop}) are not inside a {nbytes}-byte buffer: {s}"
        out.append(s)
    return out


def reduced_everywhere(sends, world_size, nbytes):
    """Run the sends on sets of contributors per byte: True if every rank ends with every byte from every rank.

    Sends of one (channel, round, step, slice) happen at once; in the first n-1 steps a receiver
    adds what it gets to its own copy (reduce-scatter), afterwards it replaces it (all-gather).
    """
    held = [[frozenset({r})] * nbytes for r in range(world_size)]
    groups = {}
    for s in sends:
        groups.setdefault(s[:4], []).append(s)
    for key in sorted(groups):
        payload = [(s, held[s[4]][s[6]:s[7]]) for s in groups[key]]
        for s, data in payload:
            step, dst, start, stop = s[2], s[5], s[6], s[7]
            if step < world_size - 1:
                held[dst][start:stop] = [a | b for a, b in zip(held[dst][start:stop], data)]
            else:
                held[dst][start:stop] = data
    everyone = frozenset(range(world_size))
    return all(x == everyone for row in held for x in row)


def test_two_ranks_by_hand(submission):
    """n = 2, 10 bytes, one channel, 5-byte chunks, one slice: one round of two steps."""
    sends = validated(submission.call("pipelined_ring_sends", 2, 10, 1, 5, 1), 2, 10)
    # Worked out by hand: chunks [0, 5) and [5, 10). Reduce-scatter (step 0): rank r sends chunk r-1;
    # all-gather (step 1): rank r sends chunk r, the one it finished.
    want = {(0, 0, 0, 0, 0, 1, 5, 10), (0, 0, 0, 0, 1, 0, 0, 5), (0, 0, 1, 0, 0, 1, 0, 5), (0, 0, 1, 0, 1, 0, 5, 10)}
    assert set(sends) == want and len(sends) == 4, f"expected {sorted(want)}, got {sends}"


def test_every_byte_is_reduced_everywhere(submission):
    """Played on sets of contributors, the sends leave every rank with every rank's every byte."""
    for n, nbytes, channels, chunk, slices in ((3, 50, 1, 6, 2), (4, 37, 2, 3, 3), (5, 101, 3, 4, 1)):
        sends = validated(submission.call("pipelined_ring_sends", n, nbytes, channels, chunk, slices), n, nbytes)
        assert reduced_everywhere(sends, n, nbytes), \
            f"n = {n}, {nbytes} bytes, {channels} channels, chunk {chunk}, {slices} slices: some rank ends " \
            "without the full sum of some byte"


def test_steps_and_bytes_per_link(submission):
    """n = 4, 1000 bytes, 2 channels, 50-byte chunks, 2 slices: 2(n-1) steps a round, 2(n-1)/n of the buffer a link."""
    n, nbytes = 4, 1000
    sends = validated(submission.call("pipelined_ring_sends", n, nbytes, 2, 50, 2), n, nbytes)
    # Each channel owns 500 bytes: rounds of 4 * 50 = 200 bytes, so 3 rounds (200, 200, 100).
    rounds = sorted({(s[0], s[1]) for s in sends})
    assert rounds == [(c, r) for c in range(2) for r in range(3)], f"expected rounds 0-2 on channels 0-1, got {rounds}"
    for key in rounds:
        steps = sorted({s[2] for s in sends if (s[0], s[1]) == key})
        assert steps == list(range(6)), f"channel {key[0]} round {key[1]}: expected steps 0..5, got {steps}"
    per_link = [sum(s[7] - s[6] for s in sends if s[4] == r) for r in range(n)]
    assert per_link == [1500] * n, f"each link carries 2(n-1)/n x 1000 = 1500 bytes; got {per_link}"


def test_slices_cut_each_chunk(submission):
    """A 50-byte chunk in 3 slices is 17 + 17 + 16 bytes, contiguous, one send each, every rank every step."""
    n = 2
    sends = validated(submission.call("pipelined_ring_sends", n, 100, 1, 50, 3), n, 100)
    assert len(sends) == 1 * 2 * (n - 1) * n * 3, f"1 round x 2 steps x 2 ranks x 3 slices = 12 sends, got {len(sends)}"
    for src in range(n):
        for step in range(2):
            mine = sorted((s[3], s[6], s[7]) for s in sends if (s[2], s[4]) == (step, src))
            sizes = [b - a for _, a, b in mine]
            assert sizes == [17, 17, 16] and mine[0][2] == mine[1][1] and mine[1][2] == mine[2][1], \
                f"rank {src} step {step}: expected slices 0-2 of 17, 17, 16 contiguous bytes, got {mine}"
