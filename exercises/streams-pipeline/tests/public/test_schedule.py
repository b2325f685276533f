"""Public tests of streams-pipeline: the stream program is checked by what it orders.

A program is the list of operations the host issues, in order. Each names its stream:

- ``("copy", stream, chunk, buffer)``: copy host chunk ``chunk`` into device buffer ``buffer``;
- ``("compute", stream, buffer, chunk)``: compute chunk ``chunk``'s result from ``buffer``;
- ``("record", stream, event)``: record ``event`` on ``stream`` (re-recording replaces it);
- ``("wait", stream, event)``: later work on ``stream`` waits for the event's latest
  record *issued before this wait* (a wait on an event never recorded waits for nothing).

Two operations are ordered only by a chain of stream order and record -> wait edges
(happens-before). The checks below ask for exactly the orderings the data needs, never
for one particular program, and the timing model is a scheduler with one copy engine
and one compute engine that starts every operation as soon as its orderings allow.
"""

import math

KINDS = {"copy": 4, "compute": 4, "record": 3, "wait": 3}


def program_of(submission, n_chunks, n_buffers):
    """The submission's program, with its shape checked (feedback says what is wrong)."""
    program = submission.call("schedule", n_chunks, n_buffers)
    assert isinstance(program, (list, tuple)), f"schedule must return a list of tuples, got {type(program).__name__}"
    ops = []
    for i, op in enumerate(program):
        assert isinstance(op, (list, tuple)) and op and op[0] in KINDS, (
            f"operation {i} must be a tuple starting with one of {sorted(KINDS)}, got {op!r}")
        assert len(op) == KINDS[op[0]], f"operation {i} {op!r}: a {op[0]} has {KINDS[op[0]]} fields"
        assert isinstance(op[1], str), f"operation {i} {op!r}: the stream must be a string"
        if op[0] in ("copy", "compute"):
            assert all(isinstance(v, int) and not isinstance(v, bool) for v in op[2:]), (
                f"operation {i} {op!r}: chunk and buffer must be ints")
            buffer = op[3] if op[0] == "copy" else op[2]
            assert 0 <= buffer < n_buffers, f"operation {i} {op!r}: buffer {buffer} is not in 0..{n_buffers - 1}"
        else:
            assert isinstance(op[2], str), f"operation {i} {op!r}: the event must be a string"
        ops.append(tuple(op))
    for kind, field in (("copy", 2), ("compute", 3)):
        chunks = sorted(op[field] for op in ops if op[0] == kind)
        assert chunks == list(range(n_chunks)), (
            f"every chunk 0..{n_chunks - 1} must be {kind + ('ed' if kind == 'copy' else 'd')} exactly once; "
            f"the program's {kind} operations name chunks {chunks}")
    return ops


def predecessors(ops):
    """For each operation, the operations it directly waits for: its stream's previous
    operation, and for a wait, the latest earlier record of its event."""
    last_on_stream, last_record, preds = {}, {}, []
    for i, op in enumerate(ops):
        mine = [last_on_stream[op[1]]] if op[1] in last_on_stream else []
        if op[0] == "wait" and op[2] in last_record:
            mine.append(last_record[op[2]])
        if op[0] == "record":
            last_record[op[2]] = i
        last_on_stream[op[1]] = i
        preds.append(mine)
    return preds


def happens_before(ops):
    """``before[j]``: a bit set of every operation ordered before operation ``j``."""
    before = []
    for mine in predecessors(ops):
        bits = 0
        for p in mine:
            bits |= before[p] | (1 << p)
        before.append(bits)
    return before


def ordered(before, a, b):
    return bool(before[b] >> a & 1)


