"""The chapter's benchmark: our collectives against torch.distributed's, over sizes, with
the alpha-beta model fitted to each implementation's measured times.

What a run is held to depends on whether it has links to model. Across ranks, the fitted
model must predict every measured time above 1 MB within 30%. On one rank (the book's
one-GPU machine) a reduce-scatter or all-gather is a local copy and an all-reduce is
nothing, so there is no link and no model to hold; the copies are held instead to the
device's copy bandwidth, measured in the same run.
"""

from __future__ import annotations

from .. import ceilings
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import cost, launch, programs

FIT_ABOVE_BYTES = 2**20  # the goal holds the model to sizes where bandwidth, not latency, dominates
FIT_GOAL = 0.30
# On one GPU a call costs tens of microseconds from the host whatever it moves; from 256 MB
# on, the copy takes several times that, so it is mostly the copy that is timed.
LIMIT_FROM_BYTES = 2**28
LIMIT_GOAL = 0.90


def fit_rows(rows: list[dict]) -> dict[tuple[str, str], cost.AlphaBetaFit]:
    """One alpha-beta fit per (collective, implementation), fitted where the goal holds it
    (1 MB and up), or at every size for a sweep that stops short of two such sizes."""
    fits = {}
    for key in dict.fromkeys((r["collective"], r["impl"]) for r in rows):
        mine = [r for r in rows if (r["collective"], r["impl"]) == key]
        sizes = [r["bytes"] for r in mine]
        fit_from = FIT_ABOVE_BYTES if sum(s >= FIT_ABOVE_BYTES for s in sizes) >= 2 else 0
        fits[key] = cost.fit_alpha_beta(programs.ALGORITHM_OF[key], mine[0]["world_size"], sizes,
                                        [r["time_ms"] / 1e3 for r in mine], fit_from)
    return fits


def annotate(rows: list[dict], fits: dict[tuple[str, str], cost.AlphaBetaFit],
             copy_tbps: float | None = None) -> list[dict]:
    """Add the model's time and error to each row, and ``ours/torch`` (algbw ratio) to ours.

    With one rank, reduce-scatter and all-gather are copies (read ``N``, write ``N``), so
    given the measured copy ceiling ``copy_tbps`` every row also says how close it comes
    to it (``copy/limit``), ours and torch.distributed's alike; across GPUs the limit is
    the link, which this run cannot measure apart from the collectives themselves.
    """
    torch_algbw = {(r["collective"], r["bytes"]): r["algbw_gbps"] for r in rows if r["impl"] == "torch.distributed"}
    out = []
    for r in rows:
        model_s = fits[(r["collective"], r["impl"])].predict(r["bytes"])
        row = {**r, "model_ms": model_s * 1e3, "model_rel_error": abs(model_s * 1e3 - r["time_ms"]) / r["time_ms"]}
        if copy_tbps and r["world_size"] == 1:
            row["copy_tbps"] = 2 * r["bytes"] / (r["time_ms"] / 1e3) / 1e12
            row["copy/limit"] = row["copy_tbps"] / copy_tbps
        if r["impl"] != "torch.distributed":
            row["ours/torch"] = r["algbw_gbps"] / torch_algbw[(r["collective"], r["bytes"])]
        out.append(row)
    return out


def goals(annotated: list[dict]) -> list[Goal]:
    """Per (collective, implementation): across ranks, the fit's worst error above 1 MB;
    on one rank, the worst ``copy/limit`` from 256 MB on. A goal with no sizes to judge
    it by (a sweep that stops short) is left out; one rank without a ceiling has none."""
    out = []
    for c, impl in dict.fromkeys((r["collective"], r["impl"]) for r in annotated):
        mine = [r for r in annotated if (r["collective"], r["impl"]) == (c, impl)]
        if mine[0]["world_size"] > 1:
            errors = [r["model_rel_error"] for r in mine if r["bytes"] >= FIT_ABOVE_BYTES]
            if errors:
                out.append(Goal(f"{c} {impl}: alpha-beta model's worst relative error above 1 MB",
                                max(errors), "<=", FIT_GOAL))
        else:
            ratios = [r["copy/limit"] for r in mine if r["bytes"] >= LIMIT_FROM_BYTES and "copy/limit" in r]
            if ratios:
                out.append(Goal(f"{c} {impl} on one rank: copy bandwidth / copy ceiling, worst from 256 MB",
                                min(ratios), ">=", LIMIT_GOAL))
    return out


def measure(world_size: int, backend_name: str | None = None) -> Measurement:
    """Sweep, fit and judge the collectives on ``world_size`` new ranks (default backend: the device's).

    The benchmark is this at the device's own world size; the chapter also runs it on gloo
    processes at 2 to 4 ranks, where there are links to model on any machine.
    """
    backend_name = launch.default_backend() if backend_name is None else backend_name
    sizes = programs.default_sweep_sizes(backend_name)
    rounds = programs.default_rounds(backend_name)
    rows = launch.run(programs.sweep, world_size, args=(sizes, None, rounds), backend_name=backend_name,
                      timeout_s=300)[0]
    fits = fit_rows(rows)
    # The ceiling is measured here, so it bounds the rank only if the rank ran on this device.
    copy_tbps = (ceilings.copy_bandwidth_tbps()
                 if world_size == 1 and backend_name == launch.default_backend() else None)
    annotated = annotate(rows, fits, copy_tbps)
    config = {
        "world_size": world_size, "backend": backend_name, "dtype": "float32", "sizes_bytes": sizes,
        "rounds": rounds, "environment": dict(launch.NCCL_ENVIRONMENT),
        "fits": {f"{c} / {impl}": {"fixed_us": f.fixed_s * 1e6, "per_byte_ns": f.per_byte_s * 1e9,
                                   "alpha_us": None if f.alpha_s is None else f.alpha_s * 1e6,
                                   "link_gbps": f.bandwidth_gbps, "fitted_from_bytes": f.fit_from_bytes}
                 for (c, impl), f in fits.items()},
    }
    return Measurement(rows=annotated, metric="time_ms", limits={"copy_tbps": copy_tbps} if copy_tbps else {},
                       goals=goals(annotated), config=config)


@benchmark("collectives.sweep", chapter="collectives",
           title="Ring and recursive-doubling collectives vs torch.distributed, with alpha-beta fits")
def collectives_sweep() -> Measurement:
    return measure(launch.default_world_size())
