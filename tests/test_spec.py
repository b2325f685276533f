"""labkit.spec: the verifier's output law, the closed forms, the runner, the loops, the training pieces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit import models, serve, spec
from labkit.spec.draft import TARGET_CPU, TrainPlan, train_model
from labkit.spec.exactness import first_two_tokens, first_two_tokens_on_tables, random_distributions
from labkit.spec.verify import exponential_race, leading_true, race_winner, residual

V = 7


def _distributions(rows: int, seed: int) -> torch.Tensor:
    return random_distributions(rows, V, torch.Generator().manual_seed(seed))


def _first_two(k: int, samples: int, seed: int, verify=spec.verify):
    return first_two_tokens_on_tables(verify, k=k, vocab=V, samples=samples, seed=seed)


@pytest.mark.parametrize("k", [1, 2])
def test_verifier_output_is_the_targets_law(k):
    counts, law = _first_two(k, 60_000, seed=10 * k)
    assert spec.chi_square_test(counts, law).p_value > 1e-3


def _verify_variant(accept_probability, replacement):
    """A verifier with one rule changed, to show the chi-square test catches it."""
    def verify(drafts, draft_probs, target_probs, gen):
        k = drafts.shape[1]
        index = drafts.unsqueeze(-1)
        p, q = target_probs[:, :k].gather(-1, index)[..., 0], draft_probs.gather(-1, index)[..., 0]
        n = leading_true(torch.rand(p.shape, generator=gen, dtype=p.dtype) < accept_probability(p, q))
        rows = torch.cat([replacement(target_probs[:, :k], draft_probs), target_probs[:, k:]], dim=1)
        return spec.Verdict(n, exponential_race(rows[torch.arange(len(n)), n], gen))
    return verify


@pytest.mark.parametrize("name,variant", [
    ("resample from p", _verify_variant(lambda p, q: p / q, lambda p, q: p)),
    ("accept with probability p(x)", _verify_variant(lambda p, q: p, residual)),
    ("accept with min(1, q/p)", _verify_variant(lambda p, q: q / p, residual)),
])
def test_chi_square_catches_wrong_rules(name, variant):
    counts, law = _first_two(1, 60_000, seed=10, verify=variant)
    assert spec.chi_square_test(counts, law).p_value < 1e-6, name


def test_the_correct_variant_passes_the_same_test():
    """The harness of the test above, with the right rules, passes: the failures are the rules'."""
    counts, law = _first_two(1, 60_000, seed=10, verify=_verify_variant(lambda p, q: p / q, residual))
    assert spec.chi_square_test(counts, law).p_value > 1e-3


def test_acceptance_matches_sum_of_minima():
    """Drafts drawn from q survive with probability sum_x min(p, q) (one position)."""
    p, q = _distributions(1, 3)[0], _distributions(1, 4)[0]
    gen = torch.Generator().manual_seed(0)
    samples = 100_000
    x = torch.multinomial(q, samples, replacement=True, generator=gen)[:, None]
    verdict = spec.verify(x, q.expand(samples, 1, V), torch.stack([p, p]).expand(samples, 2, V), gen)
    alpha = float(spec.acceptance_rate(p, q))
    assert abs(verdict.num_accepted.double().mean().item() - alpha) < 4 * (alpha * (1 - alpha) / samples) ** 0.5


def test_identical_draft_is_always_accepted_and_gets_the_bonus():
    p = _distributions(4, 5)
    drafts = torch.multinomial(p[:3], 1)[:, 0][None]
    verdict = spec.verify(drafts, p[None, :3], p[None], torch.Generator().manual_seed(1))
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.emitted(drafts)[:3] == drafts[0].tolist()


def test_greedy_verifier_keeps_the_matching_prefix():
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1)
    drafts = best[:, :3].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % V           # row 0: the second draft is wrong
    verdict = spec.verify(drafts, None, logits)
    assert verdict.num_accepted.tolist() == [1, 3]
    assert verdict.next_token.tolist() == [best[0, 1].item(), best[1, 3].item()]


