"""``python -m labkit.record [chapter-or-part ...]``: execute chapters on a GPU and record.

Each chapter notebook runs top to bottom with real sizes; every benchmark it shows goes
through :func:`labkit.benchmarks.obtain`, which on a GPU measures and writes its record
to ``book/results/<device>/``. Afterwards this prints what was recorded and the goals.
Select chapters by id (``triton-softmax``), part folder (``1-silicon``) or part number
(``1``) so that each command fits in the GPU machine's ten minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from . import backend, book, results


def execute_notebook(path, timeout_s: int) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.record", description=__doc__.splitlines()[0])
    parser.add_argument("select", nargs="*", help="chapter ids, part folders or part numbers (default: all)")
    parser.add_argument("--cell-timeout", type=int, default=600)
    args = parser.parse_args(argv)
    if not backend.on_gpu():
        print("labkit.record needs a CUDA GPU: without one there is nothing to record "
              "(the CPU build reads book/results instead).", file=sys.stderr)
        return 2
    try:
        chosen = book.select(args.select)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    os.environ.setdefault("LABKIT_MODE", "gpu")
    started = time.time()
    failures = []
    for chapter in chosen:
        print(f"-- {chapter.id} ({chapter.part})", flush=True)
        try:
            seconds = execute_notebook(chapter.path, args.cell_timeout)
            print(f"   executed in {seconds:.0f} s", flush=True)
        except Exception as e:  # report and go on: one broken chapter must not lose the others
            failures.append(chapter.id)
            # A cell's error carries its own traceback; anything else (the kernel dying, the
            # client failing) is only found from where it was raised.
            detail = str(e) if str(e).strip() else traceback.format_exc()
            print(f"   FAILED: {type(e).__name__}: {detail[-3000:]}", flush=True)
    fresh = [(p, d) for p, d in results.all_records() if p.stat().st_mtime >= started]
    print(f"\n{len(fresh)} record(s) written:")
    for path, d in fresh:
        goals = d.get("goals", [])
        met = sum(g["met"] for g in goals)
        print(f"   {path.relative_to(results.REPO_ROOT)}  goals met {met}/{len(goals)}")
        for g in goals:
            if not g["met"]:
                print(f"      MISSED {g['name']}: {g['value']:.3f} {g['op']} {g['threshold']}")
    if failures:
        print(f"\nchapters that failed: {', '.join(failures)}")
    print(json.dumps({"executed": [c.id for c in chosen], "failed": failures, "records": len(fresh)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
