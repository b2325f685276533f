"""Shared pytest setup: labkit is imported first (it sets TRITON_INTERPRET without a GPU),
torch's threads are capped per worker, and the run ends with each notebook's wall time."""

import os
from collections import defaultdict

import labkit  # noqa: F401  (must precede any triton import)
import pytest
import torch

# A chapter must execute in this many seconds on the 2-core CPU machine (CHAPTER.md).
NOTEBOOK_BUDGET_S = 60.0


def threads_per_worker() -> int:
    """The torch threads one pytest worker, and each notebook kernel it starts, may use: the
    cores this process may run on, shared evenly by the xdist workers. On 2 cores with
    `-n 2`, each worker and its kernel default to 2 threads, and 4 spinning threads on 2
    cores slowed the GRPO notebook's small-op training from 7 s to past a 300 s timeout."""
    cores = len(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, cores // workers)


def pytest_configure(config):
    """The one place the cap is set: this process's torch, and through the environment every
    process it starts (nbval's notebook kernels, subprocess-run scripts) before their torch
    reads it. xdist's controller runs no tests and keeps its defaults."""
    threads = threads_per_worker()
    if config.pluginmanager.hasplugin("xdist"):  # registered only where xdist is installed
        config.pluginmanager.register(FileScheduling(), "labkit-file-scheduling")
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = str(threads)
    torch.set_num_threads(threads)


# Modules whose tests are independent and seconds to a minute each: `make test`'s workers take
# them one by one. Everything else goes as xdist's loadscope groups it (a module or a class, and
# a notebook's cells) to one worker, in order. As one unit the grader's module (120 tests that
# grade or execute notebooks, 23 minutes on one core; its 40 self-tests take 15 of them) would be
# the longest unit, and it grows with every exercise; one by one, the two workers share it.
SPREAD_FILES = ("tests/test_grade_exercises.py",)


class FileScheduling:
    """xdist's loadscope, except that each test of a file in ``SPREAD_FILES`` is a unit of its own.

    A scheduler, not ``xdist_group`` marks with ``--dist loadgroup``: xdist 3.8 renames the
    marked items' ``_nodeid``, which pytest 9 no longer reads, so the marks are silently lost."""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadscope":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                file = nodeid.split("::", 1)[0]
                return nodeid if file in SPREAD_FILES else super()._split_scope(nodeid)

        return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if labkit.on_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine runs Triton's interpreter")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# The variables that choose how labkit and Triton run (libraries set others of their own on
# first use, e.g. torch's TORCHINDUCTOR_CACHE_DIR, and those are harmless). Inductor's first
# GPU compilation sets three TRITON_ paths (torch/_inductor/runtime: triton_heuristics.py,
# compile_tasks.py): locations, not modes, so they are not counted as a test's change.
_MODE_VARIABLES = ("LABKIT_", "TRITON_")
_SET_BY_INDUCTOR = {"TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH"}


@pytest.fixture(autouse=True)
def mode_variables_left_as_found():
    """A test that leaves LABKIT_MODE or a TRITON_ variable changed poisons every later item on
    its worker: the notebooks' kernels inherit it (LABKIT_MODE=gpu once made CI's appendix fail)."""
    def snapshot():
        return {k: v for k, v in os.environ.items() if k.startswith(_MODE_VARIABLES) and k not in _SET_BY_INDUCTOR}

    before = snapshot()
    yield
    after = snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                del os.environ[k]
        pytest.fail(f"the test changed environment variables {changed}; use monkeypatch.setenv")


def pytest_terminal_summary(terminalreporter):
    """Each notebook's wall time (kernel start and every cell, summed over its items): the
    budget report that decides the CPU sizes of new chapters. Reported, never asserted:
    CI machines differ in speed, and a timed assertion would flake."""
    seconds = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid = getattr(report, "nodeid", "")
            if ".ipynb::" in nodeid:
                seconds[nodeid.split("::", 1)[0]] += getattr(report, "duration", 0.0)
    if not seconds:
        return
    terminalreporter.section("notebook wall times")
    for path, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        flag = f"  OVER the {NOTEBOOK_BUDGET_S:.0f} s budget" if total > NOTEBOOK_BUDGET_S else ""
        terminalreporter.write_line(f"{total:7.1f} s  {path}{flag}")
    terminalreporter.write_line(f"{sum(seconds.values()):7.1f} s  all {len(seconds)} notebooks, one after another")