def test_verify_rejects_bad_arguments():
    p = _distributions(3, 1)[None]
    drafts = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match=r"\[B, k \+ 1, V\]"):
        spec.verify(drafts, p[:, :2], p[:, :2])
    with pytest.raises(ValueError, match="token ids"):
        spec.verify(torch.tensor([[0, V]]), p[:, :2], p)
    with pytest.raises(ValueError, match="draft_probs"):
        spec.verify(drafts, p, p)
    with pytest.raises(TypeError, match="draft_tokens"):
        spec.verify(drafts.float(), p[:, :2], p)
    zero = p[:, :2].clone()
    zero[0, 0, 0] = 0
    with pytest.raises(ValueError, match="positive probability"):
        spec.verify(drafts, zero, p)


def test_closed_form_matches_the_sum_and_simulation():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in (0, 1, 4):
            assert spec.expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    gen = torch.Generator().manual_seed(0)
    accepts = torch.rand(200_000, 4, generator=gen) < 0.7
    emitted = leading_true(accepts) + 1
    assert emitted.double().mean().item() == pytest.approx(spec.expected_tokens(0.7, 4), rel=0.01)
    assert spec.estimate_alpha(leading_true(accepts), 4) == pytest.approx(0.7, abs=0.01)


def test_best_k_trades_drafts_against_their_cost():
    assert spec.best_k(0.0, 0.1) == 0                     # nothing accepted: do not speculate
    assert spec.best_k(0.9, 0.0, k_max=12) == 12          # free drafts: as many as allowed
    k = spec.best_k(0.8, 0.05)
    assert spec.expected_speedup(0.8, k, 0.05) >= max(spec.expected_speedup(0.8, j, 0.05) for j in range(33))
    assert spec.best_k(0.8, 0.3) < k                       # dearer drafts: fewer of them


def test_closed_form_rejects_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        spec.expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match="k"):
        spec.expected_tokens(0.5, -1)
    with pytest.raises(ValueError, match="draft_cost"):
        spec.expected_speedup(0.5, 2, float("nan"))
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        spec.estimate_alpha([0, 3], 2)


def test_chi_square_p_value_and_pooling():
    probs = torch.tensor([0.5, 0.3, 0.2, 1e-6])
    exact = spec.chi_square_test(torch.tensor([500, 300, 200, 0]), probs)
    assert exact.statistic == pytest.approx(0.0, abs=1e-3) and exact.p_value > 0.99
    assert exact.cells == 3                                  # the tiny cell joined the smallest other one
    shifted = spec.chi_square_test(torch.tensor([600, 250, 150, 0]), probs)
    assert shifted.p_value < 1e-6
    assert spec.chi_square_test(torch.tensor([10, 0, 0, 1]), torch.tensor([0.5, 0.5, 0.0, 0.0])).p_value == 0.0
    with pytest.raises(ValueError, match="shape"):
        spec.chi_square_test(torch.tensor([1, 2]), torch.tensor([1.0]))


def _tiny(config, seed):
    return models.Decoder(config, seed=seed, init_std=0.3).eval()


def test_runner_steps_match_the_decoder():
    """Prefill, a step of 3 tokens, a rejection of 2, then a step over stale positions: the logits of a
    full forward over the kept sequence, every time."""
    model = _tiny(spec.TARGET_CPU, 0)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))
    runner = spec.StepRunner(model, 32, (1, 3))
    torch.testing.assert_close(runner.prefill(ids[:9]), model(ids[None, :9])[0])
    torch.testing.assert_close(runner.step(ids[9:12]), model(ids[None, :12])[0, 9:])
    runner.truncate(10)                                       # ids[10:12] rejected
    other = torch.tensor([5, 6, 7])
    kept = torch.cat([ids[:10], other])
    torch.testing.assert_close(runner.step(other), model(kept[None])[0, 10:])
    torch.testing.assert_close(runner.step(ids[:1]), model(torch.cat([kept, ids[:1]])[None])[0, 13:])


def test_runner_rejects_bad_arguments():
    model = _tiny(spec.TARGET_CPU, 0)
    with pytest.raises(TypeError, match="Decoder"):
        spec.StepRunner(torch.nn.Linear(2, 2), 8)
    with pytest.raises(TypeError, match="query_counts"):
        spec.StepRunner(model, 8, [1])
    with pytest.raises(ValueError, match="CUDA"):
        spec.StepRunner(model, 8, (1,), use_graph=True)
    runner = spec.StepRunner(model, 8, (1,))
    runner.prefill(torch.arange(6))
    with pytest.raises(ValueError, match="capacity"):
        runner.step(torch.arange(3))
    with pytest.raises(ValueError, match="length"):
        runner.truncate(7)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_is_greedy_decoding(k):
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    prompt = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(k))
    reference = models.generate_greedy(target, prompt[None], 20).tokens[0].tolist()
    assert spec.generate_plain(spec.StepRunner(target, 48), prompt, 20) == reference
    out = spec.generate_speculative(spec.StepRunner(target, 48, (1, k + 1)), spec.StepRunner(draft, 48), prompt,
                                    20, k=k)
    assert out.tokens == reference
    self_drafted = spec.generate_speculative(spec.StepRunner(target, 48, (1, k + 1)), spec.StepRunner(target, 48),
                                             prompt, 20, k=k)
    assert self_drafted.tokens == reference and set(self_drafted.accepted) == {k}


