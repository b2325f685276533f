"""The book's benchmark registry: every figure with a time, a bandwidth or a rate is one.

A benchmark is a function, registered with :func:`benchmark`, that measures (with
:mod:`labkit.timing`, at sizes from :func:`labkit.backend.pick`) and returns a
:class:`Measurement`: rows of numbers, the hardware ceilings it measured beside them,
and the goals it is held to. Each topic keeps its benchmarks in ``labkit/<topic>/bench.py``;
:func:`discover` imports them all, so the CLI (``python -m labkit.bench``), the recorder
(``python -m labkit.record``) and the notebooks share one list.

A notebook calls :func:`obtain`: on a GPU it measures live and records the result; on a
CPU it reads the recorded GPU run, and only if there is none does it measure live under
the interpreter (so the figure still draws, labelled as not performance).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import backend, results
from .results import Goal, Record

T = TypeVar("T")


@dataclass
class Measurement:
    """What a benchmark function returns; :func:`run` adds the name and provenance."""

    rows: list[dict[str, Any]]
    metric: str
    limits: dict[str, float] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Benchmark:
    name: str
    chapter: str
    title: str
    fn: Callable[[], Measurement]


REGISTRY: dict[str, Benchmark] = {}


def benchmark(name: str, *, chapter: str, title: str) -> Callable:
    """Register ``fn`` as benchmark ``name`` (``topic.what``) of ``chapter`` (a notebook's stem)."""
    if not name or "/" in name or name != name.strip():
        raise ValueError(f"benchmark name must be a plain non-empty string, got {name!r}")

    def register(fn: Callable[[], Measurement]) -> Callable[[], Measurement]:
        existing = REGISTRY.get(name)
        if existing is not None and existing.fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"benchmark {name!r} is already registered by {existing.fn.__module__}")
        REGISTRY[name] = Benchmark(name, chapter, title, fn)
        return fn

    return register


def discover() -> dict[str, Benchmark]:
    """Import every ``labkit.<topic>.bench`` module, and any ``labkit.<topic>.bench_<part>``
    (a topic that several chapters share keeps one per chapter), filling :data:`REGISTRY`."""
    import labkit

    for info in pkgutil.iter_modules(labkit.__path__):
        if info.ispkg:
            try:
                importlib.import_module(f"labkit.{info.name}.bench")
            except ModuleNotFoundError as e:
                if e.name != f"labkit.{info.name}.bench":
                    raise
            topic_path = [str(Path(info.module_finder.path) / info.name)]
            for part in pkgutil.iter_modules(topic_path):
                if part.name.startswith("bench_"):
                    importlib.import_module(f"labkit.{info.name}.{part.name}")
    return REGISTRY


def get(name: str) -> Benchmark:
    discover()
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY)) or "none"
        raise KeyError(f"no benchmark named {name!r}; known: {known}")
    return REGISTRY[name]


def select(names_or_chapters: list[str] | None = None) -> list[Benchmark]:
    """Benchmarks by name or by chapter; all of them for an empty selection."""
    discover()
    if not names_or_chapters:
        return [REGISTRY[k] for k in sorted(REGISTRY)]
    chosen: list[Benchmark] = []
    for key in names_or_chapters:
        hits = [b for b in REGISTRY.values() if key in (b.name, b.chapter)]
        if not hits:
            chapters = ", ".join(sorted({b.chapter for b in REGISTRY.values()}))
            raise KeyError(f"{key!r} is neither a benchmark nor a chapter; chapters: {chapters}")
        chosen.extend(b for b in sorted(hits, key=lambda b: b.name) if b not in chosen)
    return chosen


def progress(items: Iterable[T], desc: str) -> Iterable[T]:
    """``items``, with a progress line on stderr during a GPU run: a run that its time limit
    stops still shows which part it reached and how long each took. Silent on the CPU,
    where notebooks run benchmarks live and a page should not show bars."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not backend.on_gpu(), file=sys.stderr)


def run(name: str, *, record: bool | None = None) -> Record:
    """Run benchmark ``name`` now; on a GPU also save it (unless ``record=False``)."""
    bench = get(name)
    m = bench.fn()
    if not isinstance(m, Measurement):
        raise TypeError(f"benchmark {name!r} returned {type(m).__name__}, not a Measurement")
    rec = Record(
        benchmark=bench.name, chapter=bench.chapter, title=bench.title, metric=m.metric,
        rows=m.rows, limits=m.limits, goals=m.goals, config=m.config,
        provenance=results.provenance(),
    )
    if record is None:
        record = backend.on_gpu()
    if record:
        results.save(rec)
    return rec


def obtain(name: str) -> Record:
    """The numbers a chapter shows: live on a GPU (and recorded), else the recorded run."""
    if backend.on_gpu():
        return run(name)
    get(name)  # a typo fails here, not silently as "nothing recorded"
    recorded = results.load(name)
    return recorded if recorded is not None else run(name, record=False)
