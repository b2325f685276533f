"""Prefix caching (labkit.serve.prefix_cache): the radix tree and the hash index on their own,
the engine with each (outputs token-identical to caching off, under eviction, preemption and
chunked prefill; no block leaked), and the multi-turn agent trace that measures them."""

from __future__ import annotations

import random

import pytest
import torch

import labkit  # noqa: F401  (sets the interpreter flag before anything imports triton)
from labkit import models, serve
from labkit.serve import context_economics as econ
from labkit.serve import conversation, long_context
from labkit.serve.prefix_cache import POLICIES, CachingBlockManager, HashCache, RadixCache

VOCAB = models.TINY.vocab_size


@pytest.fixture(scope="module")
def model() -> models.Decoder:
    return models.Decoder(models.TINY, seed=31, init_std=0.1)  # wide enough that tokens vary


def cache_over(policy: str, num_blocks: int = 32, block_size: int = 4):
    manager = serve.BlockManager(num_blocks, block_size)
    return manager, {"radix": RadixCache, "hash": HashCache}[policy](manager)


def filled(manager: serve.BlockManager, tokens: list[int]) -> list[int]:
    """A table for ``tokens`` as a finished request leaves it (its own references dropped later)."""
    return manager.allocate(len(tokens))


# -- the caches alone ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_match_finds_the_longest_cached_prefix_of_whole_blocks(policy):
    manager, cache = cache_over(policy)
    tokens = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens
    table = filled(manager, tokens)
    assert cache.insert(tokens, table) == 3  # the partial last block is never cached
    assert [manager.ref_counts[b] for b in table] == [2, 2, 2, 1]
    assert cache.match(tokens + [7, 7]) == table[:3]
    assert cache.match(tokens[:9] + [0] * 5) == table[:2]   # diverges inside block 2
    assert cache.match([5] + tokens[1:]) == []              # diverges in block 0
    # Never the whole prompt: its last token must run through the model.
    assert cache.match(tokens[:12]) == table[:2]
    assert cache.match(tokens[:13]) == table[:3]
    assert cache.insert(tokens, table) == 0                 # inserting again adds nothing
    assert cache.hit_tokens == cache.queried_tokens == 0    # lookups alone count nothing: admissions do
    shared = cache.claim(17, table[:3])
    assert shared == table[:3] and [manager.ref_counts[b] for b in table] == [3, 3, 3, 1]
    assert (cache.hit_tokens, cache.queried_tokens, cache.hit_rate) == (12, 17, 12 / 17)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_computed_twice_keeps_the_cached_blocks(policy):
    manager, cache = cache_over(policy)
    tokens = list(range(8))
    first, second = filled(manager, tokens), filled(manager, tokens)
    cache.insert(tokens, first)
    assert cache.insert(tokens, second) == 0
    assert cache.match(tokens + [1]) == first
    assert [manager.ref_counts[b] for b in second] == [1, 1]  # the duplicate stays the request's own


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_is_least_recently_used_and_spares_referenced_blocks(policy):
    manager, cache = cache_over(policy)
    old, new, held = [1] * 8, [2] * 8, [3] * 8
    tables = {}
    for name, tokens in (("old", old), ("new", new), ("held", held)):
        tables[name] = filled(manager, tokens)
        cache.insert(tokens, tables[name])
    for name in ("old", "new"):
        manager.free(list(tables[name]))  # those requests finished; "held" is still running
    cache.match(new + [0])  # touched last
    assert cache.num_evictable == 4
    assert cache.evict(2) == 2
    assert cache.match(old + [0]) == [] and cache.match(new + [0]) == tables["new"]
    assert cache.evict(10) == 2 and cache.evicted_blocks == 4
    assert cache.match(held + [0]) == tables["held"]  # referenced by its request: never evicted
    assert manager.num_free == 32 - 2


