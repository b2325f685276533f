"""labkit.shmem: the simulated symmetric heap, the one-sided programs, the counts, the flag-channel kernel."""

import pytest
import torch

from labkit import check, shmem
from labkit.collectives import launch, programs as two_sided, schedule
from labkit.shmem import cost, device, figures, flags, kernels, reference
from labkit.shmem.heap import World


def inputs(n, numel, dtype, seed):
    if dtype.is_floating_point:  # positive, so a low-precision sum does not cancel
        return [(check.randn(numel, seed=seed * 100 + r).abs() + 0.5).to(dtype) for r in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype) for _ in range(n)]


def expect_sum(outs, xs, label):
    want = reference.sum_float64(xs)
    dtype = xs[0].dtype
    for p, o in enumerate(outs):
        check.assert_close(o.reshape(-1), want, dtype=dtype if dtype.is_floating_point else None,
                           tol=None if dtype.is_floating_point else 0.0, name=f"{label} PE {p}")
    assert all(torch.equal(o, outs[0]) for o in outs), f"{label}: PEs disagree bit for bit"


# --- the heap -------------------------------------------------------------------------------

def test_alloc_gives_the_same_offset_on_every_pe_and_views_are_symmetric():
    w = World(3, 4096)
    a = w.alloc((5,), torch.float32, "a")
    b = w.alloc((2, 3), torch.int64, "b")
    assert a.offset == 0 and b.offset % 16 == 0 and b.offset >= 20
    for p in range(3):
        b.on(p).fill_(p)
        assert b.on(p).data_ptr() - w.heaps[p].data_ptr() == b.offset
    view = b[1, 1:]
    assert view.shape == (2,) and [int(view.on(p)[0]) for p in range(3)] == [0, 1, 2]
    with pytest.raises(MemoryError, match="full"):
        w.alloc(10**6, torch.float32)


def test_put_lands_only_when_delivered_and_quiet_completes_it():
    w = World(2, 1024)
    x = w.alloc(4, torch.float32)
    seen = {}

    def program(pe):
        if pe.my_pe == 0:
            pe.put(x, torch.ones(4), 1)
            seen["before quiet"] = x.on(1).clone()
            pe.quiet()
            seen["after quiet"] = x.on(1).clone()

    w.run(program)
    assert seen["before quiet"].eq(0).all() and seen["after quiet"].eq(1).all()


def test_put_nbi_reads_its_source_at_delivery_but_put_copies_it():
    for nbi, want in ((False, 1.0), (True, 7.0)):
        w = World(2, 1024)
        x = w.alloc(3, torch.float32)

        def program(pe):
            if pe.my_pe == 0:
                src = torch.ones(3)
                (pe.put_nbi if nbi else pe.put)(x, src, 1)
                src.fill_(7.0)  # reusing the source before quiet()
                pe.quiet()

        w.run(program)
        assert x.on(1).eq(want).all(), f"nbi={nbi}"


def test_adversarial_signal_overtakes_data_without_a_fence_but_not_with_one():
    for fence, want in ((False, 0.0), (True, 5.0)):
        w = World(2, 1024)
        x, sig = w.alloc(2, torch.float32), w.alloc(1, torch.int64)
        got = {}

        def program(pe):
            if pe.my_pe == 0:
                pe.put(x, torch.full((2,), 5.0), 1)
                if fence:
                    pe.fence()
                pe.signal_op(sig, 1, shmem.SIGNAL_SET, 1)
            else:
                pe.signal_wait_until(sig, "eq", 1)
                got["x"] = pe.local(x).clone()

        w.run(program)
        assert got["x"].eq(want).all(), f"fence={fence}: got {got['x']}"


def test_put_signal_orders_its_signal_after_its_data():
    w = World(2, 1024)
    x, sig = w.alloc(3, torch.float32), w.alloc(1, torch.int64)
    got = {}

    def program(pe):
        if pe.my_pe == 0:
            pe.put_signal(x, torch.full((3,), 2.0), sig, 4, shmem.SIGNAL_ADD, 1)
        else:
            got["sig"] = pe.signal_wait_until(sig, "ge", 4)
            got["x"] = pe.local(x).clone()

    w.run(program)
    assert got["sig"] == 4 and got["x"].eq(2.0).all()


