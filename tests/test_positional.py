"""labkit.positional: each scheme against its paper's formula and Hugging Face, the model against the book's."""

import math

import pytest
import torch
import torch.nn.functional as F

from labkit import benchmarks, check, models
from labkit import positional as P
from labkit.positional import frequencies

# Odd sizes on purpose: 3 layers, 6 query heads (not a power of two) over 3 KV heads of 14.
CONFIG = models.DecoderConfig(vocab_size=256, hidden_size=72, num_layers=3, num_heads=6, num_kv_heads=3,
                              head_dim=14, intermediate_size=100, rope_theta=10_000.0, tie_word_embeddings=True)


def hf_rope(rope_type, head_dim, theta, max_positions=1024, seq_len=None, **params):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=max_positions,
                         rope_parameters={"rope_type": rope_type, "rope_theta": theta, **params})
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


# -- the tables -------------------------------------------------------------------------------

def test_sinusoidal_table_is_the_papers_formula():
    positions = torch.tensor([0, 1, 7, 300, 5001])
    dim, base = 10, 10_000.0
    table = P.sinusoidal_table(positions, dim, base)
    for row, p in enumerate(positions.tolist()):
        for i in range(dim // 2):
            angle = p / base ** (2 * i / dim)
            assert table[row, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[row, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_offset_is_one_linear_map_for_every_position():
    # PE[p + k] = R_k PE[p], R_k block-diagonal rotations that depend on k only.
    dim, k = 12, 37
    table = P.sinusoidal_table(torch.arange(200), dim).double()
    speeds = 10_000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    rotation = torch.zeros(dim, dim, dtype=torch.float64)
    for i, w in enumerate(speeds.tolist()):
        c, s = math.cos(k * w), math.sin(k * w)
        rotation[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[c, s], [-s, c]])
    check.assert_close(table[:-k] @ rotation.T, table[k:], tol=1e-5, name="R_k PE[p] = PE[p+k]")


@pytest.mark.parametrize("head_dim", [8, 14, 64, 128])
@pytest.mark.parametrize("factor", [1.0, 2.0, 3.5, 8.0])
def test_pi_ntk_and_yarn_match_hugging_face(head_dim, factor):
    theta = 10_000.0 if head_dim < 64 else 1_000_000.0
    check.assert_close(P.linear_inv_freq(head_dim, theta, factor), hf_rope("linear", head_dim, theta, factor=factor)[0],
                       tol=1e-6, name="linear")
    # HF's dynamic type at length n is NTK-aware scaling by factor * n / max - (factor - 1).
    max_positions, n = 512, 1536
    dynamic, _ = hf_rope("dynamic", head_dim, theta, max_positions, seq_len=n, factor=factor)
    check.assert_close(P.ntk_inv_freq(head_dim, theta, factor * n / max_positions - (factor - 1)), dynamic,
                       tol=1e-5, name="dynamic NTK")
    for truncate in (True, False):
        hf_speeds, hf_temperature = hf_rope("yarn", head_dim, theta, factor=factor, original_max_position_embeddings=256,
                                            truncate=truncate)
        ours = P.yarn_inv_freq(head_dim, theta, factor, 256, truncate=truncate)
        check.assert_close(ours, hf_speeds, tol=1e-5, name=f"yarn (truncate={truncate})")
        assert P.yarn_attention_factor(factor) == pytest.approx(hf_temperature)


def test_yarn_ratio_ramp_is_the_papers_gamma_and_agrees_outside_the_ramp():
    head_dim, theta, length, alpha, beta = 64, 10_000.0, 2048, 1.0, 32.0
    gamma = P.yarn_ramp(head_dim, theta, length, beta_fast=beta, beta_slow=alpha, ramp="ratio")
    by_index = P.yarn_ramp(head_dim, theta, length, beta_fast=beta, beta_slow=alpha, ramp="dimension", truncate=False)
    for i in range(head_dim // 2):
        r = length / (2 * math.pi * theta ** (2 * i / head_dim))  # turns over the original context
        expected = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        assert gamma[i].item() == pytest.approx(expected, abs=1e-6)
        if r < alpha or r > beta:
            assert by_index[i].item() == pytest.approx(expected, abs=1e-6)
    inside = (gamma > 0) & (gamma < 1)
    assert inside.sum() >= 3 and (by_index[inside] - gamma[inside]).abs().max() > 0.05  # the two ramps differ


def test_yarn_interpolates_the_slow_pairs_and_keeps_the_fast_ones():
    speeds = P.rope_inv_freq(64, 10_000.0)
    yarn = P.yarn_inv_freq(64, 10_000.0, 4.0, 2048)
    assert yarn[0] == speeds[0] and torch.allclose(yarn[-1], speeds[-1] / 4)
    assert bool(((yarn <= speeds * (1 + 1e-6)) & (yarn >= speeds / 4 * (1 - 1e-6))).all())


def test_ntk_slows_the_slowest_pair_by_exactly_the_factor():
    speeds, ntk = P.rope_inv_freq(32, 10_000.0), P.ntk_inv_freq(32, 10_000.0, 5.0)
    assert ntk[0] == speeds[0]
    assert ntk[-1].item() == pytest.approx(speeds[-1].item() / 5, rel=1e-5)


@pytest.mark.parametrize("num_heads", list(range(1, 21)) + [32, 40, 48, 64])
def test_alibi_slopes_match_the_paper_and_hugging_face(num_heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    ours = P.alibi_slopes(num_heads)
    check.assert_close(ours, _get_alibi_slopes(num_heads, torch.device("cpu")).float(), tol=1e-6, name="alibi slopes")
    if num_heads & (num_heads - 1) == 0:  # a power of two: the paper's geometric sequence from 2^(-8/n)
        expected = torch.tensor([2 ** (-8 * k / num_heads) for k in range(1, num_heads + 1)])
        check.assert_close(ours, expected, tol=1e-6, name="geometric slopes")


def test_alibi_bias_is_minus_slope_times_distance_and_causal():
    slopes = P.alibi_slopes(3)
    bias = P.alibi_bias(slopes, torch.arange(5), torch.arange(5))
    for h in range(3):
        for i in range(5):
            for j in range(5):
                assert bias[h, i, j].item() == (-slopes[h].item() * (i - j) if j <= i else float("-inf"))


def test_sinusoidal_scheme_adds_a_table_of_the_requested_rms():
    x = torch.zeros(2, 50, 72)
    added = P.Sinusoidal(72, rms=0.02).embed(x, torch.arange(50))
    assert added.pow(2).mean().sqrt().item() == pytest.approx(0.02, rel=1e-5)
    check.assert_close(added[1], added[0], name="the same table for every sequence")


def test_yarn_scheme_scales_the_scores_by_the_temperature_squared():
    q = torch.randn(1, 1, 5, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 16, dtype=torch.float64)
    positions = torch.arange(5)
    scheme = P.yarn(16, 1e4, 4.0, 8)
    plain = P.Rotary(16, 1e4, scheme.rope.inv_freq)  # the same speeds, no temperature
    (q1, k1), (q2, k2) = scheme.rotate(q, k, positions), plain.rotate(q, k, positions)
    check.assert_close(q1 @ k1.transpose(-1, -2), P.yarn_attention_factor(4.0) ** 2 * (q2 @ k2.transpose(-1, -2)),
                       tol=1e-6, name="YaRN logits = t^2 x logits")


@pytest.mark.parametrize("call, error, match", [
    (lambda: P.sinusoidal_table(torch.arange(4), 7), ValueError, "must be even"),
    (lambda: P.sinusoidal_table(torch.arange(4.0), 8), TypeError, "positions"),
    (lambda: P.rope_inv_freq(15, 10_000.0), ValueError, "must be even"),
    (lambda: P.rope_inv_freq(16, -1.0), ValueError, "theta must be a positive number"),
    (lambda: P.linear_inv_freq(16, 10_000.0, 0.5), ValueError, "at least 1"),
    (lambda: P.ntk_inv_freq(2, 10_000.0, 2.0), ValueError, "head_dim >= 4"),
    (lambda: P.yarn_inv_freq(16, 10_000.0, 2.0, 0), ValueError, "original_max_positions"),
    (lambda: P.yarn_ramp(16, 10_000.0, 64, beta_fast=1.0, beta_slow=2.0), ValueError, "beta_fast"),
    (lambda: P.yarn_ramp(16, 10_000.0, 64, ramp="cosine"), ValueError, "ramp must be one of"),
    (lambda: P.alibi_slopes(0), ValueError, "num_heads must be positive"),
    (lambda: P.alibi_bias(P.alibi_slopes(2), torch.arange(3.0), torch.arange(3)), TypeError, "query_positions"),
])
def test_tables_refuse_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- the model --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_scheme_is_the_book_model(dtype):
    device = labkit_device()
    book = models.Decoder(CONFIG, seed=5, dtype=dtype, device=device)
    ours = P.PositionalDecoder(CONFIG, P.rope(CONFIG.head_dim, CONFIG.rope_theta), seed=5, dtype=dtype, device=device)
    assert list(book.state_dict()) == list(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(book.state_dict().values(), ours.state_dict().values()))
    ids = torch.randint(0, 256, (3, 29), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        check.assert_close(ours(ids), book(ids), dtype=dtype, name=f"logits ({dtype})")


def labkit_device():
    from labkit import backend

    return backend.device()


def test_extensions_at_factor_one_are_rope_and_pi_reads_positions_divided():
    ids = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    model = P.PositionalDecoder(CONFIG, P.rope(CONFIG.head_dim, CONFIG.rope_theta), seed=2)
    with torch.no_grad():
        plain = model(ids)
        for scheme in (P.position_interpolation(14, 1e4, 1.0), P.ntk_aware(14, 1e4, 1.0), P.yarn(14, 1e4, 1.0, 64)):
            check.assert_close(model.use_scheme(scheme)(ids), plain, name=f"{scheme.name} at factor 1")
    # PI with factor s rotates position s*m exactly as RoPE rotates m.
    q = torch.randn(1, 2, 5, 14, dtype=torch.float64)
    m = torch.arange(5)
    rope_q, _ = P.rope(14, 1e4).rotate(q, q, m)
    pi_q, _ = P.position_interpolation(14, 1e4, 3.0).rotate(q, q, 3 * m)
    check.assert_close(pi_q, rope_q, tol=1e-6, name="PI(3) at 3m = RoPE at m")


def test_rope_scores_depend_only_on_the_offset():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64)
    scheme = P.rope(32, 10_000.0)

    def score(m, n):
        qm, _ = scheme.rotate(q, q, torch.tensor([m]))
        kn, _ = scheme.rotate(k, k, torch.tensor([n]))
        return (qm * kn).sum().item()

    # The angles are computed in fp32, as in the model and in HF: an angle of p radians is
    # off by up to ~6e-8 * p, so a score may move by |q| |k| times that, and no more.
    for m, n, shift in [(7, 3, 100), (50, 50, 999), (0, 12, 4321)]:
        rounding = (q.norm() * k.norm()).item() * 6e-8 * (m + n + 2 * shift)
        assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=rounding)
    assert score(7, 3) != pytest.approx(score(8, 3), rel=1e-3)


def test_alibi_attention_matches_an_explicit_softmax():
    torch.manual_seed(0)
    model = P.PositionalDecoder(CONFIG, P.ALiBi(CONFIG.num_heads), seed=4, dtype=torch.float64)
    attn = model.blocks[0].attn
    x = torch.randn(2, 11, CONFIG.hidden_size, dtype=torch.float64)
    positions = torch.arange(11)
    out = attn(x, positions, model.scheme)
    # The same projections, then softmax(q k^T / sqrt(d) + bias) v written out, K/V heads repeated per group.
    q = attn.q_norm(attn.wq(x).view(2, 11, 6, 14)).transpose(1, 2)
    k = attn.k_norm(attn.wk(x).view(2, 11, 3, 14)).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 11, 3, 14).transpose(1, 2).repeat_interleave(2, dim=1)
    bias = P.alibi_bias(P.alibi_slopes(6), positions, positions).double()
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(14) + bias, dim=-1)
    expected = attn.wo((weights @ v).transpose(1, 2).reshape(2, 11, -1))
    check.assert_close(out, expected, tol=1e-10, name="ALiBi attention")


@pytest.mark.parametrize("name", P.SCHEMES)
def test_every_scheme_runs_past_the_trained_length_and_learns_nothing_it_should_not(name):
    scheme = P.make_scheme(name, CONFIG, train_length=16, length=64)
    model = P.PositionalDecoder(CONFIG, scheme)
    logits = model(torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)))
    assert logits.shape == (2, 64, 256) and torch.isfinite(logits).all()
    has_weights = any(True for _ in scheme.parameters())
    assert has_weights == (name == "learned")


