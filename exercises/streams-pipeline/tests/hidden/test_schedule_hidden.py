"""Hidden tests of streams-pipeline: more chunks and buffers, unbalanced engines, and on a
GPU the program run with real streams and events, timed against max(copy, compute)."""

import torch

from labkit import check
from labkit.grade.harness import public_module, require_gpu

public = public_module(__file__, "test_schedule.py")


def test_many_chunks_and_buffers(submission):
    """1, 2, 7 and 13 chunks with 2 and 3 buffers: every hazard ordered."""
    for n_chunks in (1, 2, 7, 13):
        for n_buffers in (2, 3):
            public.expect_no_hazards(submission, n_chunks, n_buffers)


def test_one_buffer_is_still_correct(submission):
    """One buffer: nothing can overlap, but every hazard must still be ordered."""
    for n_chunks in (1, 5):
        public.expect_no_hazards(submission, n_chunks, 1)


def test_unbalanced_overlap(submission):
    """Copies three times longer than computes, and the reverse, with 2 and 3 buffers."""
    for copy_time, compute_time in ((3.0, 1.0), (1.0, 3.0)):
        for n_buffers in (2, 3):
            public.expect_overlap(submission, 9, n_buffers, copy_time, compute_time)


# The GPU test: chunks of host data (pinned) copied into device buffers, each "compute" a
# few matmuls of its buffer into the chunk's output, as many as make it last about as long
# as a copy (measured first), so that hiding either one behind the other is what counts.
N_CHUNKS, N_BUFFERS, ROWS, WIDTH = 24, 2, 2048, 4096
OVERLAP_GOAL = 1.1  # full points at 1.1 x max(copy, compute); none at the serial sum


def _events_timed(fn, reps=5):
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2**20)  # the host's head start: its issue time stays out of the timing
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[1:])[reps // 2]  # the first run warms up; the median of the rest


def _run(ops, host, buffers, out, weight, repeats):
    main = torch.cuda.current_stream()
    streams = {name: torch.cuda.Stream() for name in dict.fromkeys(op[1] for op in ops)}
    events = {}
    for s in streams.values():
        s.wait_stream(main)
    for op in ops:
        stream = streams[op[1]]
        if op[0] == "copy":
            with torch.cuda.stream(stream):
                buffers[op[3]].copy_(host[op[2]], non_blocking=True)
        elif op[0] == "compute":
            with torch.cuda.stream(stream):
                for _ in range(repeats):
                    torch.mm(buffers[op[2]], weight, out=out[op[3]])
        elif op[0] == "record":
            events[op[2]] = stream.record_event()
        elif op[2] in events:  # a wait on an event never recorded waits for nothing
            stream.wait_event(events[op[2]])
    for s in streams.values():
        main.wait_stream(s)


def test_gpu_overlap(submission, credit):
    """On a GPU: the program run with real streams and events gives the right results, and
    takes at most 1.1 x max(copy, compute) for full points (none at copy + compute)."""
    require_gpu()
    ops = public.expect_no_hazards(submission, N_CHUNKS, N_BUFFERS)
    gen = torch.Generator().manual_seed(7)
    host = [torch.randn(ROWS, WIDTH, generator=gen).to(torch.bfloat16).pin_memory() for _ in range(N_CHUNKS)]
    weight = (torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH ** 0.5).to(torch.bfloat16).cuda()
    buffers = [torch.empty(ROWS, WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(N_BUFFERS)]
    out = torch.full((N_CHUNKS, ROWS, WIDTH), float("nan"), dtype=torch.bfloat16, device="cuda")
    resident = [h.cuda() for h in host]
    copy_ms = _events_timed(lambda: [buffers[0].copy_(h, non_blocking=True) for h in host])
    one_mm = _events_timed(lambda: torch.mm(resident[0], weight, out=out[0]))
    repeats = max(1, round(copy_ms / N_CHUNKS / one_mm))
    compute_ms = _events_timed(lambda: [torch.mm(r, weight, out=out[i]) for i, r in enumerate(resident)
                                        for _ in range(repeats)])
    out.fill_(float("nan"))
    took = _events_timed(lambda: _run(ops, host, buffers, out, weight, repeats))
    for i in (0, N_CHUNKS // 2, N_CHUNKS - 1):
        # A race would leave NaN or another chunk's numbers here, far outside the tolerance.
        check.assert_close(out[i], torch.mm(resident[i].double(), weight.double()), dtype=torch.bfloat16,
                           name=f"chunk {i}'s result on the GPU")
    ideal, serial = max(copy_ms, compute_ms), copy_ms + compute_ms
    fraction = (serial - took) / (serial - OVERLAP_GOAL * ideal)
    credit.award(fraction, f"{took:.3g} ms for {N_CHUNKS} chunks: copies alone {copy_ms:.3g} ms, computes alone "
                           f"{compute_ms:.3g} ms ({repeats} matmuls each); {took / ideal:.2f} x max(copy, compute), "
                           f"full points at {OVERLAP_GOAL}")
