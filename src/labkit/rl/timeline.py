"""A model of where an RL step's time goes under three placements of rollout and training.

``Phases`` holds what one step's phases take with all ``total_gpus`` GPUs on them
(measured, e.g. from :func:`labkit.rl.run`'s history). The placements:

- ``"colocated"`` (verl's default hybrid engine): every GPU rolls out, then every GPU
  trains, then the weights are refilled in place (CUDA IPC); ``switch`` is the cost of
  handing the memory over (an engine's sleep/wake-up: freeing and re-allocating its KV cache).
- ``"disaggregated"``: ``rollout_gpus`` only roll out, ``train_gpus`` only train, one after
  the other, with an NCCL broadcast of the weights between; each side idles while the
  other works. Work scales with GPUs: a phase on ``k`` of ``n`` GPUs takes ``n/k`` times as long.
- ``"async"``: disaggregated, one step off-policy; the rollout of the next batch runs while
  the trainer trains on this one, so a step costs the slower side plus the sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_positive_int

PLACEMENTS = ("colocated", "disaggregated", "async")


@dataclass(frozen=True)
class Phases:
    """Seconds of one step's phases with every GPU on them; ``switch`` is the colocated hand-over."""

    rollout: float
    train: float
    sync: float
    switch: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rollout", "train", "sync", "switch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class Timeline:
    """``segments``: (lane, phase, step, start, end) for a Gantt chart; ``step_seconds``: the
    steady-state time per step; ``utilization``: busy GPU-seconds over all GPU-seconds."""

    segments: list[tuple[str, str, int, float, float]]
    step_seconds: float
    utilization: float


def timeline(phases: Phases, placement: str, *, steps: int = 3, rollout_gpus: int = 4, train_gpus: int = 4,
             total_gpus: int = 8) -> Timeline:
    """The first ``steps`` steps of ``placement`` (see the module docstring)."""
    if not isinstance(phases, Phases):
        raise TypeError(f"phases must be a Phases, got {type(phases).__name__}")
    check_choice(placement, "placement", PLACEMENTS)
    for name, value in (("steps", steps), ("rollout_gpus", rollout_gpus), ("train_gpus", train_gpus),
                        ("total_gpus", total_gpus)):
        check_positive_int(value, name)
    if placement != "colocated" and rollout_gpus + train_gpus != total_gpus:
        raise ValueError(f"rollout_gpus + train_gpus must be total_gpus, got {rollout_gpus} + {train_gpus} "
                         f"!= {total_gpus}")
    segments = []
    if placement == "colocated":
        step = phases.rollout + phases.switch + phases.train + phases.sync + phases.switch
        for s in range(steps):
            t = s * step
            for phase, seconds in (("rollout", phases.rollout), ("switch", phases.switch), ("train", phases.train),
                                   ("sync", phases.sync), ("switch", phases.switch)):
                if seconds:
                    segments.append((f"all {total_gpus} GPUs", phase, s, t, t + seconds))
                t += seconds
        busy = (phases.rollout + phases.train) / step
        return Timeline(segments, step, busy)
    rollout = phases.rollout * total_gpus / rollout_gpus
    train = phases.train * total_gpus / train_gpus
    lanes = (f"rollout ({rollout_gpus} GPUs)", f"train ({train_gpus} GPUs)")
    if placement == "disaggregated":
        step = rollout + train + phases.sync
        for s in range(steps):
            t = s * step
            segments += [(lanes[0], "rollout", s, t, t + rollout), (lanes[1], "train", s, t + rollout, t + rollout + train),
                         (lanes[0], "sync", s, t + rollout + train, t + step),
                         (lanes[1], "sync", s, t + rollout + train, t + step)]
    else:
        step = max(rollout, train) + phases.sync
        for s in range(steps):
            t = s * step
            # Rollout s+1 runs beside training on batch s (which rollout s produced one step earlier).
            segments += [(lanes[0], "rollout", s + 1, t, t + rollout),
                         (lanes[1], "train", s, t, t + train),
                         (lanes[0], "sync", s, t + max(rollout, train), t + step),
                         (lanes[1], "sync", s, t + max(rollout, train), t + step)]
    busy = (rollout * rollout_gpus + train * train_gpus) / (step * total_gpus)
    return Timeline(segments, step, busy)