def test_each_scheme_gives_the_same_weights_different_logits():
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    outs = {name: P.PositionalDecoder(CONFIG, P.make_scheme(name, CONFIG, train_length=12, length=12), seed=0)(ids)
            for name in P.TRAINED_SCHEMES}
    for a in outs:
        for b in outs:
            if a < b:
                assert not torch.allclose(outs[a], outs[b]), (a, b)


@pytest.mark.parametrize("call, error, match", [
    (lambda: P.PositionalDecoder(CONFIG, "rope"), TypeError, "PositionScheme"),
    (lambda: P.PositionalDecoder("config", P.NoPE()), TypeError, "DecoderConfig"),
    (lambda: P.PositionalDecoder(CONFIG, P.NoPE())(torch.zeros(2, 3)), TypeError, "int32/int64"),
    (lambda: P.PositionalDecoder(CONFIG, P.NoPE())(torch.zeros(3, dtype=torch.int64)), ValueError, "batch, tokens"),
    (lambda: P.PositionalDecoder(CONFIG, P.Learned(72, 8))(torch.zeros(1, 9, dtype=torch.int64)), ValueError,
     "no vector for position 8"),
    (lambda: P.PositionalDecoder(CONFIG, P.ALiBi(4))(torch.zeros(1, 3, dtype=torch.int64)), ValueError, "4 heads"),
    (lambda: P.PositionalDecoder(CONFIG, P.NoPE()).use_scheme(P.Learned(72, 8)), ValueError, "weights of its own"),
    (lambda: P.Rotary(14, 1e4, torch.ones(6)), ValueError, "7 entries"),
    (lambda: P.make_scheme("xpos", CONFIG, train_length=8, length=8), ValueError, "scheme must be one of"),
])
def test_model_refuses_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- the experiment ---------------------------------------------------------------------------

