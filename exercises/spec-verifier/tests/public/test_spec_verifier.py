"""Public tests of spec-verifier: what check() runs in the notebook.

Cases whose answer is certain (a draft equal to the target is always kept, a draft the
target gives no mass is never kept), and one small chi-square test of the first token. No
function here computes the verifier's answer: the hidden tests check the full law.
"""

import torch

VOCAB = 5


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test of ``counts`` against ``probs``; cells expected below ``min_expected`` are pooled
    (into the smallest other cell when the pool is still small). 0.0 when a count lands on zero mass."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    small = expected < min_expected
    observed, want = counts[~small], expected[~small]
    if bool(small.any()):
        if expected[small].sum() >= min_expected:
            observed = torch.cat([observed, counts[small].sum().view(1)])
            want = torch.cat([want, expected[small].sum().view(1)])
        else:
            i = int(want.argmin())
            observed[i] += counts[small].sum()
            want[i] += expected[small].sum()
    dof = want.numel() - 1
    if dof < 1:     # one cell holds all the mass, and every count landed in it
        return 1.0
    stat = float(((observed - want) ** 2 / want).sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def draws(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def test_outputs_are_counts_and_tokens(submission):
    """Two int64 tensors of shape [B]: counts in [0, k], tokens in [0, V)."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15]] * 3, dtype=torch.float64)
    q = torch.tensor([[0.3, 0.1, 0.2, 0.2, 0.2]] * 2, dtype=torch.float64)
    drafts = torch.tensor([[0, 2], [4, 4], [1, 3]])
    out = submission.call("verify", drafts, q.expand(3, 2, VOCAB), p.expand(3, 3, VOCAB), 0)
    assert isinstance(out, (tuple, list)) and len(out) == 2, "verify must return (num_accepted, next_token)"
    n, token = out
    for name, t, high in (("num_accepted", n, 2), ("next_token", token, VOCAB - 1)):
        assert isinstance(t, torch.Tensor) and t.shape == (3,) and t.dtype == torch.int64, \
            f"{name} must be an int64 tensor of shape [3], got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}"
        assert int(t.min()) >= 0 and int(t.max()) <= high, f"{name} must lie in [0, {high}], got {t.tolist()}"


def test_identical_draft_is_always_kept(submission):
    """Draft distributions equal to the target's: every draft is kept, and the bonus comes from
    p_(k+1), here all on token 3."""
    k, rows = 3, 200
    p = torch.tensor([0.05, 0.4, 0.2, 0.3, 0.05], dtype=torch.float64)
    drafts = draws(p, rows * k, seed=1).view(rows, k)
    last = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    target = torch.cat([p.expand(rows, k, VOCAB), last.expand(rows, 1, VOCAB)], dim=1)
    n, token = submission.call("verify", drafts, p.expand(rows, k, VOCAB), target, 3)
    assert bool((n == k).all()), f"with q = p every draft must be kept (n = {k}); got counts {sorted(set(n.tolist()))}"
    assert bool((token == 3).all()), f"the bonus must come from p_(k+1), all mass on token 3; got {sorted(set(token.tolist()))}"


def test_draft_without_target_mass_is_replaced(submission):
    """The target gives the draft's token no mass: never kept; the residual max(0, p - q) is all
    on token 0, so the replacement is 0."""
    rows = 300
    p = torch.tensor([0.7, 0.0, 0.3, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.6, 0.4, 0.0, 0.0], dtype=torch.float64)
    drafts = torch.ones(rows, 1, dtype=torch.int64)   # token 1: q = 0.6, p = 0
    target = torch.stack([p, torch.full((VOCAB,), 0.2, dtype=torch.float64)]).expand(rows, 2, VOCAB)
    n, token = submission.call("verify", drafts, q.expand(rows, 1, VOCAB), target, 5)
    assert bool((n == 0).all()), f"a draft with p(x) = 0 is never kept; got counts {sorted(set(n.tolist()))}"
    assert bool((token == 0).all()), \
        f"max(0, p - q) = [0.7, 0, 0, 0, 0]: the replacement must be token 0; got {sorted(set(token.tolist()))}"


def test_counting_stops_at_the_first_rejection(submission):
    """Three drafts: the first always kept (q = p), the second never (p(x) = 0), the third would be
    kept if it were reached: exactly one draft counts."""
    rows = 200
    p = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    no_two = torch.tensor([0.25, 0.25, 0.0, 0.25, 0.25], dtype=torch.float64)
    drafts = torch.tensor([[1, 2, 4]] * rows)
    q = torch.stack([p, torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64), p]).expand(rows, 3, VOCAB)
    target = torch.stack([p, no_two, p, p]).expand(rows, 4, VOCAB)
    n, token = submission.call("verify", drafts, q, target, 7)
    assert bool((n == 1).all()), f"the second draft is always rejected, so every row keeps 1; got {sorted(set(n.tolist()))}"
    assert bool((token != 2).all()), "the replacement of the second draft comes from max(0, p - q), which has no mass on 2"


def test_first_token_follows_the_target(submission):
    """One draft drawn from q, 40,000 times: the first emitted token (the kept draft or the
    replacement) must follow p. A chi-square test; a correct verifier fails it once in 100,000."""
    rows = 40_000
    p = torch.tensor([0.5, 0.05, 0.2, 0.05, 0.2], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)
    drafts = draws(q, rows, seed=11)[:, None]
    target = torch.stack([p, torch.full((VOCAB,), 0.2, dtype=torch.float64)]).expand(rows, 2, VOCAB)
    n, token = submission.call("verify", drafts, q.expand(rows, 1, VOCAB), target, 13)
    first = torch.where(n >= 1, drafts[:, 0], token)
    counts = torch.bincount(first, minlength=VOCAB)
    p_value = chi_square_p_value(counts, p)
    assert p_value > 1e-5, (f"first tokens {(counts / rows).tolist()} do not follow p = {p.tolist()} "
                            f"(chi-square p-value {p_value:.2g})")
