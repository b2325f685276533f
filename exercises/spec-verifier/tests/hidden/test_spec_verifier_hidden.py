"""Hidden tests of spec-verifier: the law of what the verifier emits, on fresh random distributions.

Every test draws the drafts from the draft distributions itself and compares counts with
the exact law by a chi-square test (threshold 1e-5: a correct verifier fails one in
100,000 gradings). The first two tokens are tested jointly: with one draft the second
token is the bonus whenever the draft is kept; a row that emitted only one token gets its
second from the target, as the next step would.
"""

import torch

from labkit.grade.harness import public_module

public = public_module(__file__, "test_spec_verifier.py")
VOCAB = 5
THRESHOLD = 1e-5


def distributions(rows: int, gen: torch.Generator) -> torch.Tensor:
    return (1.5 * torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64)).softmax(-1)


def first_two(submission, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first two emitted tokens ``(y1, y2)`` and their exact law ``p1(y1) p2(y2 | y1)``."""
    gen = torch.Generator().manual_seed(seed)
    p1, q1 = distributions(1, gen)[0], distributions(1, gen)[0]
    p2, q2 = distributions(VOCAB, gen), distributions(VOCAB, gen)       # second position, given the first token
    p3 = distributions(1, gen)[0]
    x1 = torch.multinomial(q1, rows, replacement=True, generator=gen)
    x2 = torch.multinomial(q2[x1], 1, generator=gen)[:, 0]
    drafts = torch.stack([x1, x2], dim=1)[:, :k]
    q = torch.stack([q1.expand(rows, VOCAB), q2[x1]], dim=1)[:, :k]
    p = torch.stack([p1.expand(rows, VOCAB), p2[x1], p3.expand(rows, VOCAB)], dim=1)[:, :k + 1]
    n, token = submission.call("verify", drafts, q.contiguous(), p.contiguous(), seed + 1)
    y1 = torch.where(n >= 1, drafts[:, 0], token)
    second = torch.where(n >= 2, drafts[:, k - 1], token)
    completion = torch.multinomial(p2[y1], 1, generator=gen)[:, 0]
    y2 = torch.where(n >= 1, second, completion)
    return torch.bincount(y1 * VOCAB + y2, minlength=VOCAB * VOCAB), (p1[:, None] * p2).flatten()


def check_law(counts, law, what):
    p_value = public.chi_square_p_value(counts, law)
    expected = (law / law.sum() * counts.sum()).tolist()
    assert p_value > THRESHOLD, (f"{what}: the emitted tokens do not follow the target's law (chi-square p-value "
                                 f"{p_value:.2g}); counts {counts.tolist()}, expected {[round(e, 1) for e in expected]}")


def test_first_two_tokens_one_draft(submission):
    """k = 1, 100,000 steps on fresh distributions: (first token, second token) must follow
    p(y1) p(y2 | y1): the kept draft or the replacement, then the bonus."""
    counts, law = first_two(submission, 1, 100_000, seed=21)
    check_law(counts, law, "k = 1, first two tokens")


def test_first_two_tokens_two_drafts(submission):
    """k = 2, 100,000 steps: the second draft is judged only after the first was kept."""
    counts, law = first_two(submission, 2, 100_000, seed=31)
    check_law(counts, law, "k = 2, first two tokens")


def test_bonus_token_follows_the_last_target_distribution(submission):
    """Every draft kept (q = p at k = 3 positions): the token after them must follow p_(k+1)."""
    gen = torch.Generator().manual_seed(41)
    rows, k = 50_000, 3
    p = distributions(k + 1, gen)
    drafts = torch.stack([torch.multinomial(p[i], rows, replacement=True, generator=gen) for i in range(k)], dim=1)
    n, token = submission.call("verify", drafts, p[:k].expand(rows, k, VOCAB).contiguous(),
                               p.expand(rows, k + 1, VOCAB).contiguous(), 43)
    assert bool((n == k).all()), f"with q = p every draft must be kept; got counts {sorted(set(n.tolist()))}"
    check_law(torch.bincount(token, minlength=VOCAB), p[k], "the bonus token")


def test_replacement_follows_the_residual(submission):
    """The rejected rows' replacements must follow norm(max(0, p - q)); fresh p and q."""
    gen = torch.Generator().manual_seed(51)
    rows = 100_000
    p, q = distributions(1, gen)[0], distributions(1, gen)[0]
    drafts = torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]
    target = torch.stack([p, distributions(1, gen)[0]]).expand(rows, 2, VOCAB).contiguous()
    n, token = submission.call("verify", drafts, q.expand(rows, 1, VOCAB).contiguous(), target, 53)
    rejected = token[n == 0]
    assert rejected.numel() > 100, "too few rejections to test; p and q were nearly equal"
    check_law(torch.bincount(rejected, minlength=VOCAB), (p - q).clamp(min=0), "replacements after a rejection")


def test_acceptance_rate_is_sum_of_minima(submission):
    """A draft from q is kept with probability sum_x min(p(x), q(x)): the mean count for k = 1."""
    gen = torch.Generator().manual_seed(61)
    rows = 100_000
    p, q = distributions(1, gen)[0], distributions(1, gen)[0]
    drafts = torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]
    target = torch.stack([p, p]).expand(rows, 2, VOCAB).contiguous()
    n, _ = submission.call("verify", drafts, q.expand(rows, 1, VOCAB).contiguous(), target, 63)
    alpha = float(torch.minimum(p, q).sum())
    mean = float(n.double().mean())
    sigma = (alpha * (1 - alpha) / rows) ** 0.5
    assert abs(mean - alpha) < 5 * sigma + 1e-9, f"kept {mean:.4f} of the drafts; sum_x min(p, q) = {alpha:.4f}"