def hazards(ops):
    """Every read-after-write and write-after-read hazard the program leaves unordered."""
    before = happens_before(ops)
    copy_at = {op[2]: i for i, op in enumerate(ops) if op[0] == "copy"}
    problems = []
    for i, op in enumerate(ops):
        if op[0] != "compute":
            continue
        buffer, chunk = op[2], op[3]
        c = copy_at[chunk]
        if ops[c][3] != buffer:
            problems.append(f"chunk {chunk} is copied into buffer {ops[c][3]} but computed from buffer {buffer}")
            continue
        if not ordered(before, c, i):
            problems.append(f"chunk {chunk}'s compute may start before its copy into buffer {buffer} has finished "
                            "(read after write: nothing orders the copy before the compute)")
        for j, other in enumerate(ops):
            if other[0] == "copy" and other[3] == buffer and j != c and not (
                    ordered(before, j, c) or ordered(before, i, j)):
                problems.append(f"chunk {other[2]}'s copy into buffer {buffer} may overwrite it while chunk "
                                f"{chunk}'s compute still reads it (write after read)")
    return problems


def simulate(ops, copy_time, compute_time):
    """When the last operation ends, if each starts as early as its orderings and its engine
    (one copy engine, one compute engine) allow, taken in the order they become ready."""
    preds = predecessors(ops)
    end = [None] * len(ops)
    engine_free = {"copy": 0.0, "compute": 0.0}
    duration = {"copy": copy_time, "compute": compute_time, "record": 0.0, "wait": 0.0}
    pending = set(range(len(ops)))
    while pending:
        ready = [i for i in pending if all(end[p] is not None for p in preds[i])]
        def earliest(i):
            start = max((end[p] for p in preds[i]), default=0.0)
            return max(start, engine_free[ops[i][0]]) if ops[i][0] in engine_free else start
        i = min(ready, key=lambda i: (earliest(i), i))
        end[i] = earliest(i) + duration[ops[i][0]]
        if ops[i][0] in engine_free:
            engine_free[ops[i][0]] = end[i]
        pending.remove(i)
    return max(end, default=0.0)


def expect_no_hazards(submission, n_chunks, n_buffers):
    ops = program_of(submission, n_chunks, n_buffers)
    problems = hazards(ops)
    assert not problems, (f"schedule({n_chunks}, {n_buffers}) leaves {len(problems)} hazard(s); the first: "
                          + "; ".join(problems[:3]))
    return ops


def expect_overlap(submission, n_chunks, n_buffers, copy_time, compute_time):
    ops = expect_no_hazards(submission, n_chunks, n_buffers)
    took = simulate(ops, copy_time, compute_time)
    ideal = copy_time + (n_chunks - 1) * max(copy_time, compute_time) + compute_time
    serial = n_chunks * (copy_time + compute_time)
    assert math.isclose(took, ideal) or took < ideal, (
        f"schedule({n_chunks}, {n_buffers}) with copies of {copy_time:g} and computes of {compute_time:g} "
        f"takes {took:g} on the simulated GPU; a pipeline takes {ideal:g}, one stream {serial:g}: "
        "are the copies on a stream of their own, and does each wait only for what it needs?")


def test_every_chunk_once(submission):
    """Four chunks, two buffers: each chunk copied once and computed once, in valid operations."""
    program_of(submission, 4, 2)


def test_compute_waits_for_its_copy(submission):
    """Six chunks, two buffers: every compute is ordered after the copy it reads."""
    ops = program_of(submission, 6, 2)
    raw = [p for p in hazards(ops) if "read after write" in p or "computed from" in p]
    assert not raw, f"{len(raw)} compute(s) not ordered after their copy; the first: {raw[0]}"


def test_copy_waits_for_the_buffer(submission):
    """Six chunks, two buffers: no copy overwrites a buffer a compute may still be reading."""
    ops = program_of(submission, 6, 2)
    war = [p for p in hazards(ops) if "write after read" in p]
    assert not war, f"{len(war)} copies may overwrite a buffer in use; the first: {war[0]}"


def test_pipeline_overlaps(submission):
    """Eight chunks, two buffers, copy and compute of equal length: the simulated GPU
    finishes in 9 time units (a pipeline), not 16 (one stream)."""
    expect_overlap(submission, 8, 2, 1.0, 1.0)
