"""``python -m labkit.bench [chapter-or-benchmark ...]``: the book's benchmarks, in a terminal.

Runs each selected benchmark (all of them by default) without Jupyter and prints its
table: sizes, ours, the references, the ratios against them and against the hardware
ceilings measured in the same run, then the goals and whether each was met. On a GPU
the runs are also recorded (pass ``--no-record`` to keep ``book/results`` untouched).
"""

from __future__ import annotations

import argparse
import sys

from tqdm.auto import tqdm

from . import backend, benchmarks
from .results import Record


def format_record(rec: Record) -> str:
    import pandas as pd

    lines = [f"== {rec.benchmark}  ({rec.chapter}): {rec.title}", f"   metric: {rec.metric}"]
    with pd.option_context("display.width", 200, "display.max_columns", 40, "display.max_rows", 500):
        lines.append(rec.frame().to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if rec.limits:
        lines.append("   ceilings measured in this run: "
                     + ", ".join(f"{k} = {v:.4g}" for k, v in rec.limits.items()))
    for g in rec.goals:
        mark = "met" if g.met else "MISSED"
        lines.append(f"   goal {g.name}: {g.value:.3f} {g.op} {g.threshold:g}  [{mark}]")
    lines.append(f"   ({rec.label()})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.bench", description=__doc__.splitlines()[0])
    parser.add_argument("select", nargs="*", help="chapter ids or benchmark names (default: all)")
    parser.add_argument("--no-record", action="store_true", help="do not write book/results on a GPU")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    try:
        chosen = benchmarks.select(args.select)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    if args.list:
        for b in chosen:
            print(f"{b.name:40s} {b.chapter:24s} {b.title}")
        return 0
    print(backend.describe())
    missed = 0
    for b in tqdm(chosen, desc="benchmarks", unit="bench"):
        rec = benchmarks.run(b.name, record=backend.on_gpu() and not args.no_record)
        tqdm.write(format_record(rec) + "\n")
        missed += sum(not g.met for g in rec.goals)
    if backend.on_gpu():
        print(f"{missed} goal(s) missed" if missed else "all goals met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
