"""Public tests of serve-step-roofline: what check() runs in the notebook.

A toy decoder small enough to count by hand: hidden 4, 1 layer, 2 query heads and 1 KV head
of 2, MLP width 6, vocabulary 10. Its layer has 4*2*(2*2 + 2*1) + 3*4*6 = 48 + 72 = 120
weights, its LM head 10*4 = 40; a token's K and V are 2*1*1*2 = 4 elements. The hidden
tests hold a reference and random models.
"""

TOY = dict(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, intermediate=6, vocab=10)


def expect_cost(submission, shape, want, what):
    got = submission.call("step_cost", *TOY.values(), **shape)
    assert isinstance(got, (list, tuple)) and len(got) == 2, f"step_cost must return (flops, bytes), got {got!r}"
    assert tuple(float(v) for v in got) == tuple(float(v) for v in want), \
        f"{what}: expected (flops, bytes) = {want}, got {tuple(got)}"


def test_prefill_of_three_tokens(submission):
    """One sequence, 3 new tokens, nothing cached: causal pairs, the LM head once."""
    # FLOPs: 2*120*3 (layer matmuls) + 2*40*1 (LM head, last token) + 4*2*2*1 * (1+2+3) pairs = 720 + 80 + 96
    # bytes: 2 * (120 + 40 weights + 4*3 new K and V) = 2 * 172
    expect_cost(submission, dict(batch=1, new_tokens=3, context=0), (896, 344), "prefill of 3 tokens")


def test_decode_of_two_sequences(submission):
    """Two sequences, one new token each after 5 cached: weights once, both caches read."""
    # FLOPs: 2*120*2 + 2*40*2 + 16 * 2*(5 + 1) pairs = 480 + 160 + 192
    # bytes: 2 * (160 weights + 4*2*5 cached K and V + 4*2 new) = 2 * 208
    expect_cost(submission, dict(batch=2, new_tokens=1, context=5), (832, 416), "decode of 2 sequences at context 5")


def test_which_roof(submission):
    """The longer of the two times bounds the step; a tie counts as compute."""
    # 2e12 FLOPs at 1000 TFLOP/s take 2 ms, 1e9 bytes at 4 TB/s 0.25 ms
    assert submission.call("bound", 2e12, 1e9, 1000, 4) == "compute"
    # 1e9 FLOPs take 1 us, 1e9 bytes 250 us
    assert submission.call("bound", 1e9, 1e9, 1000, 4) == "memory"
    # 1e12 FLOPs and 4e9 bytes: 1 ms each
    assert submission.call("bound", 1e12, 4e9, 1000, 4) == "compute", "a tie counts as compute"
