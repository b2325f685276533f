"""Public tests of parallel-pipeline-schedule: what check() runs in the notebook.

A schedule is checked by its rules, with :func:`simulate`, which runs it on a pipeline
where every forward and every backward takes one time slot: a forward of micro-batch ``i``
on stage ``s`` needs stage ``s - 1``'s forward of ``i``; a backward needs stage ``s + 1``'s
backward of ``i`` (on the last stage, its own forward). Each stage runs its list in order.
"""


def validated(schedule, num_stages, num_microbatches):
    """Raise AssertionError unless ``schedule`` is one list per stage of ("F"|"B", micro-batch), each pass once."""
    assert isinstance(schedule, (list, tuple)) and len(schedule) == num_stages, \
        f"one_f_one_b({num_stages}, {num_microbatches}) must return {num_stages} lists (one per stage), " \
        f"got {type(schedule).__name__} of length {len(schedule) if hasattr(schedule, '__len__') else '?'}"
    want = sorted((kind, i) for kind in "BF" for i in range(num_microbatches))
    actions = []
    for stage, stage_actions in enumerate(schedule):
        pairs = [tuple(a) if isinstance(a, (list, tuple)) else a for a in stage_actions]
        assert all(isinstance(a, tuple) and len(a) == 2 and a[0] in ("F", "B") and isinstance(a[1], int)
                   for a in pairs), f"stage {stage}: every action must be ('F' or 'B', micro-batch), got {pairs}"
        assert sorted(pairs) == want, \
            f"stage {stage} must run the forward and the backward of each of the {num_microbatches} micro-batches " \
            f"exactly once; it runs {pairs}"
        actions.append(pairs)
    return actions


def simulate(schedule, num_microbatches):
    """Run a validated schedule with one slot per pass; return each stage's list of (action, start slot).

    Raises AssertionError if the order deadlocks (every stage waits for a pass that never comes).
    """
    p = len(schedule)
    done, position, free_at = {}, [0] * p, [0] * p
    starts = [[] for _ in range(p)]
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                kind, i = schedule[s][position[s]]
                if kind == "F":
                    needs = ("F", i, s - 1) if s > 0 else None
                else:
                    needs = ("B", i, s + 1) if s < p - 1 else ("F", i, s)
                if needs is not None and needs not in done:
                    break
                start = max(free_at[s], done[needs] if needs is not None else 0)
                done[(kind, i, s)] = start + 1
                free_at[s] = start + 1
                starts[s].append(((kind, i), start))
                position[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, ("the schedule deadlocks: each stage waits for a pass no stage will run; next actions "
                            f"{ {s: schedule[s][position[s]] for s in range(p) if position[s] < len(schedule[s])} }")
    return starts


def in_flight(actions):
    """The most micro-batches whose forward ran and backward did not: activations held at once."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_two_stages_three_microbatches(submission):
    """p = 2, m = 3: the first stage warms up with one forward; the last alternates from the start."""
    schedule = validated(submission.call("one_f_one_b", 2, 3), 2, 3)
    # Worked out by hand: stage 0 runs p - 0 - 1 = 1 warm-up forward; stage 1 none.
    assert schedule[0] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)], \
        f"stage 0 of 2 with 3 micro-batches: expected F0 F1 B0 F2 B1 B2, got {schedule[0]}"
    assert schedule[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)], \
        f"stage 1 of 2 (the last) with 3 micro-batches: expected F0 B0 F1 B1 F2 B2, got {schedule[1]}"


def test_four_stages_run_without_deadlock(submission):
    """p = 4, m = 6: a complete schedule that the pipeline can run, holding at most p - s micro-batches."""
    schedule = validated(submission.call("one_f_one_b", 4, 6), 4, 6)
    simulate(schedule, 6)
    held = [in_flight(a) for a in schedule]
    assert held == [4, 3, 2, 1], f"stage s of 4 should hold at most 4 - s micro-batches; holds {held}"
