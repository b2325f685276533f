"""Hidden tests of ddp-bucketed-reducer: the bucket rule on random sizes, three ranks,
unused parameters, what each bucket held when its all-reduce was launched, and the
gradients of torch's own DDP (run here, on forked gloo processes) as the reference."""

import datetime
import multiprocessing as mp
import pickle
import random
import socket

import torch
import torch.distributed as dist

from labkit.grade.harness import public_module

public = public_module(__file__, "test_ddp_bucketed_reducer.py")


def test_bucket_count_follows_ddp_rule(submission):
    """Random sizes and caps: the same buckets (and so the same count) as DDP's rule."""
    rng = random.Random(torch.Generator().manual_seed(7).initial_seed())
    for case in range(12):
        sizes = [rng.randint(1, 5000) for _ in range(rng.randint(1, 30))]
        cap = rng.choice([1, 800, 4000, 20000, 10**9])
        first = rng.choice([1, cap // 2 or 1, cap])
        want = public.expected_buckets(sizes, cap, first)
        got = submission.call("assign_buckets", sizes, cap, first)
        assert isinstance(got, list) and len(got) == len(want), \
            f"case {case}: sizes {sizes}, cap {cap}, first {first}: expected {len(want)} buckets, got {got}"
        assert got == want, f"case {case}: sizes {sizes}, cap {cap}, first {first}: expected {want}, got {got}"


def test_three_ranks_many_buckets(submission):
    """Three ranks, four layers of width 12, one parameter per bucket at worst."""
    public.run_and_check(submission, seed=2, n=3, layers=4, width=12, skips=[[], [], []], bucket_bytes=300,
                         first_bucket_bytes=1)


def test_unused_parameters_do_not_hang(submission):
    """Rank 0 skips layer 1, rank 1 skips layer 2: their buckets must still fill and launch."""
    public.run_and_check(submission, seed=3, n=2, layers=4, width=16, skips=[[1], [2]], bucket_bytes=1500,
                         first_bucket_bytes=200)


def test_buckets_are_full_when_launched(submission):
    """Each all-reduce must be given its whole bucket: every gradient in it, divided by the world size."""
    n, bucket_bytes, first = 2, 1200, 100
    weights, inputs, local, per_rank = public.run_and_check(submission, seed=4, n=n, layers=3, width=16,
                                                            skips=[[], []], bucket_bytes=bucket_bytes,
                                                            first_bucket_bytes=first)
    buckets = public.expected_buckets([w.numel() * w.element_size() for w in weights], bucket_bytes, first)
    for r, (_, launched) in enumerate(per_rank):
        assert len(launched) == len(buckets), \
            f"rank {r}: expected {len(buckets)} all-reduces (one per bucket), got {len(launched)}"
        for b, (indices, sent) in enumerate(zip(buckets, launched)):
            want = torch.cat([local[r][i].reshape(-1) / n for i in indices])
            submission.expect_close(sent, want, dtype=torch.float32,
                                    name=f"rank {r}: bucket {b} as handed to all_reduce_async")


class _Chain(torch.nn.Module):
    """The exercise's model as a module, for torch's DDP."""

    def __init__(self, weights):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in weights])

    def forward(self, x, skip):
        for layer in range(len(self.params) // 2):
            if layer not in skip:
                x = torch.tanh(x @ self.params[2 * layer].T + self.params[2 * layer + 1])
        return x.square().mean()


def _torch_ddp_rank(rank, n, port, weights, x, skip, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=30))
        model = torch.nn.parallel.DistributedDataParallel(_Chain(weights), find_unused_parameters=True)
        model(x, skip).backward()
        dist.barrier()  # no rank leaves (closing its connections) while another still needs them
        # plain pickle copies tensors by value (torch's pickler would share them through
        # file descriptors that die with this process)
        results.put((rank, pickle.dumps([p.grad.clone() for p in model.module.params]), None))
    except BaseException as e:
        results.put((rank, None, repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def torch_ddp_gradients(weights, inputs, skips):
    """Every rank's gradients after one backward of torch's own DDP, on forked gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_torch_ddp_rank, args=(r, len(inputs), port, weights, inputs[r], skips[r], results))
             for r in range(len(inputs))]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, grads, error = results.get(timeout=60)
            assert error is None, f"the reference (torch DDP) failed on rank {rank}: {error}"
            got[rank] = pickle.loads(grads)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(len(inputs))]


def test_matches_torch_ddp(submission):
    """Two ranks, rank 1 skipping layer 0: the gradients torch's own DDP computes, on every rank."""
    weights, inputs = public.make_case(5, 2, 3, 16)
    skips = [[], [0]]
    per_rank = submission.call("ddp_gradients_on_processes", weights, inputs, skips, 1200, 100)
    want = torch_ddp_gradients(weights, inputs, skips)
    for r, (grads, _) in enumerate(per_rank):
        for k, ref in enumerate(want[r]):
            assert grads[k] is not None, f"rank {r}: parameter {k} has no gradient after finish()"
            submission.expect_close(grads[k], ref.double(), dtype=torch.float32,
                                    name=f"rank {r}, gradient of parameter {k} against torch DDP's")
