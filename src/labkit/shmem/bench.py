"""The chapter's record: put + signal + consume in one launch, against a copy and a second kernel.

One GPU has no peer to put to, so the record measures the part of one-sided communication
that one GPU can show: programs of one kernel handing data to each other through flags in
memory (:mod:`labkit.shmem.kernels`), against the host-driven pattern, a copy (the transfer)
then a separate kernel, ordered by the stream. Both move the same bytes: ``x`` read, the
buffer written and read back, ``out`` written. The multi-PE programs run on several GPUs
in the multi-GPU issue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import backend, ceilings, check, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import flags

CHAPTER = "nvshmem"
SIZES = {"cpu": [1000, 5001], "gpu": [2**k for k in range(12, 29, 2)]}  # elements; 16 KiB .. 1 GiB of fp32
BLOCK = {"cpu": 256, "gpu": 4096}


@benchmark("shmem.flag_channel", chapter=CHAPTER,
           title="Put, signal and consume in one launch vs a copy and a second kernel (one GPU)")
def flag_channel() -> Measurement:
    mode = "gpu" if backend.on_gpu() else "cpu"
    dtype, device, block = torch.float32, backend.device(), BLOCK[mode]
    copy_tbps = ceilings.copy_bandwidth_tbps()
    rows = []
    for n in SIZES[mode]:
        x = check.randn(n, dtype=dtype, device=device, seed=n)
        channel = flags.FlagChannel(n, dtype, device, block=block)
        buf, out = torch.empty_like(x), torch.empty_like(x)
        want = flags.silu_reference(x)
        check.assert_close(channel.put_and_consume(x, out), want, dtype=dtype, name=f"one launch, n={n}")
        check.assert_close(flags.copy_then_consume(x, buf, out, block), want, dtype=dtype, name=f"two launches, n={n}")
        # No error check inside the timed loop (it syncs); the channel's error word is read after.
        one = timing.measure(lambda: channel.put_and_consume(x, out, check_errors=False))
        two = timing.measure(lambda: flags.copy_then_consume(x, buf, out, block))
        eager = timing.measure(lambda: F.silu(buf.copy_(x)))  # what one writes in torch: copy, then SiLU
        channel.raise_if_failed()  # a consumer that gave up, or a ticket out of step, during the timed runs
        check.assert_close(out, want, dtype=dtype, name=f"after timing, n={n}")
        moved = 4 * n * x.element_size()
        rows.append({"elements": n, "bytes": n * x.element_size(), "one_launch_us": one.median_ms * 1e3,
                     "two_launches_us": two.median_ms * 1e3,
                     "torch_us": eager.median_ms * 1e3,
                     "one_launch/two_launches": one.median_ms / two.median_ms,
                     "one_launch/torch": one.median_ms / eager.median_ms,
                     "one_launch_tbps": timing.bandwidth_tbps(moved, one),
                     "two_launches_tbps": timing.bandwidth_tbps(moved, two),
                     "ours/limit": timing.bandwidth_tbps(moved, one) / copy_tbps})
    small, large = rows[0], rows[-1]
    goals = [Goal("one launch / two launches, time at the smallest size", small["one_launch/two_launches"], "<=", 1.0),
             Goal("one launch, bandwidth / copy bandwidth at the largest size", large["ours/limit"], ">=", 0.5)]
    return Measurement(rows=rows,
                       metric="microseconds per call (median); TB/s of the bytes of four accesses per element "
                              "(read x, write the buffer, read it back, write out)",
                       limits={"copy_tbps": copy_tbps}, goals=goals,
                       config={"dtype": "float32", "block": block, "consumer": "SiLU",
                               "one_launch": "producers put blocks and release-store a flag each; consumers "
                                             "acquire-poll it, then compute (roles by ticket)",
                               "two_launches": "buf.copy_(x), then a Triton SiLU kernel on buf",
                               "torch": "F.silu(buf.copy_(x)) in eager torch (a copy and an elementwise kernel)"})
