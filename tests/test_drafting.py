"""labkit.drafting: tree masks against per-branch forwards, tree verification = greedy, n-grams, Jacobi, heads."""

from __future__ import annotations

import random

import pytest
import torch

from labkit import drafting, models, spec

CONFIG = models.DecoderConfig(vocab_size=61, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                              intermediate_size=72, rope_theta=10_000.0, tie_word_embeddings=True)


def _model(seed: int = 0) -> models.Decoder:
    # A larger init than the default, so greedy decoding varies and a wrong mask shows.
    return models.Decoder(CONFIG, seed=seed, init_std=0.3).eval()


def _random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _ancestors(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_mask_and_depths_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        parents = _random_parents(rng.randrange(1, 15), rng)
        mask, depth = drafting.tree_mask(parents), drafting.tree_depths(parents)
        for i in range(len(parents)):
            anc = _ancestors(parents, i)
            assert mask[i].nonzero().flatten().tolist() == sorted(anc)
            assert depth[i] == len(anc) - 1
        assert drafting.parents_from_mask(mask) == parents


def test_tree_step_logits_equal_each_branchs_own_forward():
    """Every node's logits under the tree mask = a plain forward over the prefix and its own path."""
    torch.manual_seed(0)
    model = _model()
    rng = random.Random(1)
    prefix = torch.randint(0, CONFIG.vocab_size, (9,))
    for _ in range(3):
        parents = _random_parents(11, rng)
        tokens = torch.randint(0, CONFIG.vocab_size, (len(parents),))
        runner = drafting.TreeRunner(model, 64, (len(parents),))
        runner.prefill_hidden(prefix)
        logits, hidden = runner.tree_step(tokens, drafting.tree_depths(parents), drafting.tree_mask(parents))
        for i in range(len(parents)):
            ids = torch.cat([prefix, tokens[_ancestors(parents, i)]])
            ref = model(ids[None])[0, -1]
            spec_close = torch.allclose(logits[i], ref, atol=1e-4, rtol=1e-4)
            assert spec_close, (i, (logits[i] - ref).abs().max())


def test_commit_keeps_a_path_as_if_it_had_been_decoded():
    model = _model()
    prefix = torch.randint(0, CONFIG.vocab_size, (7,), generator=torch.Generator().manual_seed(2))
    parents = [-1, 0, 0, 1, 2, 2, 5]
    tokens = torch.randint(0, CONFIG.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    runner = drafting.TreeRunner(model, 64, (7,))
    runner.prefill_hidden(prefix)
    runner.tree_step(tokens, drafting.tree_depths(parents), drafting.tree_mask(parents))
    path = torch.tensor([0, 2, 5, 6])
    runner.commit(path, 4)
    assert runner.length == 11
    nxt = torch.tensor([5])
    after = runner.step(nxt)[0]
    ids = torch.cat([prefix, tokens[path], nxt])
    torch.testing.assert_close(after, model(ids[None])[0, -1], atol=1e-4, rtol=1e-4)


def test_greedy_accept_takes_the_deepest_matching_path():
    parents = [-1, 0, 0, 1, 2, 3]
    mask, depth = drafting.tree_mask(parents), drafting.tree_depths(parents)
    tokens = torch.tensor([9, 4, 5, 6, 7, 8])
    # Target argmax at each node: root wants 5 (node 2), node 2 wants 7 (node 4), node 4 wants 3 (no child).
    argmax = torch.tensor([5, 6, 7, 0, 3, 0])
    best, path = drafting.greedy_accept(tokens, mask, depth, argmax, max_depth=3)
    assert int(best) == 4 and path[:3].tolist() == [0, 2, 4]
    argmax = torch.tensor([1, 6, 7, 0, 3, 0])  # root wants 1: nothing kept
    best, _ = drafting.greedy_accept(tokens, mask, depth, argmax, max_depth=3)
    assert int(best) == 0


def test_tree_from_choices_and_best_choices():
    tree = drafting.tree_from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.ranks == (0, 0, 1, 0, 1, 0, 0)
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]])
    chosen = drafting.best_choices(accuracy, 5)
    assert chosen[:3] == [(0,), (0, 0), (1,)]
    assert all(c[:-1] in chosen for c in chosen if len(c) > 1)  # a tree: every prefix is in
    assert drafting.chain(3).parents == (-1, 0, 1, 2)


def test_prompt_lookup():
    context = [1, 2, 3, 4, 5, 9, 2, 3]
    assert drafting.prompt_lookup(context, 3) == [4, 5, 9]           # "2 3" occurred before: 4 5 9 followed
    assert drafting.prompt_lookup([1, 2, 3], 2) == []                 # nothing repeats
    assert drafting.prompt_lookup([7, 1, 7, 2, 7], 2, max_ngram=1) == [2, 7]   # the latest occurrence


def test_ngram_pool_reads_diagonals():
    pool = drafting.NGramPool(3, per_key=2)
    pool.add_level({10: 1, 11: 2, 12: 3})
    pool.add_level({11: 4, 12: 5, 13: 6})
    pool.add_level({12: 7, 13: 8, 14: 9})
    assert pool.lookup(1) == [(4, 7)]   # 1 at 10 (oldest iterate), 4 at 11 (next), 7 at 12 (newest)
    assert pool.lookup(2) == [(5, 8)]


def test_jacobi_fixed_point_is_greedy():
    model = _model(seed=4)
    prompt = torch.randint(0, CONFIG.vocab_size, (6,), generator=torch.Generator().manual_seed(5))
    greedy = models.generate_greedy(model, prompt[None], 10).tokens[0].tolist()
    tokens, iterations = drafting.jacobi_decode(model, prompt, 10)
    assert tokens == greedy and iterations <= 11