def test_radix_tree_splits_where_prompts_diverge_and_evicts_leaves_first():
    manager, cache = cache_over("radix")
    system = list(range(8))
    a, b = system + [10] * 8, system + [20] * 8
    ta, tb = filled(manager, a), filled(manager, b)
    cache.insert(a, ta)
    cache.insert(b, tb)  # shares the system blocks: b's copies stay its own
    root_child = cache.root.children[tuple(system[:4])]
    assert root_child.blocks == ta[:2] and len(root_child.children) == 2
    manager.free(list(ta))
    manager.free(list(tb))
    cache.match(b + [0])
    # Leaves go first, the older one's tail first: what stays cached is always reachable.
    evicted = [cache._pop_victim() for _ in range(2)]
    assert evicted == [ta[3], ta[2]]
    assert cache.match(b + [0]) == ta[:2] + tb[2:]
    assert cache.match(a + [0]) == ta[:2]


def test_hash_index_evicts_tails_first_so_what_stays_is_reachable():
    # No tree: recency alone orders evictions. A lookup or insert touches every block of a
    # prefix, so a parent is never older than its child; ties (one request's blocks) go
    # tail first, as vLLM's free queue returns a finished request's blocks in reverse.
    manager, cache = cache_over("hash")
    tokens = list(range(16))
    table = filled(manager, tokens)
    cache.insert(tokens, table)
    manager.free(list(table))
    cache.match(tokens[:8] + [99])  # blocks 0 and 1 used again
    assert [cache._pop_victim() for _ in range(3)] == [table[3], table[2], table[1]]
    assert cache.match(tokens + [0]) == table[:1]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(6))
def test_caching_block_manager_random_traces_keep_counts_true(policy, seed):
    rng = random.Random(seed)
    manager = CachingBlockManager(24, 4, policy)
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    live: list[tuple[list[int], list[int]]] = []
    for _ in range(80):
        if live and rng.random() < 0.4:
            tokens, table = live.pop(rng.randrange(len(live)))
            manager.cache.insert(tokens, table)
            manager.free(list(table))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 10))]
            prefix = manager.cache.match(tokens)
            if not manager.cache.can_allocate(len(tokens), prefix):
                assert manager.blocks_needed(len(tokens)) - len(prefix) > manager.num_free - sum(
                    manager.ref_counts[b] == 1 for b in prefix)
                continue
            table = manager.cache.claim(len(tokens), prefix) + manager.allocate(len(tokens) - len(prefix) * 4)
            live.append((tokens, table))
        # Every block's count is its tables plus the cache's one reference.
        cached = set(manager.cache.cached_blocks())
        expected = [sum(t.count(b) for _, t in live) + (b in cached) for b in range(24)]
        assert manager.ref_counts == expected
        assert manager.num_free == sum(c == 0 for c in expected) + sum(c == 1 and b in cached
                                                                        for b, c in enumerate(expected))
    for _, table in live:
        manager.free(list(table))
    cached = len(manager.cache.cached_blocks())
    assert cached == 0 or manager.cache.evict(24) == cached
    assert manager.num_free == 24 and all(c == 0 for c in manager.ref_counts)


def test_caching_block_manager_evicts_when_the_free_list_is_empty():
    manager = CachingBlockManager(4, 2, "radix")
    table = manager.allocate(8)
    manager.cache.insert(list(range(8)), table)
    manager.free(list(table))
    assert manager.num_free == 4 and len(manager._free) == 0
    assert len(manager.allocate(8)) == 4 and manager.cache.evicted_blocks == 4
    with pytest.raises(serve.NoFreeBlocks):
        manager.allocate(1)


# -- the engine with a prefix cache ----------------------------------------------------------------

