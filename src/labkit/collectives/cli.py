"""``torchrun --nproc-per-node 4 -m labkit.collectives.cli``: check and time the collectives.

Every rank checks our ring and recursive-doubling collectives against torch.distributed's
and a float64 sum, then times them over sizes; rank 0 prints an nccl-tests-style table
(time, algbw, busbw) and the alpha-beta fit of each implementation. On GPUs each rank
takes the GPU numbered by its ``LOCAL_RANK`` and the backend is NCCL; on the CPU, gloo.
Multi-node is torchrun's business: ``--nnodes``, ``--rdzv-endpoint``; nothing here changes.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch.distributed as dist

from . import cost, launch, programs
from .bench import FIT_ABOVE_BYTES, annotate, fit_rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'collective':>15} {'implementation':>26} {'size (B)':>11} {'time (us)':>11} "
             f"{'algbw GB/s':>11} {'busbw GB/s':>11} {'model (us)':>11}"]
    for r in rows:
        lines.append(f"{r['collective']:>15} {r['impl']:>26} {r['bytes']:>11} {r['time_ms'] * 1e3:>11.1f} "
                     f"{r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f} {r['model_ms'] * 1e3:>11.1f}")
    return "\n".join(lines)


def describe_fit(f: cost.AlphaBetaFit, sizes: list[int]) -> str:
    """One line: the fitted line, what it means per step and per link, and how well it fits."""
    line = f"t = {f.fixed_s * 1e6:.3g} us + N x {f.per_byte_s * 1e12:.3g} ps/B"
    if f.n == 1:
        meaning = "one rank: no link, the line is local overhead and copies"
    elif f.bandwidth_gbps is None:
        meaning = f"alpha {f.alpha_s * 1e6:.3g} us per step; no bandwidth term (time did not grow with size)"
    else:
        meaning = f"alpha {f.alpha_s * 1e6:.3g} us per step, link {f.bandwidth_gbps:.3g} GB/s"
    fitted = f"fitted from {f.fit_from_bytes:.0f} B" if f.fit_from_bytes else "fitted at every size"
    worst = f.max_rel_error(sizes, FIT_ABOVE_BYTES)
    fit = "no sizes above 1 MB" if math.isnan(worst) else f"worst error above 1 MB {worst:.0%}"
    return f"{line}; {meaning}; {fitted}, {fit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m labkit.collectives.cli",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=None, help="smallest size (default: by device)")
    parser.add_argument("--max-bytes", type=int, default=None, help="largest size (default: by device)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per point and round")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds over the whole sweep, interleaved (default: by backend)")
    parser.add_argument("--skip-check", action="store_true", help="time only")
    args = parser.parse_args(argv)
    backend_name = launch.init_from_torchrun()
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        sizes = programs.default_sweep_sizes(backend_name)
        sizes = [s for s in sizes if (args.min_bytes or 0) <= s <= (args.max_bytes or sizes[-1])] or sizes[:1]
        if not args.skip_check:
            rows = programs.verify([1, 7, 4099], ["float32", "bfloat16", "int64"])
            if rank == 0:
                print(f"{len(rows)} cases on {n} {backend_name} ranks: every collective matches "
                      "torch.distributed and the float64 sum", flush=True)
        rows = programs.sweep(sizes, args.reps, args.rounds)
        if rank == 0:
            fits = fit_rows(rows)
            print(format_table(annotate(rows, fits)))
            for (collective, impl), f in fits.items():
                sizes = [r["bytes"] for r in rows if (r["collective"], r["impl"]) == (collective, impl)]
                print(f"fit {collective} / {impl}: {describe_fit(f, sizes)}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