@pytest.fixture(scope="module")
def trained():
    text, held = models.stdlib_corpus(300_000)
    target = models.Decoder(spec.TARGET_CPU, seed=0)
    spec.train_model(target, text, spec.TrainPlan(batch=8, length=48, lr=3e-3, steps=30), seed=0)
    target.eval().requires_grad_(False)
    plan = spec.TrainPlan(batch=8, length=48, lr=3e-3, steps=30)
    ids = models.random_windows(held, 16, 49, torch.Generator().manual_seed(0))  # held-out, fixed
    losses = {}
    heads, eagle = drafting.MedusaHeads(spec.TARGET_CPU.hidden_size, 3), drafting.EagleHead(spec.TARGET_CPU)
    for name, module, loss_fn in (("medusa", heads, drafting.medusa_loss(target)),
                                  ("eagle", eagle, drafting.eagle_loss(target))):
        with torch.no_grad():
            before = float(loss_fn(module, ids))
        spec.train_model(module, text, plan, seed=1, loss_fn=loss_fn)
        with torch.no_grad():
            torch.manual_seed(0)
            losses[name] = (before, float(loss_fn(module, ids)))
    return target, heads.eval(), eagle.eval(), losses, held


def test_medusa_and_eagle_training_decrease_the_held_out_loss(trained):
    losses = trained[3]
    for name, (before, after) in losses.items():
        assert after < before, (name, before, after)


def test_every_proposer_reproduces_greedy_decoding(trained):
    target, heads, eagle, *_, held = trained
    prompt = models.random_windows(held, 1, 20, torch.Generator().manual_seed(3))[0]
    greedy = models.generate_greedy(target, prompt[None], 30).tokens[0].tolist()
    tree = drafting.tree_from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    proposers = [drafting.MedusaProposer(heads, target.lm_head.weight, tree),
                 drafting.EagleProposer(eagle, target, 160, depth=3, width=2, total=6),
                 drafting.PromptLookupProposer(3, "cpu"),
                 drafting.LookaheadProposer(3, 3, 2, "cpu")]
    for proposer in proposers:
        out = drafting.generate_tree(drafting.TreeRunner(target, 128, (proposer.tree_size,)), proposer, prompt, 30)
        assert out.tokens == greedy, proposer.name
        assert 1.0 <= out.tokens_per_step <= proposer.max_depth + 1


def test_head_accuracy_shape(trained):
    target, heads, *_, held = trained
    acc = drafting.head_accuracy(heads, target, models.random_windows(held, 4, 32, torch.Generator()), 3)
    assert acc.shape == (3, 3) and bool(((acc >= 0) & (acc <= 1)).all())


def test_errors():
    with pytest.raises(ValueError, match="parents\\[0\\] must be -1"):
        drafting.tree_mask([0, 0])
    with pytest.raises(ValueError, match="a node before it"):
        drafting.tree_mask([-1, 1])
    with pytest.raises(ValueError, match="no parent"):
        drafting.tree_from_choices([(0, 0)])
    with pytest.raises(ValueError, match="size must be"):
        drafting.best_choices(torch.rand(2, 2), 0)
    with pytest.raises(ValueError, match="min_ngram"):
        drafting.prompt_lookup([1, 2], 2, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="n >= 2"):
        drafting.NGramPool(1, 2)
    model = _model()
    runner = drafting.TreeRunner(model, 32, (3,))
    runner.prefill_hidden(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="needs depth"):
        runner.tree_step(torch.tensor([1, 2, 3]), torch.tensor([0, 1]), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="count must be"):
        runner.commit(torch.tensor([0, 1]), 3)
    with pytest.raises(TypeError, match="MedusaHeads"):
        drafting.MedusaProposer(object(), model.lm_head.weight, drafting.chain(2))
    with pytest.raises(ValueError, match="needs 3 heads"):
        drafting.MedusaProposer(drafting.MedusaHeads(48, 2), model.lm_head.weight, drafting.chain(3))
    with pytest.raises(ValueError, match="total must be"):
        drafting.EagleProposer(drafting.EagleHead(CONFIG), model, 64, depth=2, width=2, total=99)
    with pytest.raises(TypeError, match="Proposer"):
        drafting.generate_tree(runner, object(), torch.tensor([1]), 4)
    with pytest.raises(TypeError, match="Decoder"):
        drafting.medusa_loss(object())


@pytest.mark.gpu
def test_graphed_tree_steps_and_drafts_match_eager(trained):
    """On a GPU: the graphed tree step and the graphed Medusa/EAGLE drafting give the eager outputs."""
    target, heads, eagle, *_, held = trained
    target = target.cuda()
    heads, eagle = heads.cuda(), eagle.cuda()
    prompt = models.random_windows(held, 1, 20, torch.Generator().manual_seed(3))[0].cuda()
    tree = drafting.tree_from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    for make in (lambda g: drafting.MedusaProposer(heads, target.lm_head.weight, tree, use_graph=g),
                 lambda g: drafting.EagleProposer(eagle, target, 160, depth=3, width=2, total=6, use_graph=g)):
        outs = []
        for graphs in (True, False):
            proposer = make(graphs)
            runner = drafting.TreeRunner(target, 128, (proposer.tree_size,), use_graph=graphs)
            outs.append(drafting.generate_tree(runner, proposer, prompt, 30))
        assert outs[0].tokens == outs[1].tokens and outs[0].accepted == outs[1].accepted
