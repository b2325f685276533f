"""What each rank runs (module-level, so :func:`labkit.collectives.launch.run` can start it).

- :func:`compare_with_torch_ddp`: the same model and batches through :class:`DataParallel`
  and through ``torch.nn.parallel.DistributedDataParallel``, step by step; are the
  gradients the same bits, and are the buckets the same?
- :func:`time_steps`: training steps of the book's decoder with our all-reduces
  overlapped with backward, launched after it, and with torch's DDP, in turn, timed.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import ring_all_reduce
from ..models import Decoder, DecoderConfig, lm_loss
from .data_parallel import DataParallel, torch_all_reduce

REDUCERS = {"torch": torch_all_reduce, "ring": ring_all_reduce}


class TwoHeads(nn.Module):
    """A trunk and two heads; each rank uses one head (its rank's parity), and ``spare`` is
    never used: locally unused parameters, and a globally unused one."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.trunk = nn.Linear(width, width)
        self.heads = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])
        self.spare = nn.Linear(width, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.one_hot(ids % self.trunk.in_features, self.trunk.in_features).float()
        return self.heads[dist.get_rank() % 2](torch.tanh(self.trunk(x)))


def build_model(kind: str, config: dict | None, seed: int) -> nn.Module:
    """The model a rank starts from: the book's ``Decoder`` at ``config``, or :class:`TwoHeads`."""
    torch.manual_seed(seed)
    if kind == "decoder":
        return Decoder(DecoderConfig(**config))
    if kind == "two-heads":
        return TwoHeads()
    raise ValueError(f"kind must be 'decoder' or 'two-heads', got {kind!r}")


def batch_for(vocab: int, batch: int, seq: int, *, step: int, micro: int, rank: int, seed: int = 0) -> torch.Tensor:
    """Token ids ``[batch, seq + 1]`` of one rank's micro-batch: any process can rebuild any rank's."""
    g = torch.Generator().manual_seed(((seed * 1000 + step) * 100 + micro) * 100 + rank)
    return torch.randint(vocab, (batch, seq + 1), generator=g)


def _loss(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind == "decoder":
        return lm_loss(model, ids)
    return model(ids).square().mean()


def compare_with_torch_ddp(kind: str, config: dict | None, steps: int, micro_batches: int,
                           bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                           overlap: bool = True, reduce_with: str = "torch", batch: int = 2, seq: int = 16, seed: int = 0) -> dict:
    """Train ours and torch's DDP side by side for ``steps`` SGD steps; compare every gradient.

    ``bucket_cap_mb``, ``find_unused_parameters`` go to both; ``overlap`` and ``reduce_with``
    (``"torch"``: ``dist.all_reduce``; ``"ring"``: :func:`labkit.collectives.ring_all_reduce`,
    synchronous) to ours only.

    Each rank builds its model from its own seed (the constructors' broadcast must make
    them equal). A step runs ``micro_batches`` forward/backward passes, all but the last
    under ``no_sync``. Returns, per step, whether every gradient is bitwise equal, the
    largest difference, and both sets of bucket sizes in bytes (torch's from its logging
    data, after the rebuild).
    """
    rank = dist.get_rank()
    vocab = config["vocab_size"] if config else 24
    local = build_model(kind, config, seed + 1000 * rank)
    if reduce_with not in REDUCERS:
        raise ValueError(f"reduce_with must be one of {sorted(REDUCERS)}, got {reduce_with!r}")
    ours = DataParallel(copy.deepcopy(local), bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                        overlap=overlap, all_reduce=REDUCERS[reduce_with])
    theirs = nn.parallel.DistributedDataParallel(local, bucket_cap_mb=bucket_cap_mb,
                                                 find_unused_parameters=find_unused_parameters)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    report = {"bitwise": [], "max_diff": [], "none_grads_agree": [], "losses": []}
    for step in range(steps):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            ids = batch_for(vocab, batch, seq, step=step, micro=micro, rank=rank, seed=seed)
            for model in (ours, theirs):
                with model.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():
                    loss = _loss(model, kind, ids)
                    loss.backward()
        mine = [p.grad for p in ours.module.parameters()]
        ref = [p.grad for p in theirs.module.parameters()]
        report["none_grads_agree"].append(all((a is None) == (b is None) for a, b in zip(mine, ref)))
        pairs = [(a, b) for a, b in zip(mine, ref) if a is not None and b is not None]
        report["bitwise"].append(all(torch.equal(a, b) for a, b in pairs))
        report["max_diff"].append(max(float((a - b).abs().max()) for a, b in pairs))
        report["losses"].append(loss.item())
        if step == 0:
            report["first_step_grads"] = [None if g is None else g.clone() for g in mine]
        for opt in optimizers:
            opt.step()
    report["params_equal_after"] = all(torch.equal(a, b) for a, b in
                                       zip(ours.module.parameters(), theirs.module.parameters()))
    report["our_bucket_bytes"] = [b.nbytes for b in ours.buckets]
    # torch logs the buckets it built at construction and, once rebuilt, the new ones; it
    # refreshes the log at the start of each forward, so refresh it for the last step
    theirs.logger.set_runtime_stats_and_log()
    logged = theirs._get_ddp_logging_data()
    rebuilt = "rebuilt_bucket_sizes" in logged
    report["torch_bucket_bytes"] = [int(x) for x in str(logged["rebuilt_bucket_sizes" if rebuilt else "bucket_sizes"])
                                    .split(",") if x.strip()]
    report["torch_bucket_indices"] = ([[int(i) for i in b.split()] for b in
                                       str(logged["rebuilt_per_bucket_param_indices"]).split(",")]
                                      if rebuilt else None)
    report["our_bucket_indices"] = ours.bucket_indices
    return report


def compare_cases(cases: list[tuple]) -> list[dict]:
    """:func:`compare_with_torch_ddp` for each tuple of arguments, in one group (one start-up)."""
    return [compare_with_torch_ddp(*case) for case in cases]


def time_steps(config: dict, steps: int, batch: int, seq: int, bucket_cap_mb: float | None = None,
               warmup: int = 2, seed: int = 0) -> dict:
    """Time forward + backward + gradient sync of the decoder: ours with overlap on, ours
    with overlap off, and torch's DDP, round-robin, one step each in turn.

    The first ``warmup`` rounds (the first backward and the rebuild after it among them)
    are not timed. Returns each mode's step times on this rank, our bucket sizes, and the
    trace of our last step in each mode (times relative to its first gradient hook).
    """
    rank = dist.get_rank()
    # One compute thread per rank, whatever the machine: with every core computing, gloo's
    # thread that sums a bucket could only take a core from backward, and overlap could not
    # win anywhere (on a 16-core host, ranks of 8 threads each measured overlap slower).
    torch.set_num_threads(1)
    local = build_model("decoder", config, seed)
    ours = DataParallel(copy.deepcopy(local), bucket_cap_mb=bucket_cap_mb)
    theirs = nn.parallel.DistributedDataParallel(local, bucket_cap_mb=bucket_cap_mb)
    modes = {"overlap": ours, "after": ours, "torch": theirs}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    traces = {}
    for step in range(warmup + steps):
        for mode, model in modes.items():
            ours.overlap = mode == "overlap"
            ids = batch_for(config["vocab_size"], batch, seq, step=step, micro=0, rank=rank, seed=seed)
            model.zero_grad(set_to_none=True)
            dist.barrier()  # every rank starts the step together, so a rank's time is the step's
            start = time.perf_counter()
            lm_loss(model, ids).backward()
            elapsed = time.perf_counter() - start
            if step < warmup:
                continue
            times[mode].append(elapsed)
            if model is ours:
                t, n = ours.trace, len(ours.buckets)
                traces[mode] = {"forward_start": start - t.start, "backward_end": t.backward_end - t.start,
                                "synced": t.synced - t.start,
                                "filled": [t.filled[b] - t.start for b in range(n)],
                                "launched": [t.launched[b] - t.start for b in range(n)],
                                "reduced": [t.reduced.get(b, t.synced) - t.start for b in range(n)]}
    return {"times": times, "median": {k: statistics.median(v) for k, v in times.items()},
            "bucket_bytes": [b.nbytes for b in ours.buckets], "bucket_indices": ours.bucket_indices,
            "param_names": ours.param_names, "traces": traces}
