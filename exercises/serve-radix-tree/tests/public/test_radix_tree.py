"""Public tests of serve-radix-tree: what check() runs in the notebook.

Each test replays operations through the submission's ``replay`` and compares every report
(``[outcome, cached blocks]``) with the one worked out by hand in the comments. Blocks of 2
tokens throughout; block ids are the tests' own (10, 11, ... for the first prompt).
"""


def run(submission, block_size, operations, expected):
    trace = submission.call("replay", block_size, operations)
    assert isinstance(trace, list) and len(trace) == len(operations), \
        f"replay must return one report per operation ({len(operations)}), got {trace!r}"
    for i, (op, got, want) in enumerate(zip(operations, trace, expected)):
        assert list(got) == want, f"operation {i} {op}: expected [outcome, cached] = {want}, got {got}"


def test_insert_caches_only_full_blocks(submission):
    """Five tokens in blocks of 2 fill two blocks; the partial third is never cached (it still changes)."""
    run(submission, 2, [["insert", [1, 2, 3, 4, 5], [10, 11, 12]]], [[2, [10, 11]]])


def test_match_stops_where_the_prompt_diverges(submission):
    """Nothing cached, nothing matches; then 1..8 cached in 4 blocks: a prompt agreeing on 4 tokens
    matches 2 blocks, on 2 or 3 tokens 1, on 0 none."""
    cached = [10, 11, 12, 13]
    run(submission, 2, [["match", [1, 2, 3]], ["insert", [1, 2, 3, 4, 5, 6, 7, 8], cached],
                        ["match", [1, 2, 3, 4, 9, 9, 9]], ["match", [1, 2, 9, 9, 9]], ["match", [9, 2, 3, 4, 5]],
                        ["match", [1, 2, 3, 9, 5, 6, 7]]],
        [[[], []], [4, cached], [[10, 11], cached], [[10], cached], [[], cached], [[10], cached]])


def test_match_never_covers_the_whole_prompt(submission):
    """The last prompt token must run through the model for its logits: [1, 2, 3, 4] matches one
    block though two are cached; one token more and both match."""
    run(submission, 2, [["insert", [1, 2, 3, 4], [10, 11]], ["match", [1, 2, 3, 4]], ["match", [1, 2, 3, 4, 5]]],
        [[2, [10, 11]], [[10], [10, 11]], [[10, 11], [10, 11]]])


def test_a_shared_prefix_is_stored_once(submission):
    """A second prompt extending the first adds only its new block; its own copies of the shared
    blocks (20, 21) are not cached, and a match returns the cached ones."""
    run(submission, 2, [["insert", [1, 2, 3, 4], [10, 11]], ["insert", [1, 2, 3, 4, 5, 6], [20, 21, 22]],
                        ["match", [1, 2, 3, 4, 5, 6, 7]]],
        [[2, [10, 11]], [1, [10, 11, 22]], [[10, 11, 22], [10, 11, 22]]])


def test_prompts_that_diverge_inside_a_cached_run_branch_there(submission):
    """1..6 cached; 1, 2, 7, 8 shares the first block only: both prompts stay fully matchable."""
    run(submission, 2, [["insert", [1, 2, 3, 4, 5, 6], [10, 11, 12]], ["insert", [1, 2, 7, 8], [20, 21]],
                        ["match", [1, 2, 3, 4, 5, 6, 0]], ["match", [1, 2, 7, 8, 0]]],
        [[3, [10, 11, 12]], [1, [10, 11, 12, 21]], [[10, 11, 12], [10, 11, 12, 21]], [[10, 21], [10, 11, 12, 21]]])


def test_eviction_takes_the_least_recently_used_first(submission):
    """Three prompts inserted in the order A, B, C, then A matched again: B is now the least
    recently used, so it goes first (its last block first), then C's last block."""
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    every = [10, 11, 20, 21, 30, 31]
    run(submission, 2, [["insert", a, [10, 11]], ["insert", b, [20, 21]], ["insert", c, [30, 31]],
                        ["match", a + [0]], ["evict", 2, []], ["evict", 1, []]],
        [[2, [10, 11]], [2, [10, 11, 20, 21]], [2, every], [[10, 11], every],
         [[21, 20], [10, 11, 30, 31]], [[31], [10, 11, 30]]])


def test_pinned_blocks_are_never_evicted(submission):
    """Blocks a running request holds (pinned) stay whatever their age; eviction stops when only
    they are left, returning fewer blocks than asked."""
    run(submission, 2, [["insert", [1, 1, 1, 1], [10, 11]], ["insert", [2, 2, 2, 2], [20, 21]],
                        ["evict", 10, [10, 11]]],
        [[2, [10, 11]], [2, [10, 11, 20, 21]], [[21, 20], [10, 11]]])


def test_a_path_is_evicted_from_its_end(submission):
    """One prompt of three blocks, all used at the same moment: the deepest goes first, so what
    stays is still a prefix that a lookup can reach."""
    run(submission, 2, [["insert", [1, 2, 3, 4, 5, 6], [10, 11, 12]], ["evict", 1, []],
                        ["match", [1, 2, 3, 4, 5, 6, 7]]],
        [[3, [10, 11, 12]], [[12], [10, 11]], [[10, 11], [10, 11]]])
