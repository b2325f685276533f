"""Public tests of serve-block-manager: what check() runs in the notebook.

Every test replays a list of operations through the submission's ``replay`` and checks the
report after each operation with :func:`check_trace`, which knows the rules of the pool
(not any particular choice of block ids): reference counts equal the number of tables
holding each block, the free count is the number of unreferenced blocks, every table has
ceil(length / block_size) blocks, and each operation did what the exercise specifies.
"""

from collections import Counter


def blocks_for(length, block_size):
    return -(-length // block_size)


def check_trace(num_blocks, block_size, operations, trace):
    """Raise AssertionError, saying which operation and what was wrong, unless ``trace`` obeys the rules."""
    assert isinstance(trace, list) and len(trace) == len(operations), \
        f"replay must return one report per operation ({len(operations)}), got {type(trace).__name__}"
    tables, refs, free = {}, [0] * num_blocks, num_blocks  # the state before the first operation
    for i, (op, report) in enumerate(zip(operations, trace)):
        where = f"operation {i} {op}"
        outcome, new_tables, new_refs, new_free = report
        new_tables = {s: (list(t), n) for s, t, n in new_tables}
        # The invariants, after every operation.
        held = Counter(b for t, _ in new_tables.values() for b in t)
        assert new_refs == [held.get(b, 0) for b in range(num_blocks)], \
            f"after {where}: reference counts {new_refs}, but the tables {new_tables} hold {dict(held)}"
        assert new_free == new_refs.count(0), \
            f"after {where}: num_free is {new_free}, but {new_refs.count(0)} blocks have no reference"
        for s, (t, n) in new_tables.items():
            assert len(t) == blocks_for(n, block_size), \
                f"after {where}: table {s} holds {n} tokens in {len(t)} blocks, not ceil({n}/{block_size})"
            assert len(set(t)) == len(t), f"after {where}: table {s} lists a block twice: {t}"
        # What this operation must have done.
        was_free = {b for b in range(num_blocks) if refs[b] == 0}
        unchanged = {s: v for s, v in tables.items()}
        kind = op[0]
        if kind == "allocate":
            needed = blocks_for(op[2], block_size)
            if needed > num_blocks:
                _expect_failure(where, outcome, "ValueError", new_tables, unchanged)
            elif needed > free:
                _expect_failure(where, outcome, "NoFreeBlocks", new_tables, unchanged)
            else:
                assert outcome == new_tables[op[1]][0], f"{where}: returned {outcome}, the table reads {new_tables[op[1]][0]}"
                assert set(outcome) <= was_free, f"{where}: took blocks {set(outcome) - was_free} that were in use"
                unchanged[op[1]] = (outcome, op[2])
                _expect_tables(where, new_tables, unchanged)
        elif kind == "append":
            table, n = tables[op[1]]
            full = n == len(table) * block_size
            shared_partial = not full and refs[table[-1]] > 1
            if (full or shared_partial) and free == 0:
                _expect_failure(where, outcome, "NoFreeBlocks", new_tables, unchanged)
            else:
                got, got_n = new_tables[op[1]]
                assert got_n == n + 1
                if full:
                    assert outcome is None, f"{where}: a full last block needs a new block, not a copy; got {outcome}"
                    assert got[:-1] == table and got[-1] in was_free, \
                        f"{where}: table {table} (full) should gain one free block, became {got}"
                elif shared_partial:
                    assert outcome == [table[-1], got[-1]] and got[:-1] == table[:-1] and got[-1] in was_free, \
                        (f"{where}: the last block {table[-1]} is shared ({refs[table[-1]]} references) and partly "
                         f"filled, so it must be copied to a free block: expected ({table[-1]}, new), got {outcome} "
                         f"and table {got}")
                else:
                    assert outcome is None and got == table, \
                        f"{where}: the last block {table[-1]} has room and is private: nothing to do; got {outcome}, {got}"
                unchanged[op[1]] = (got, n + 1)
                _expect_tables(where, new_tables, unchanged)
        elif kind == "fork":
            assert outcome == tables[op[1]][0], f"{where}: the child must share the parent's blocks {tables[op[1]][0]}"
            unchanged[op[2]] = tables[op[1]]
            _expect_tables(where, new_tables, unchanged)
        elif kind == "free":
            assert outcome is None, f"{where}: free raised {outcome}"
            del unchanged[op[1]]
            _expect_tables(where, new_tables, unchanged)
        elif kind == "release":
            if refs[op[1]] == 0:
                _expect_failure(where, outcome, "ValueError", new_tables, unchanged)
                assert new_refs == refs, f"{where}: a rejected double free changed the reference counts"
        tables, refs, free = new_tables, new_refs, new_free


def _expect_failure(where, outcome, error, new_tables, before):
    assert outcome == error, f"{where}: expected {error}, got {outcome!r}"
    _expect_tables(where, new_tables, before)


def _expect_tables(where, got, want):
    assert got == want, f"after {where}: the tables should be {want}, got {got}"


def run(submission, num_blocks, block_size, operations):
    trace = submission.call("replay", num_blocks, block_size, operations)
    check_trace(num_blocks, block_size, operations, trace)
    return trace


def test_allocate_rounds_up_to_blocks(submission):
    """7, 8 and 1 tokens in blocks of 4 take 2, 2 and 1 blocks, all distinct."""
    trace = run(submission, 8, 4, [["allocate", 0, 7], ["allocate", 1, 8], ["allocate", 2, 1]])
    assert trace[-1][3] == 3, f"5 of 8 blocks are in use, so 3 are free; num_free says {trace[-1][3]}"


def test_append_takes_a_block_at_the_boundary(submission):
    """Growing 3 tokens to 9 in blocks of 4: new blocks at tokens 4 and 8, none in between."""
    trace = run(submission, 6, 4, [["allocate", 0, 3]] + [["append", 0]] * 6)
    assert [len(t[1][0][1]) for t in trace] == [1, 1, 2, 2, 2, 2, 3]


def test_fork_shares_and_counts(submission):
    """A fork shares every block: two references each, no block taken."""
    trace = run(submission, 6, 4, [["allocate", 0, 6], ["fork", 0, 1], ["fork", 1, 2]])
    assert trace[-1][3] == 4, f"a fork takes no block: 4 of 6 should be free, num_free says {trace[-1][3]}"


def test_copy_on_write_of_a_shared_partial_block(submission):
    """After a fork, the first append to the shared, partly filled last block copies it; the
    other sequence's next append finds its block private."""
    run(submission, 6, 4, [["allocate", 0, 6], ["fork", 0, 1], ["append", 1], ["append", 0], ["append", 0]])


def test_free_returns_blocks_when_unreferenced(submission):
    """Freeing a forked parent keeps the shared blocks for the child; freeing the child returns them."""
    trace = run(submission, 6, 4, [["allocate", 0, 8], ["fork", 0, 1], ["free", 0], ["free", 1]])
    assert trace[-1][3] == 6, "after freeing both tables every block is free"