def test_atomics_get_and_barrier():
    w = World(4, 1024)
    counter, data = w.alloc(1, torch.int64), w.alloc(1, torch.int64)
    olds = {}

    def program(pe):
        olds[pe.my_pe] = pe.atomic_fetch_add(counter, 1, 0)
        pe.atomic_add(data, 10, 0)
        pe.barrier_all()
        return int(pe.get(counter, 0)[0]), int(pe.get(data, 0)[0])

    res = w.run(program)
    assert sorted(olds.values()) == [0, 1, 2, 3] and res == [(4, 40)] * 4
    assert w.totals()["barrier"] == 4 and w.totals()["atomic"] == 8 and w.totals()["get"] == 8


def test_a_wait_nobody_answers_is_a_deadlock_not_a_hang():
    w = World(2, 1024)
    sig = w.alloc(1, torch.int64)
    with pytest.raises(shmem.Deadlock, match="PE 1: signal"):
        w.run(lambda pe: pe.signal_wait_until(sig, "eq", 1) if pe.my_pe == 1 else None)


def test_a_program_error_reaches_the_caller():
    w = World(2, 1024)
    with pytest.raises(ZeroDivisionError):
        w.run(lambda pe: 1 / 0 if pe.my_pe == 1 else None)


def test_heap_calls_refuse_bad_arguments():
    w = World(2, 1024)
    x, sig = w.alloc(3, torch.float32), w.alloc(2, torch.int64)
    errors = []

    def program(pe):
        if pe.my_pe:
            return
        for call, exc in ((lambda: pe.put(x, torch.ones(3), 2), ValueError),
                          (lambda: pe.put(x, torch.ones(4), 1), ValueError),
                          (lambda: pe.put(x, torch.ones(3, dtype=torch.float64), 1), TypeError),
                          (lambda: pe.put(torch.ones(3), torch.ones(3), 1), TypeError),
                          (lambda: pe.signal_op(sig, 1, "set", 1), ValueError),
                          (lambda: pe.signal_op(sig[0], 1, "xor", 1), ValueError),
                          (lambda: pe.signal_wait_until(sig[0], "almost", 1), ValueError)):
            with pytest.raises(exc):
                call()
            errors.append(exc)

    w.run(program)
    assert len(errors) == 7
    with pytest.raises(ValueError, match="delivery"):
        World(2, delivery="fifo")
    with pytest.raises(ValueError, match="n_pes"):
        World(0)


# --- the programs ---------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", shmem.ALL_REDUCES)
@pytest.mark.parametrize("delivery", shmem.DELIVERIES)
def test_all_reduce_matches_the_float64_sum(algorithm, delivery):
    for n, numel, dtype in ((1, 5, torch.float32), (2, 7, torch.bfloat16), (3, 1, torch.float32),
                            (5, 23, torch.float16), (4, 13, torch.int64)):
        xs = inputs(n, numel, dtype, seed=n + numel)
        outs, counts = shmem.all_reduce(xs, algorithm, delivery=delivery, seed=3)
        expect_sum(outs, xs, f"{algorithm} n={n} numel={numel} {dtype}")


def test_ring_counts_are_the_two_sided_rings_transfers():
    n, numel = 4, 1003
    xs = inputs(n, numel, torch.float32, 0)
    _, counts = shmem.all_reduce(xs, "ring")
    two = cost.two_sided_ring_counts(n, numel * 4)
    assert counts["put"] == counts["signal"] == two["messages"] == 2 * (n - 1) * n
    assert counts["put_bytes"] == 2 * (n - 1) * numel * 4  # every chunk moved 2(n-1) times in all
    assert counts["wait"] == 2 * (n - 1) * n and counts["fence"] == 0
    assert cost.one_sided_counts(counts)["messages"] == two["messages"]
    _, one_shot = shmem.all_reduce(xs, "one_shot")
    assert one_shot["put"] == n * (n - 1) and one_shot["wait"] == n and one_shot["put_bytes"] == n * (n - 1) * numel * 4


def test_ring_is_bit_identical_to_the_collectives_chapters_two_sided_ring():
    n, numel = 3, 101
    theirs = launch.run(two_sided.all_reduce_results, n, args=(numel, "float32", 5), backend_name="gloo",
                        timeout_s=120)
    xs = [two_sided.rank_input(numel, torch.float32, 5, r) for r in range(n)]
    ours, _ = shmem.all_reduce(xs, "ring")
    for r in range(n):
        assert torch.equal(ours[r], theirs[r]["ring"]), f"rank {r}"


