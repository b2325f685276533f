"""Recorded GPU measurements: one JSON record per benchmark run, with provenance.

The website is built on machines without a GPU, yet it shows real GPU numbers. Those
numbers come from here: a benchmark run on a GPU writes a :class:`Record` under
``book/results/<device>/<benchmark>.json``; a CPU build reads it back and plots it,
labelled with where and when it was measured. Records are only ever written by running
a benchmark (:func:`labkit.benchmarks.run`); ``tests/test_results_schema.py`` checks
every committed record against :func:`validate`.
"""

from __future__ import annotations

import ast
import datetime as _dt
import json
import math
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import backend

SCHEMA_VERSION = 1
_PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = _PACKAGE_ROOT.parents[1]
GOAL_OPS = (">=", "<=")


def results_root() -> Path:
    """``book/results`` of the checkout labkit was imported from (``LABKIT_RESULTS`` overrides)."""
    return Path(os.environ.get("LABKIT_RESULTS", REPO_ROOT / "book" / "results"))


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the folder a device's records live in."""
    return "-".join(name.lower().replace("_", " ").split())


def _git_commit() -> str:
    """``LABKIT_GIT_COMMIT`` when set, else git's HEAD (``-dirty`` with uncommitted changes
    outside ``book/results``: the records an earlier benchmark of the same run wrote there
    do not change the code that measures).

    The variable wins: a tree copied to a GPU machine may carry a ``.git`` of another commit.
    """
    if os.environ.get("LABKIT_GIT_COMMIT"):
        return os.environ["LABKIT_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no", "--", ".",
             ":(exclude)book/results"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict[str, Any]:
    """Where and with what a measurement is being taken, now."""
    import triton  # imported here: labkit's backend has already set the interpreter flag

    info: dict[str, Any] = {
        "mode": backend.MODE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
    }
    if backend.on_gpu():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            sm_count=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", None),
            memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()})", cuda=None)
    return info


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


@dataclass
class Goal:
    """A ratio a chapter holds itself to, computed from the run's own measurements."""

    name: str
    value: float
    op: str
    threshold: float

    def __post_init__(self) -> None:
        if self.op not in GOAL_OPS:
            raise ValueError(f"goal op must be one of {GOAL_OPS}, got {self.op!r}")

    @property
    def met(self) -> bool:
        if self.value is None or not math.isfinite(self.value):  # None: a NaN, as a saved record holds it
            return False
        return self.value >= self.threshold if self.op == ">=" else self.value <= self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