SMALL = models.DecoderConfig(vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                             intermediate_size=48, rope_theta=10_000.0, tie_word_embeddings=True)


def test_extrapolation_run_rows_are_complete_and_causal():
    run = P.ExtrapolationRun(model=SMALL, train_length=8, steps=3, batch=4, lr=1e-3, seeds=(0, 1), eval_windows=3,
                             bucket=4, corpus_bytes=200_000)
    out = P.run_extrapolation(run)
    rows = out["rows"]
    buckets = sum(length // 4 for length in run.eval_lengths)
    assert len(rows) == len(P.SCHEMES) * len(run.seeds) * buckets
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert set(out["final_train_loss"]) == set(P.TRAINED_SCHEMES)

    def loss(scheme, length, seed, start):
        (row,) = [r for r in rows if (r["scheme"], r["eval_length"], r["seed"], r["position_start"]) ==
                  (scheme, length, seed, start)]
        return row["loss"]

    for seed in run.seeds:
        for ext in P.ROPE_EXTENSIONS:  # at the trained length every extension is RoPE itself
            assert loss(ext, 8, seed, 4) == pytest.approx(loss("rope", 8, seed, 4), abs=2e-5)
        for scheme in P.TRAINED_SCHEMES:  # causal: the first 8 positions read the same bytes at any length
            assert loss(scheme, 32, seed, 4) == pytest.approx(loss(scheme, 8, seed, 4), abs=1e-4)
    summary = {(s["scheme"], s["eval_length"]): s for s in P.summarize(rows, 8)}
    assert summary[("rope", 8)]["loss_beyond_train"] is None and summary[("rope", 32)]["seeds"] == 2
    s = summary[("alibi", 16)]
    assert s["loss_min"] <= s["loss"] <= s["loss_max"]


def test_finetuned_rope_variants_are_read_with_their_own_scheme():
    run = P.ExtrapolationRun(model=SMALL, train_length=8, steps=5, batch=4, lr=1e-3, seeds=(3,), eval_windows=3,
                             bucket=8, trained=("rope",), extensions=("pi",), finetune_steps=4, finetune_batch=2,
                             corpus_bytes=200_000)
    out = P.run_extrapolation(run)
    by = {(r["scheme"], r["eval_length"], r["position_start"]): r["loss"] for r in out["rows"]}
    assert {s for s, _, _ in by} == {"rope", "pi", "rope+ft", "pi+ft", "yarn+ft"}
    assert out["seconds"]["finetune"] > 0
    # Fine-tuning moved the weights: at the trained length the control reads differently from RoPE.
    assert by[("rope+ft", 8, 0)] != pytest.approx(by[("rope", 8, 0)], rel=1e-6)


def test_training_lowers_the_held_out_loss():
    run = P.ExtrapolationRun(model=SMALL, train_length=16, steps=60, batch=16, lr=3e-3, seeds=(0,), eval_windows=8,
                             bucket=16, eval_multiples=(1,), trained=("rope",), extensions=(), corpus_bytes=300_000)
    trained = P.summarize(P.run_extrapolation(run)["rows"], 16)[0]["loss"]
    # An untrained model predicts bytes about uniformly: ln(256) = 5.5 nats. Sixty steps
    # learn at least the byte frequencies of source code (its unigram entropy is ~3.5).
    assert trained < 4.5, trained


@pytest.mark.parametrize("changes, match", [
    (dict(bucket=3), "bucket"),
    (dict(model=CONFIG.__class__(**{**CONFIG.__dict__, "vocab_size": 300})), "vocab_size must be 256"),
    (dict(trained=("nope",)), "put 'rope' in trained"),
    (dict(trained=("t5",)), "each trained scheme"),
    (dict(seeds=()), "at least one seed"),
    (dict(steps=0), "steps must be positive"),
    (dict(finetune_steps=-1), "finetune_steps"),
    (dict(finetuned=("alibi",)), "each fine-tuned scheme"),
])
def test_extrapolation_run_refuses_bad_settings(changes, match):
    settings = dict(model=SMALL, train_length=8, steps=3, batch=4, lr=1e-3, seeds=(0,), eval_windows=3, bucket=4)
    with pytest.raises((TypeError, ValueError), match=match):
        P.ExtrapolationRun(**{**settings, **changes})


def test_benchmark_is_registered_for_the_chapter():
    bench = benchmarks.get("positional.extrapolation")
    assert bench.chapter == "positional-encodings"


def test_causal_attention_without_positions_is_permutation_equivariant_without_the_mask():
    # The premise of the chapter: attention alone cannot see order. Permuting the tokens of
    # unmasked attention permutes its outputs and changes nothing else.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    perm = torch.randperm(9, generator=g)
    out = F.scaled_dot_product_attention(x, x, x)
    check.assert_close(F.scaled_dot_product_attention(x[:, :, perm], x[:, :, perm], x[:, :, perm]), out[:, :, perm],
                       tol=1e-12, name="attention(P x) = P attention(x)")