def test_sampled_speculative_first_two_tokens_are_the_targets():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    prompt = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(0))
    result = first_two_tokens(target, draft, prompt, k=2, samples=3000, generator=torch.Generator().manual_seed(4))
    assert result.test.p_value > 1e-3
    assert result.counts.sum() == 3000


def test_first_two_tokens_rejects_bad_arguments():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    with pytest.raises(ValueError, match="temperature"):
        first_two_tokens(target, draft, torch.arange(3), k=1, samples=10, temperature=0.0)
    with pytest.raises(TypeError, match="Decoders"):
        first_two_tokens(target, None, torch.arange(3), k=1, samples=10)
    with pytest.raises(ValueError, match="k must be 1 or 2"):
        first_two_tokens_on_tables(spec.verify, k=3, vocab=V, samples=10, seed=0)


def test_sampled_loop_runs_and_draws_from_its_generator():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    prompt = torch.arange(5)

    def run(seed):
        return spec.generate_speculative(spec.StepRunner(target, 48, (1, 3)), spec.StepRunner(draft, 48), prompt,
                                         20, k=2, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    first, again = run(0), run(0)
    assert first.tokens == again.tokens and len(first.tokens) == 20
    assert all(0 <= n <= 2 for n in first.accepted)


def test_loops_reject_bad_arguments():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    runner = spec.StepRunner(target, 16, (1, 3))
    with pytest.raises(ValueError, match="capacity"):
        spec.generate_speculative(runner, spec.StepRunner(draft, 16), torch.arange(8), 8, k=2)
    with pytest.raises(ValueError, match="temperature"):
        spec.generate_plain(runner, torch.arange(3), 4, temperature=-1.0)
    with pytest.raises(ValueError, match="vocabulary"):
        spec.generate_speculative(runner, spec.StepRunner(models.Decoder(models.TINY), 16), torch.arange(3), 4, k=2)


def test_distillation_loss_is_zero_for_the_teacher_and_trains():
    teacher = _tiny(spec.DRAFT_CPU, 1)
    loss = spec.distillation_loss(teacher)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    assert loss(teacher, ids).item() == pytest.approx(0.0, abs=1e-6)
    student = models.Decoder(spec.DRAFT_CPU, seed=5)
    before = loss(student, ids).item()
    models.train_lm(student, lambda step: ids, steps=20, lr=1e-2, progress=False, loss_fn=loss)
    assert loss(student, ids).item() < 0.5 * before
    with pytest.raises(TypeError, match="teacher"):
        spec.distillation_loss("model")
    with pytest.raises(TypeError, match="loss_fn"):
        models.train_lm(student, lambda step: ids, steps=1, lr=1e-3, loss_fn="kl")


def test_bf16_training_runs_each_forward_on_the_current_weights():
    """Autocast caches its bf16 copy of a weight until its context exits: train_model enters it
    per forward, so every step's matmuls use the weights the optimizer has just updated (a
    context around the whole loop would run every step on the first step's weights)."""
    model = models.Decoder(TARGET_CPU, seed=0)
    gate = model.blocks[0].mlp.gate
    drift = []

    def compare(module, inputs, out):
        with torch.autocast("cpu", enabled=False):
            fresh = F.linear(inputs[0].to(torch.bfloat16), module.weight.detach().to(torch.bfloat16))
        drift.append((out.detach().float() - fresh.float()).abs().max().item())

    gate.register_forward_hook(compare)
    text = torch.randint(0, 256, (4000,), dtype=torch.uint8)
    train_model(model, text, TrainPlan(batch=2, length=16, lr=1e-2, steps=4), seed=0, bf16=True)
    assert len(drift) == 4 and max(drift) == 0.0


def test_as_dtype_keeps_the_function():
    model = _tiny(spec.DRAFT_CPU, 3)
    copy = spec.as_dtype(model, torch.float64)
    ids = torch.arange(10)[None]
    assert copy.embed.weight.dtype == torch.float64 and copy.rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(copy(ids).float(), model(ids), rtol=1e-4, atol=1e-4)


def test_stop_token_ends_the_generation():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    prompt = torch.arange(4)
    full = spec.generate_plain(spec.StepRunner(target, 64), prompt, 30)
    stop = full[7]
    out = spec.generate_speculative(spec.StepRunner(target, 64, (1, 4)), spec.StepRunner(draft, 64), prompt, 30,
                                    k=3, stop_token_ids=(stop,))
    assert out.tokens == full[:full.index(stop) + 1]


def test_speculative_llm_serves_the_paged_engines_greedy_tokens():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10]]
    greedy = serve.SamplingParams(max_tokens=12)
    engine = serve.LLM(target, num_blocks=64, block_size=8)
    reference = engine.generate(prompts, greedy)
    llm = serve.SpeculativeLLM(target, draft, num_speculative_tokens=3, max_model_len=64)
    outputs = llm.generate(prompts, greedy)
    assert [o.tokens for o in outputs] == [r.tokens for r in reference]
    assert [o.finish_reason for o in outputs] == ["length"] * 2 and len(llm.steps) == 2
    stop = reference[1].tokens[4]
    with_stop = serve.SamplingParams(max_tokens=12, stop_token_ids=(stop,))
    stopped = llm.generate(prompts[1:2], with_stop)[0]
    assert stopped.tokens == engine.generate(prompts[1:2], with_stop)[0].tokens
    assert stopped.finish_reason == "stop"


