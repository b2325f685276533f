"""Public tests of shmem-alltoall: what check() runs in the notebook.

``run_dispatch(tokens, dest, capacity)`` returns ``(received, counts)``: ``received[d][s]`` the
rows PE ``d`` received from PE ``s``; ``counts`` = [puts, signals, fences, quiets, waits].
"""

import torch


def dispatch(submission, tokens, dest, capacity):
    """Run the submission; check the shape of what it returns."""
    n = len(tokens)
    out = submission.call("run_dispatch", tokens, dest, capacity)
    assert isinstance(out, (list, tuple)) and len(out) == 2, "run_dispatch returns (received, counts)"
    received, counts = out
    assert isinstance(received, (list, tuple)) and len(received) == n and all(len(r) == n for r in received), \
        f"received must be n lists of n tensors (n = {n})"
    for d in range(n):
        for s in range(n):
            rows = received[d][s]
            assert isinstance(rows, torch.Tensor) and rows.dim() == 2 and rows.shape[1] == tokens[0].shape[1], \
                f"PE {d}'s rows from PE {s} must be a (count, H) tensor, got {getattr(rows, 'shape', rows)}"
    return received, list(counts)


def by_hand():
    tokens = [torch.tensor([[10.0 * p + i] * 2 for i in range(2)]) for p in range(3)]
    dest = [torch.tensor([[1, 2], [1, 1]]), torch.tensor([[0, 0], [2, 0]]), torch.tensor([[2, 2], [0, 1]])]
    return tokens, dest


def firsts(received, d, s):
    return received[d][s][:, 0].tolist()


def test_three_pes_by_hand(submission):
    """3 PEs, 2 tokens each, top-2 (some tokens list one PE twice): the rows every PE receives."""
    tokens, dest = by_hand()
    received, _ = dispatch(submission, tokens, dest, 2)
    # Worked out by hand from dest: PE 0 sends token 0 to PEs 1 and 2, token 1 to PE 1 (once);
    # PE 1 sends token 0 to PE 0, token 1 to PEs 2 and 0; PE 2 sends token 0 to PE 2, token 1 to 0 and 1.
    want = {0: {0: [], 1: [10.0, 11.0], 2: [21.0]}, 1: {0: [0.0, 1.0], 1: [], 2: [21.0]},
            2: {0: [0.0], 1: [11.0], 2: [20.0]}}
    for d in range(3):
        for s in range(3):
            got = firsts(received, d, s)
            assert got == want[d][s], (f"PE {d} from PE {s}: expected rows {want[d][s]}, got {got} "
                                       "(nan: a row read before it landed, or never written there)")


def test_counts_one_put_per_token_and_pe(submission):
    """The same case: 9 (token, PE) pairs, so 9 puts; a signal to every PE from every PE, 9; a fence per PE."""
    tokens, dest = by_hand()
    _, counts = dispatch(submission, tokens, dest, 2)
    puts, signals, fences, quiets, waits = counts
    assert puts == 9, f"one put per (token, distinct PE): expected 9, got {puts}"
    assert signals == 9, f"every PE signals every PE once: expected 9, got {signals}"
    assert fences + quiets >= 3, f"each PE must order its rows before its signals: {fences} fences, {quiets} quiets"


def test_a_pe_that_gets_nothing_is_still_told(submission):
    """4 PEs route every token to PE 0: PEs 1-3 receive nothing, and must not wait forever."""
    tokens = [torch.full((3, 4), float(p)) + torch.arange(3.0)[:, None] for p in range(4)]
    dest = [torch.zeros(3, 2, dtype=torch.int64) for _ in range(4)]
    received, _ = dispatch(submission, tokens, dest, 3)
    for s in range(4):
        assert firsts(received, 0, s) == [s + 0.0, s + 1.0, s + 2.0], f"PE 0 from PE {s}: got {firsts(received, 0, s)}"
        for d in (1, 2, 3):
            assert received[d][s].shape[0] == 0, f"PE {d} should receive no rows from PE {s}"
