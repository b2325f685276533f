"""The chapter's record: one rank of NCCL brought up eagerly and lazily, with its INFO logs.

Each mode runs :mod:`labkit.nccl.capture` in a fresh process under ``NCCL_DEBUG=INFO``,
``NCCL_DEBUG_SUBSYS=INIT,GRAPH,ENV`` and ``NCCL_NVLS_ENABLE=0``; the record keeps the timings
as rows and the logs, line by line, in its config, where :mod:`labkit.nccl.log` reads them.
NCCL will not put two ranks on one GPU, so one rank is what a one-GPU machine can show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .. import backend
from ..benchmarks import Measurement, benchmark
from ..collectives.launch import NCCL_ENVIRONMENT
from .capture import MODES

LOG_ENVIRONMENT = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,ENV", **NCCL_ENVIRONMENT}
RESULT_MARK = "LABKIT_RESULT "


def capture(mode: str, timeout_s: float = 120.0) -> tuple[dict, list[str]]:
    """Run one mode in its own process; return its timings and NCCL's log lines."""
    # The child imports this very labkit, wherever the parent found it.
    source_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "labkit.nccl.capture", mode], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **LOG_ENVIRONMENT, "PYTHONPATH": path})
    lines = (done.stdout + done.stderr).splitlines()
    results = [json.loads(x[len(RESULT_MARK):]) for x in lines if x.startswith(RESULT_MARK)]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"labkit.nccl.capture {mode} failed (exit {done.returncode}):\n" + "\n".join(lines[-40:]))
    return results[0], [x for x in lines if "NCCL" in x and not x.startswith(RESULT_MARK)]


@benchmark("nccl.init_log", chapter="nccl-internals",
           title="One NCCL rank: eager vs lazy communicator init, and its NCCL_DEBUG=INFO log")
def init_log() -> Measurement:
    if not backend.on_gpu():
        raise RuntimeError("nccl.init_log runs NCCL, which needs a CUDA GPU; on a CPU read the recorded run")
    rows, logs = [], {}
    for mode in MODES:
        row, logs[mode] = capture(mode)
        rows.append(row)
    return Measurement(rows=rows, metric="first_all_reduce_ms",
                       config={"environment": LOG_ENVIRONMENT, "logs": logs, "world_size": 1})