def test_speculative_llm_sampling_is_seeded_and_rejects_what_it_cannot_serve():
    target, draft = _tiny(spec.TARGET_CPU, 1), _tiny(spec.DRAFT_CPU, 2)
    llm = serve.SpeculativeLLM(target, draft, num_speculative_tokens=2, max_model_len=32)
    seeded = serve.SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    assert llm.generate([[1, 2]], seeded)[0].tokens == llm.generate([[1, 2]], seeded)[0].tokens
    outputs = llm.generate([[1], [1], [300], [1] * 30],
                           [serve.SamplingParams(top_k=3), serve.SamplingParams(n=2), serve.SamplingParams(),
                            serve.SamplingParams(max_tokens=8)])
    assert [o.finish_reason for o in outputs] == ["error"] * 4
    assert "top_k" in outputs[0].error and "n=2" in outputs[1].error
    assert "[0, 256)" in outputs[2].error and "max_model_len" in outputs[3].error
    with pytest.raises(ValueError, match="vocabulary"):
        serve.SpeculativeLLM(target, models.Decoder(models.TINY), max_model_len=32)
    with pytest.raises(TypeError, match="draft"):
        serve.SpeculativeLLM(target, "draft")


@pytest.mark.gpu
def test_graphed_steps_match_eager_steps():
    """On a GPU: every step count replayed from its CUDA graph gives the eager step's logits."""
    model = models.Decoder(spec.TARGET_CPU, device="cuda", seed=0, init_std=0.3).eval()
    ids = torch.randint(0, 256, (40,), device="cuda")
    graphed, eager = spec.StepRunner(model, 64, (1, 4)), spec.StepRunner(model, 64, (1, 4), use_graph=False)
    assert graphed.use_graph
    for runner in (graphed, eager):
        runner.prefill(ids[:20])
    for start, n in ((20, 4), (24, 1), (25, 4), (29, 1)):
        torch.testing.assert_close(graphed.step(ids[start:start + n]).clone(), eager.step(ids[start:start + n]))
    graphed.truncate(22), eager.truncate(22)
    torch.testing.assert_close(graphed.step(ids[30:34]).clone(), eager.step(ids[30:34]))


def test_race_winner_never_picks_a_zero_weight_when_noise_is_zero():
    """Exponential noise of exactly 0 (possible on the CPU) must not let a zero weight win:
    0 / 0 is NaN, and argmax picks NaN."""
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 3.0, 0.0]])
    noise = torch.tensor([[0.0, 0.5, 0.0, 8.0], [0.0, 1.0, 0.0, 0.0]])
    assert race_winner(weights, noise.clone()).tolist() == [1, 2]
    assert torch.isnan(weights / noise).any()  # what the clamp guards against