@dataclass
class Record:
    """One benchmark run: its rows, the ceilings measured beside it, its goals, provenance."""

    benchmark: str
    chapter: str
    title: str
    metric: str
    rows: list[dict[str, Any]]
    limits: dict[str, float] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    @property
    def recorded(self) -> bool:
        """True for a GPU measurement (live or read back), False for an interpreter run."""
        return self.provenance.get("mode") == "gpu"

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)

    def label(self) -> str:
        """Where the numbers come from, for a figure's caption."""
        p = self.provenance
        if not self.recorded:
            return "measured live under the CPU interpreter: timings are not GPU performance"
        return (
            f"recorded on {p.get('device')} ({p.get('sm_count')} SMs), torch {p.get('torch')}, "
            f"triton {p.get('triton')}, CUDA {p.get('cuda')}, {str(p.get('date', ''))[:10]}, "
            f"commit {p.get('git_commit')}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["goals"] = [g.to_dict() for g in self.goals]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        problems = validate(d)
        if problems:
            raise ValueError("not a valid record: " + "; ".join(problems))
        goals = [Goal(g["name"], g["value"], g["op"], g["threshold"]) for g in d.get("goals", [])]
        fields = {k: v for k, v in d.items() if k != "goals"}
        return cls(goals=goals, **fields)


def path_for(benchmark: str, device: str) -> Path:
    return results_root() / device_slug(device) / f"{benchmark}.json"


def save(record: Record) -> Path:
    """Write a GPU record to ``book/results/<device>/``. Interpreter runs are never saved."""
    if not record.recorded:
        raise ValueError(
            "only GPU measurements are recorded; this record was taken in "
            f"{record.provenance.get('mode')!r} mode"
        )
    d = _finite_or_null(record.to_dict())
    problems = validate(d)
    if problems:
        raise ValueError("refusing to save an invalid record: " + "; ".join(problems))
    path = path_for(record.benchmark, record.provenance["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1, sort_keys=True, allow_nan=False) + "\n")
    return path


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinity, however deep, replaced by ``None``: JSON has no
    such numbers, and a run of minutes on a GPU must not be lost to one undefined ratio."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


# The device whose numbers the book shows (its readers see H200 measurements): a record from
# another device stands in only for a benchmark this one has no record of.
BOOK_DEVICE = "NVIDIA H200"


def recorded_devices() -> list[str]:
    """The device folders under the results root: the book's device first, then the others by name."""
    root = results_root()
    names = [p.name for p in root.iterdir() if p.is_dir()] if root.exists() else []
    return sorted(names, key=lambda name: (name != device_slug(BOOK_DEVICE), name))


def load(benchmark: str, device: str | None = None) -> Record | None:
    """The recorded run of ``benchmark`` on ``device`` (default: the book's device if it has one,
    else the first of :func:`recorded_devices` that does)."""
    devices = [device_slug(device)] if device else recorded_devices()
    for slug in devices:
        path = results_root() / slug / f"{benchmark}.json"
        if path.exists():
            return Record.from_dict(json.loads(path.read_text()))
    return None


def config_fields(text: str) -> dict[str, Any]:
    """A recorded autotuner choice, ``str(triton.Config)`` as records keep it (``"BLOCK_N: 8,
    CODE_WORDS: False, num_warps: 2, ..., maxnreg: None"``), as a dict of its values (Python
    literals where they parse, else the text)."""
    fields: dict[str, Any] = {}
    for item in text.split(", "):
        name, sep, value = item.partition(": ")
        if not sep:
            raise ValueError(f"a recorded config reads 'NAME: value, ...', got {text!r}")
        try:
            fields[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            fields[name] = value
    return fields


def all_records() -> list[tuple[Path, dict[str, Any]]]:
    root = results_root()
    return [(p, json.loads(p.read_text())) for p in sorted(root.glob("*/*.json"))]


_REQUIRED = {
    "schema": int, "benchmark": str, "chapter": str, "title": str, "metric": str,
    "rows": list, "limits": dict, "goals": list, "config": dict, "provenance": dict,
}
_PROVENANCE_GPU = ("mode", "device", "sm_count", "torch", "triton", "cuda", "date", "git_commit")


def _finite_json(value: Any, where: str, problems: list[str]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{where} is not finite ({value})")
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite_json(v, f"{where}.{k}", problems)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_json(v, f"{where}[{i}]", problems)


def validate(d: Any) -> list[str]:
    """Everything wrong with a record's dict; an empty list means it is well-formed."""
    if not isinstance(d, dict):
        return [f"a record is a JSON object, got {type(d).__name__}"]
    problems = []
    for key, typ in _REQUIRED.items():
        if key not in d:
            problems.append(f"missing field {key!r}")
        elif not isinstance(d[key], typ):
            problems.append(f"{key!r} must be {typ.__name__}, got {type(d[key]).__name__}")
    unknown = set(d) - set(_REQUIRED)
    if unknown:
        problems.append(f"unknown fields {sorted(unknown)}")
    if problems:
        return problems
    if d["schema"] != SCHEMA_VERSION:
        problems.append(f"schema {d['schema']} is not the current {SCHEMA_VERSION}")
    if not d["rows"]:
        problems.append("rows is empty: a record must hold measurements")
    if not all(isinstance(r, dict) for r in d["rows"]):
        problems.append("every row must be an object")
    for name, value in d["limits"].items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            problems.append(f"limit {name!r} must be a positive number, got {value!r}")
    for i, g in enumerate(d["goals"]):
        if not isinstance(g, dict) or set(g) != {"name", "value", "op", "threshold", "met"}:
            problems.append(f"goal {i} must have name, value, op, threshold, met")
            continue
        if g["op"] not in GOAL_OPS:
            problems.append(f"goal {g['name']!r} has op {g['op']!r}")
        elif isinstance(g["value"], (int, float)) and isinstance(g["threshold"], (int, float)):
            met = g["value"] >= g["threshold"] if g["op"] == ">=" else g["value"] <= g["threshold"]
            if bool(g["met"]) != bool(met):
                problems.append(f"goal {g['name']!r}: 'met' disagrees with its value")
    prov = d["provenance"]
    if prov.get("mode") == "gpu":
        for key in _PROVENANCE_GPU:
            if prov.get(key) in (None, ""):
                problems.append(f"provenance lacks {key!r}")
    _finite_json(d["rows"], "rows", problems)
    _finite_json(d["limits"], "limits", problems)
    return problems
