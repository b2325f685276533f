"""``python -m labkit.nccl.capture eager|lazy``: one rank of NCCL, with its INFO log, timed.

Run as its own process (NCCL reads ``NCCL_DEBUG`` once, when the library loads), on one GPU,
as the only rank: ``init_process_group`` over a ``TCPStore`` rendezvous, then all-reduces.
``eager`` passes ``device_id``, so ``ncclCommInitRank`` runs inside ``init_process_group``;
``lazy`` does not, so the communicator is made by the first collective. It prints one line
``LABKIT_RESULT {json}`` with the timings; NCCL's own lines go to the same stdout.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

MODES = ("eager", "lazy")
STEADY_CALLS = 20


def main(mode: str) -> dict:
    import torch
    import torch.distributed as dist

    from ..collectives.launch import free_port

    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, got {mode!r}")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.synchronize()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=device if mode == "eager" else None)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    x = torch.ones(1 << 20, device=device)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    steady = []
    for _ in range(STEADY_CALLS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dist.all_reduce(x)
        end.record()
        end.synchronize()
        steady.append(begin.elapsed_time(end) * 1e3)
    assert torch.equal(x, torch.ones_like(x)), "a one-rank sum must leave the tensor as it was"
    dist.destroy_process_group()
    return {"init": mode, "init_process_group_ms": (t1 - t0) * 1e3, "first_all_reduce_ms": (t3 - t2) * 1e3,
            "steady_all_reduce_us": statistics.median(steady), "all_reduce_bytes": x.numel() * x.element_size(),
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}


if __name__ == "__main__":
    print("LABKIT_RESULT " + json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "")), flush=True)