def shared_prefix_prompts(count: int, seed: int, prefix_len: int = 21) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    return [system[:rng.randint(prefix_len // 2, prefix_len)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
            for _ in range(count)]


# (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, chunked_prefill): roomy; a pool
# so small that the cache evicts and running sequences get preempted; chunked prefill.
SETTINGS = [(64, 4, 4, 256, False), (10, 4, 3, 64, False), (48, 4, 3, 6, True)]
IDS = ["roomy", "evicting-preempting", "chunked"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_outputs_are_token_identical_with_caching_on_and_off(model, policy, setting):
    num_blocks, block_size, seqs, tokens, chunked = setting
    prompts = shared_prefix_prompts(8, seed=num_blocks)
    params = [serve.SamplingParams(max_tokens=n) for n in (3, 6, 2, 5, 4, 6, 1, 3)]
    kwargs = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                  chunked_prefill=chunked)
    off = serve.LLM(model, **kwargs).generate(prompts, params)
    llm = serve.LLM(model, prefix_caching=policy, **kwargs)
    on = llm.generate(prompts, params)
    again = llm.generate(prompts, params)  # everything served once: hits everywhere now
    for a, b, c in zip(off, on, again):
        assert a.tokens == b.tokens == c.tokens and a.finish_reason == "length"
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in on) > 0 or num_blocks < 16
    assert all(o.num_cached_tokens % block_size == 0 and o.num_cached_tokens < len(o.prompt) for o in on + again)
    # Nothing but the cache holds a block once every request is done, and it can give them all back.
    cached = set(llm.prefix_cache.cached_blocks())
    assert all(count == (b in cached) for b, count in enumerate(llm.blocks.ref_counts))
    assert llm.blocks.num_free == num_blocks
    if num_blocks < 16:
        assert llm.prefix_cache.evicted_blocks > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_by_swap_with_caching_changes_no_token(model, policy):
    """A preempted sequence's blocks go to the CPU store while the cache keeps its own references
    to the cached ones; outputs stay those of caching off."""
    prompts = shared_prefix_prompts(8, seed=10)
    params = [serve.SamplingParams(max_tokens=n) for n in (3, 6, 2, 5, 4, 6, 1, 3)]
    kwargs = dict(num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    off = serve.LLM(model, **kwargs).generate(prompts, params)
    llm = serve.LLM(model, prefix_caching=policy, preemption="swap", num_swap_blocks=32, **kwargs)
    on = llm.generate(prompts, params)
    assert [o.tokens for o in on] == [o.tokens for o in off]
    assert sum(o.num_preemptions for o in on) > 0 and llm.blocks.num_free == 10
    assert llm.swap.blocks.num_free == 32


def test_seeded_sampling_is_unchanged_by_caching(model):
    prompts = shared_prefix_prompts(5, seed=3)
    params = serve.SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=11, n=2)
    off = serve.LLM(model, num_blocks=64, block_size=4).generate(prompts, params)
    on = serve.LLM(model, num_blocks=64, block_size=4, prefix_caching="radix").generate(prompts, params)
    assert [o.samples for o in off] == [o.samples for o in on]


def test_a_hit_prefills_only_the_uncached_tokens(model):
    llm = serve.LLM(model, num_blocks=32, block_size=4, prefix_caching="hash")
    prompt = list(range(3, 26))  # 23 tokens: 5 full blocks
    llm.generate([prompt], serve.SamplingParams(max_tokens=2))
    request = llm.add_request(prompt + [1, 2], serve.SamplingParams(max_tokens=2))
    step = llm.step()
    (seq,) = step.prefills
    assert seq.num_prefix_hit == 20 and seq.num_new == 5 and seq.num_cached == 25
    while llm.has_unfinished():
        llm.step()
    assert llm.output(request).num_cached_tokens == 20


def test_prefix_caching_arguments_are_checked(model):
    with pytest.raises(ValueError, match="prefix_caching"):
        serve.LLM(model, num_blocks=8, prefix_caching="lru")
    with pytest.raises(ValueError, match="policy"):
        CachingBlockManager(8, 4, "sha")
    with pytest.raises(TypeError, match="BlockManager"):
        RadixCache("blocks")
    _, cache = cache_over("radix")
    for tokens in ("abc", [1, 2, True], [1, 2.0], (1, None)):
        with pytest.raises(TypeError, match="tokens"):
            cache.match(tokens)
    with pytest.raises(ValueError, match="table"):
        cache.insert(list(range(8)), [0])
    with pytest.raises(ValueError, match="num_blocks"):
        cache.evict(0)
    other = CachingBlockManager(8, 4)
    with pytest.raises(ValueError, match="prefix_cache"):
        serve.Scheduler(serve.BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=16, prefix_cache=other.cache)


# -- the agent trace and its closed-loop driver ---------------------------------------------------

def test_agent_trace_shares_system_prompts_and_is_reproducible():
    a = conversation.agent_trace(5, vocab_size=VOCAB, system_len=12, num_system_prompts=2, turns=(1, 4), seed=4)
    assert a == conversation.agent_trace(5, vocab_size=VOCAB, system_len=12, num_system_prompts=2, turns=(1, 4),
                                         seed=4)
    assert a[0].system == a[2].system == a[4].system != a[1].system
    assert all(1 <= s.turns <= 4 and len(s.max_tokens) == s.turns for s in a)
    for bad in (dict(system_len=0), dict(turns=(3, 2)), dict(num_system_prompts=0), dict(message_lens=(0, 4))):
        with pytest.raises(ValueError):
            conversation.agent_trace(2, **{**dict(vocab_size=VOCAB, system_len=8), **bad})


@pytest.mark.parametrize("concurrency", [1, 3])
def test_each_turn_resends_the_conversation_and_hits_the_cache(model, concurrency):
    sessions = conversation.agent_trace(4, vocab_size=VOCAB, system_len=17, num_system_prompts=2, turns=(2, 3),
                                        message_lens=(2, 6), output_lens=(2, 4), seed=5)
    llm = serve.LLM(model, num_blocks=96, block_size=4, max_num_seqs=concurrency, prefix_caching="radix")
    records = conversation.serve_sessions(llm, sessions, concurrency=concurrency, step_s=0.5)
    assert [(r.session, r.turn) for r in records] == [(i, t) for i, s in enumerate(sessions) for t in range(s.turns)]
    for r in records:
        s = sessions[r.session]
        assert len(r.timeline.tokens) == s.max_tokens[r.turn] and r.timeline.ttft_s >= 0.5
        if r.turn > 0:  # the previous prompt, its answer and the new message
            prev = records[records.index(r) - 1]
            assert r.prompt_len == prev.prompt_len + len(prev.timeline.tokens) + len(s.messages[r.turn])
            assert r.num_cached_tokens >= (prev.prompt_len // 4) * 4 - 4
    rate = conversation.hit_rate(records)
    assert 0 < rate == llm.prefix_cache.hit_tokens / llm.prefix_cache.queried_tokens
    with pytest.raises(ValueError, match="concurrency"):
        conversation.serve_sessions(llm, sessions, concurrency=0)
    with pytest.raises(ValueError, match="AgentSession"):
        conversation.serve_sessions(llm, [])


# -- on a GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_prefix_caching_changes_no_token_on_gpu(policy):
    """Triton kernels compiled for the device, CUDA graphs on: caching on, under eviction, gives the
    tokens of caching off (fp32)."""
    model = models.Decoder(models.TINY, seed=31, init_std=0.1, device="cuda")
    prompts = shared_prefix_prompts(10, seed=8)
    params = [serve.SamplingParams(max_tokens=n) for n in random.Random(9).choices(range(1, 12), k=len(prompts))]
    off = serve.LLM(model, num_blocks=64, block_size=4, max_num_seqs=4, max_model_len=64).generate(prompts, params)
    llm = serve.LLM(model, num_blocks=16, block_size=4, max_num_seqs=4, max_model_len=64, prefix_caching=policy)
    for _ in range(2):
        assert [o.tokens for o in llm.generate(prompts, params)] == [o.tokens for o in off]
    assert llm.prefix_cache.hit_tokens > 0 and llm.prefix_cache.evicted_blocks > 0


# -- the long-context walls: masks, attention work, per-layer KV memory ---------------------------------

@pytest.mark.parametrize("n", [1, 7, 33, 64])
@pytest.mark.parametrize("rule", [{}, {"window": 5}, {"chunk": 8}, {"window": 3, "chunk": 8}, {"window": 100}])
def test_attended_pairs_count_the_mask(n, rule):
    mask = long_context.attention_mask(n, n, **rule)
    assert long_context.attended_pairs(n, **rule) == int(mask.sum())
    assert torch.equal(mask, mask.tril())  # causal always
    if "window" in rule:
        assert int(mask.sum(1).max()) == min(n, rule["window"])


def test_the_mask_of_the_last_queries_is_the_full_masks_last_rows():
    full = long_context.attention_mask(20, 20, window=6, chunk=8)
    assert torch.equal(long_context.attention_mask(5, 20, window=6, chunk=8), full[-5:])


def test_flex_mask_mod_agrees_with_the_dense_mask():
    window, chunk = torch.tensor(6), torch.tensor(8)
    rule = long_context.mask_mod(window, chunk)
    q, k = torch.arange(20)[:, None], torch.arange(20)[None, :]
    assert torch.equal(rule(0, 0, q, k), long_context.attention_mask(20, 20, window=6, chunk=8))
    window.fill_(100)  # changed in place: the same function now applies chunks only
    assert torch.equal(rule(0, 0, q, k), long_context.attention_mask(20, 20, chunk=8))


def test_kv_bytes_per_layer_follow_each_rule():
    config = models.QWEN3_SIZES["Qwen3-4B"]
    per_layer_token = config.kv_bytes_per_token() // config.num_layers
    assert long_context.kv_cache_bytes(config, 10_000) == 10_000 * config.kv_bytes_per_token()
    gemma_like = long_context.layer_patterns(config.num_layers, global_every=6, window=1024)
    assert sum(p["window"] is None for p in gemma_like) == config.num_layers // 6
    local = config.num_layers - config.num_layers // 6
    assert long_context.kv_cache_bytes(config, 10_000, gemma_like) == per_layer_token * (
        (config.num_layers // 6) * 10_000 + local * 1024)
    assert long_context.kv_cache_bytes(config, 500, gemma_like) == 500 * config.kv_bytes_per_token()
    chunked = long_context.layer_patterns(config.num_layers, global_every=None, chunk=8192)
    assert long_context.kv_cache_bytes(config, 20_000, chunked) == 8192 * config.kv_bytes_per_token()
    assert long_context.attention_flops(config, 100) == 4 * 5050 * config.head_dim * config.num_heads


def test_long_context_helpers_check_their_arguments():
    with pytest.raises(ValueError, match="window"):
        long_context.attention_mask(4, 4, window=0)
    with pytest.raises(ValueError, match="num_queries"):
        long_context.attention_mask(5, 4)
    with pytest.raises(ValueError, match="patterns"):
        long_context.kv_cache_bytes(models.TINY, 10, [{}])
    with pytest.raises(ValueError, match="global_every"):
        long_context.layer_patterns(4, global_every=0, window=2)


# -- the context-management calculator -----------------------------------------------------------------

SESSION = econ.agent_session(12, system_tokens=3000, task_tokens=400, tool_tokens=2500, output_tokens=300)
PRICE = econ.PRICES["Claude Sonnet 4.5"]


def prompt_lengths_of_full_history(session):
    history, lengths = 0, []
    for m, o in zip(session.message_tokens, session.output_tokens):
        lengths.append(session.system_tokens + history + m)
        history += m + o
    return lengths


def test_full_history_without_caching_bills_every_prompt_token_at_the_input_price():
    cost = econ.session_cost(SESSION, econ.Strategy("full", prompt_caching=False), PRICE)
    lengths = prompt_lengths_of_full_history(SESSION)
    assert cost.prompt_lengths == lengths and cost.cached_input == 0
    assert cost.dollars == pytest.approx((sum(lengths) * PRICE.input + sum(SESSION.output_tokens) * PRICE.output) / 1e6)


def test_prompt_caching_reads_the_previous_prompt_and_writes_the_rest():
    cost = econ.session_cost(SESSION, econ.Strategy("full"), PRICE)
    lengths = prompt_lengths_of_full_history(SESSION)
    # Each turn's prompt extends the previous one: the previous prompt is read, the rest written.
    assert cost.cached_input == sum(lengths[:-1]) and cost.uncached_input == sum(lengths) - sum(lengths[:-1])
    expected = (sum(lengths[:-1]) * PRICE.cache_read + (sum(lengths) - sum(lengths[:-1])) * PRICE.cache_write
                + sum(SESSION.output_tokens) * PRICE.output) / 1e6
    assert cost.dollars == pytest.approx(expected)
    assert cost.dollars < econ.session_cost(SESSION, econ.Strategy("full", prompt_caching=False), PRICE).dollars


def test_editing_the_history_loses_the_cache_after_the_edit():
    pruned = econ.session_cost(SESSION, econ.Strategy("tool_pruning", keep_last=2), PRICE)
    full = econ.session_cost(SESSION, econ.Strategy("full"), PRICE)
    assert max(pruned.prompt_lengths) < max(full.prompt_lengths) and pruned.hit_rate < full.hit_rate
    retrieval = econ.session_cost(SESSION, econ.Strategy("retrieval", keep_last=2, retrieved_tokens=1000), PRICE)
    # Once retrieval replaces the old turns, only the system prompt is a hit.
    assert retrieval.prompt_lengths[-1] == 3000 + 1000 + 2 * (2500 + 300) + 2500
    compaction = econ.session_cost(SESSION, econ.Strategy("compaction", threshold=10_000, summary_tokens=1500), PRICE)
    assert compaction.summary_calls >= 2 and max(compaction.prompt_lengths) <= 3000 + 10_000 + 2500


def test_the_price_table_keeps_the_providers_published_ratios():
    for prices in econ.PRICES.values():
        assert prices.as_of and prices.source and prices.cache_read < prices.input <= prices.cache_write
        if prices.provider == "Anthropic":  # reads at 0.1x the input price, 5-minute writes at 1.25x
            assert prices.cache_read == pytest.approx(0.1 * prices.input)
            assert prices.cache_write == pytest.approx(1.25 * prices.input)


def test_calculator_arguments_are_checked():
    with pytest.raises(ValueError, match="name"):
        econ.Strategy("forget")
    with pytest.raises(ValueError, match="keep_last"):
        econ.Strategy("retrieval", keep_last=0)
    with pytest.raises(ValueError, match="equally long"):
        econ.AgentSession(10, (1, 2), (3,))
    with pytest.raises(TypeError, match="session"):
        econ.session_cost("session", econ.Strategy(), PRICE)


def test_the_cache_alone_finds_what_the_engine_found(model):
    """Same sessions, a roomy pool, one turn at a time: the model-free simulation's hit rate equals
    the engine's (answers differ in content, not in length or in being resent)."""
    sessions = conversation.agent_trace(3, vocab_size=VOCAB, system_len=13, turns=(2, 3), message_lens=(2, 6),
                                        output_lens=(2, 4), seed=6)
    llm = serve.LLM(model, num_blocks=64, block_size=4, max_num_seqs=1, prefix_caching="radix")
    engine = conversation.hit_rate(conversation.serve_sessions(llm, sessions, step_s=1.0))
    for policy in POLICIES:
        roomy = conversation.simulate_cache(sessions, num_blocks=64, block_size=4, policy=policy)
        assert roomy["hit_rate"] == pytest.approx(engine) and roomy["evicted_blocks"] == 0
        assert roomy["turns_with_history_cached"] == 1.0
        tight = conversation.simulate_cache(sessions, num_blocks=12, block_size=4, policy=policy, concurrency=3)
        assert tight["hit_rate"] < roomy["hit_rate"] and tight["evicted_blocks"] > 0
