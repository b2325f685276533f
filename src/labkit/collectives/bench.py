"""The chapter's benchmark: our collectives against torch.distributed's, over sizes, with
the alpha-beta model fitted to each implementation's measured times."""

from __future__ import annotations

from .. import backend, ceilings
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from . import cost, launch, programs

FIT_ABOVE_BYTES = 2**20  # the goal holds the model to sizes where bandwidth, not noise, dominates
FIT_GOAL = 0.30


def fit_rows(rows: list[dict]) -> dict[tuple[str, str], cost.AlphaBetaFit]:
    """One alpha-beta fit per (collective, implementation), over all its measured sizes."""
    fits = {}
    for key in dict.fromkeys((r["collective"], r["impl"]) for r in rows):
        mine = [r for r in rows if (r["collective"], r["impl"]) == key]
        fits[key] = cost.fit_alpha_beta(programs.ALGORITHM_OF[key], mine[0]["world_size"],
                                        [r["bytes"] for r in mine], [r["time_ms"] / 1e3 for r in mine])
    return fits


def annotate(rows: list[dict], fits: dict[tuple[str, str], cost.AlphaBetaFit],
             copy_tbps: float | None = None) -> list[dict]:
    """Add the model's time and error to each row, and ``ours/torch`` (algbw ratio) to ours.

    With one rank, reduce-scatter and all-gather are copies (read ``N``, write ``N``), so
    given the measured copy ceiling ``copy_tbps`` the rows also say how close they come
    to it (``ours/limit``); across GPUs the limit is the link, which this run cannot measure.
    """
    torch_algbw = {(r["collective"], r["bytes"]): r["algbw_gbps"] for r in rows if r["impl"] == "torch.distributed"}
    out = []
    for r in rows:
        model_s = fits[(r["collective"], r["impl"])].predict(r["bytes"])
        row = {**r, "model_ms": model_s * 1e3, "model_rel_error": abs(model_s * 1e3 - r["time_ms"]) / r["time_ms"]}
        if copy_tbps and r["world_size"] == 1:
            row["copy_tbps"] = 2 * r["bytes"] / (r["time_ms"] / 1e3) / 1e12
        if r["impl"] != "torch.distributed":
            row["ours/torch"] = r["algbw_gbps"] / torch_algbw[(r["collective"], r["bytes"])]
            if "copy_tbps" in row:
                row["ours/limit"] = row["copy_tbps"] / copy_tbps
        out.append(row)
    return out


@benchmark("collectives.sweep", chapter="collectives",
           title="Ring and recursive-doubling collectives vs torch.distributed, with alpha-beta fits")
def collectives_sweep() -> Measurement:
    world = launch.default_world_size()
    sizes = programs.default_sweep_sizes()
    rows = launch.run(programs.sweep, world, args=(sizes, backend.pick(cpu=3, gpu=None)),
                      timeout_s=backend.pick(cpu=180, gpu=300))[0]
    fits = fit_rows(rows)
    goals = [Goal(f"{c} {impl}: alpha-beta model's worst relative error above 1 MB",
                  fit.max_rel_error([r["bytes"] for r in rows if (r["collective"], r["impl"]) == (c, impl)],
                                    FIT_ABOVE_BYTES), "<=", FIT_GOAL)
             for (c, impl), fit in fits.items()]
    config = {
        "world_size": world, "backend": launch.default_backend(), "dtype": "float32",
        "sizes_bytes": sizes, "environment": dict(launch.NCCL_ENVIRONMENT),
        "fits": {f"{c} / {impl}": {"fixed_us": f.fixed_s * 1e6, "per_byte_ns": f.per_byte_s * 1e9,
                                   "alpha_us": None if f.alpha_s is None else f.alpha_s * 1e6,
                                   "link_gbps": f.bandwidth_gbps}
                 for (c, impl), f in fits.items()},
    }
    limits = {"copy_tbps": ceilings.copy_bandwidth_tbps()} if world == 1 else {}
    return Measurement(rows=annotate(rows, fits, limits.get("copy_tbps")), metric="time_ms", limits=limits,
                       goals=goals, config=config)