def test_all_gather_places_every_shard_and_waits_once():
    for n, total, dtype in ((1, 4, torch.float32), (3, 10, torch.bfloat16), (4, 3, torch.int32), (5, 31, torch.float64)):
        whole = inputs(1, total, dtype, seed=total)[0]
        shards = [whole[a:b].clone() for a, b in schedule.chunk_bounds(total, n)]
        outs, counts = shmem.all_gather(shards)
        for o in outs:
            assert torch.equal(o, reference.all_gather_reference(shards))
        assert counts["put"] == n * (n - 1) and counts["wait"] == n
    with pytest.raises(ValueError, match="tensor_split"):
        shmem.all_gather([torch.ones(1), torch.ones(3)])


def routing(n, t, k, h, dtype, seed):
    tokens, dest = cost.routing(n, t, k, h, seed=seed, dtype=dtype)
    return tokens, dest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_dispatch_delivers_every_token_to_every_pe_of_its_experts(dtype):
    for n, t, k, h in ((1, 3, 1, 4), (2, 5, 2, 3), (4, 9, 3, 7), (5, 1, 2, 1)):
        if dtype.is_floating_point:
            tokens, dest = routing(n, t, k, h, dtype, seed=n * t)
        else:
            tokens = [torch.randint(-9, 9, (t, h), dtype=dtype) for _ in range(n)]
            dest = routing(n, t, k, h, torch.float32, seed=n)[1]
        out, counts = shmem.dispatch(tokens, dest)
        want = reference.dispatch_reference(tokens, dest)
        for d in range(n):
            for s in range(n):
                assert torch.equal(out[d][s], want[d][s]), f"n={n} PE {d} from {s}"
        pairs = sum(sum(row) for row in cost.rows_between(dest, n))
        assert counts["put"] == pairs and counts["signal"] == n * n and counts["fence"] == n


def test_dispatch_matches_the_two_sided_all_to_all_on_gloo_processes():
    n = 3
    tokens, dest = routing(n, 6, 2, 5, torch.bfloat16, seed=9)
    theirs = launch.run(reference.two_sided_dispatch, n, args=(tokens, dest), backend_name="gloo", timeout_s=120)
    ours, _ = shmem.dispatch(tokens, dest)
    for d in range(n):
        for s in range(n):
            assert torch.equal(ours[d][s], theirs[d][s]), f"PE {d} from {s}"


def test_dispatch_without_a_fence_reads_stale_rows_unless_the_network_is_kind():
    tokens, dest = routing(4, 8, 2, 5, torch.float32, seed=1)
    want = reference.dispatch_reference(tokens, dest)
    bad, _ = shmem.dispatch(tokens, dest, fence=False)
    assert any(not torch.equal(bad[d][s], want[d][s]) for d in range(4) for s in range(4))
    lucky, _ = shmem.dispatch(tokens, dest, fence=False, delivery="eager")
    assert all(torch.equal(lucky[d][s], want[d][s]) for d in range(4) for s in range(4))


def test_dispatch_refuses_bad_inputs():
    tokens, dest = routing(2, 3, 2, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="outside"):
        shmem.dispatch(tokens, [dest[0], dest[1] + 5])
    with pytest.raises(ValueError, match="rows"):
        shmem.dispatch(tokens, [dest[0][:2], dest[1]])
    with pytest.raises(ValueError, match="capacity"):
        shmem.dispatch(tokens, [torch.zeros(3, 1, dtype=torch.int64)] * 2, capacity=2)
    with pytest.raises(ValueError, match="2-D"):
        shmem.dispatch([torch.ones(3), torch.ones(3)], dest)
    with pytest.raises(TypeError, match="list"):
        shmem.all_reduce(torch.ones(3))
    with pytest.raises(ValueError, match="one shape"):
        shmem.all_reduce([torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match="algorithm"):
        shmem.all_reduce([torch.ones(3)], "tree")


# --- counts and the model -------------------------------------------------------------------

def test_two_sided_dispatch_counts_and_one_sided_columns():
    rows = [[1, 2], [3, 4]]
    two = cost.two_sided_dispatch_counts(2, rows, row_bytes=10)
    assert two["messages"] == 4 and two["bytes"] == 50 + 2 * 8 and two["host syncs per rank"] == 1
    one = cost.one_sided_counts({"put": 5, "signal": 4, "atomic": 0, "put_bytes": 50, "put_signal": 3})
    assert one["messages"] == 6 and one["receives posted"] == 0


def test_latency_model_orders_and_limits():
    kw = dict(host_alpha_us=20.0, device_alpha_us=0.5, bandwidth_gbps=450.0)
    small = {m: cost.all_reduce_time_us(m, 1024, 8, **kw) for m in cost.MODELS}
    big = {m: cost.all_reduce_time_us(m, 2**30, 8, **kw) for m in cost.MODELS}
    assert small["one-sided one-shot"] < small["one-sided ring"] < small["two-sided ring"]
    assert big["one-sided ring"] < big["one-sided one-shot"]
    assert cost.all_reduce_time_us("two-sided ring", 100, 1, **kw) == 0.0
    with pytest.raises(ValueError, match="model"):
        cost.all_reduce_time_us("magic", 1, 2, **kw)


def test_figures_draw_every_event_of_the_ring():
    frames, columns = figures.ring_event_frames(3)
    assert columns == 3 + 2 * 4
    # start, then per step 3 puts and 3 signals land and 3 waits end (4 steps), then the end
    assert len(frames) == 1 + 4 * 9 + 1
    last = list(frames.values())[-1][0]
    assert [t for t, x in zip(last.text, last.x) if x < 3] == ["all"] * 9
    lat = figures.latency_frames([2, 8], [1024, 2**20], host_alpha_us=10, device_alpha_us=1, bandwidth_gbps=100)
    assert list(lat) == ["2 GPUs", "8 GPUs"] and len(lat["2 GPUs"]) == len(cost.MODELS)


# --- the flag channel (Triton, interpreter on a CPU) -----------------------------------------

@pytest.mark.parametrize("dtype", flags.DTYPES)
def test_flag_channel_matches_silu_over_launches_and_odd_sizes(dtype):
    for n in (1, 257, 1000):
        ch = flags.FlagChannel(n, dtype, "cpu", block=128)
        for i in range(2):  # the second launch reuses flags and tickets (epoch 1)
            x = check.randn(n, dtype=dtype, seed=n + i)
            out = check.empty_poisoned((n,), dtype, "cpu")
            ch.put_and_consume(x, out)
            check.assert_close(out, flags.silu_reference(x), dtype=dtype, name=f"one launch n={n} epoch {i}")
        assert ch.flags.eq(2).all() and int(ch.ticket) == 2 * 2 * ch.n_blocks
        buf, out = torch.empty_like(x), check.empty_poisoned((n,), dtype, "cpu")
        flags.copy_then_consume(x, buf, out, block=128)
        check.assert_close(out, flags.silu_reference(x), dtype=dtype, name=f"two launches n={n}")


def test_a_consumer_without_its_producer_gives_up_instead_of_hanging():
    """All programs consumers (the tickets start past the producers): under the interpreter each
    looks once, finds its flag down, sets the error word and ends."""
    n, block = 300, 128
    ch = flags.FlagChannel(n, torch.float32, "cpu", block=block)
    x = check.randn(n, seed=0)
    nb = ch.n_blocks
    kernels.put_signal_consume_kernel[(nb,)](x, ch.buf, torch.empty_like(x), ch.flags, ch.ticket, ch.err, n, nb, 0,
                                             -nb, MAX_SPINS=1, BLOCK=block)
    assert int(ch.err) == 1
    with pytest.raises(RuntimeError, match="flag down"):
        ch.raise_if_failed()
    fresh = flags.FlagChannel(n, torch.float32, "cpu", block=block)
    fresh.ticket.fill_(nb)  # the counter out of step: programs draw tickets past the producers'
    with pytest.raises(RuntimeError, match="out of step|flag down"):
        fresh.put_and_consume(x)
    assert int(fresh.err) in (1, 2)


def test_flag_channel_refuses_bad_inputs():
    with pytest.raises(ValueError, match="numel"):
        flags.FlagChannel(0)
    with pytest.raises(ValueError, match="block"):
        flags.FlagChannel(10, block=100)
    with pytest.raises(TypeError, match="dtype"):
        flags.FlagChannel(10, torch.int32)
    ch = flags.FlagChannel(10, torch.float32, "cpu", block=16)
    with pytest.raises(ValueError, match="carries"):
        ch.put_and_consume(torch.ones(11))
    with pytest.raises(TypeError, match="dtype"):
        ch.put_and_consume(torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="elements"):
        flags.copy_then_consume(torch.ones(10), torch.ones(9))


def test_multi_gpu_paths_refuse_without_gpus():
    if torch.cuda.device_count() >= 2:
        pytest.skip("several GPUs here: the multi-GPU issue runs these")
    with pytest.raises(RuntimeError, match="GPUs"):
        device.symm_mem_one_shot_all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError, match="GPUs"):
        device.nvshmem_ring_step(0, 4)
