import os
import subprocess
import sys
import tempfile
from pathlib import Path

import labkit
import pytest
import torch
from labkit import backend


def test_mode_matches_cuda_and_sets_interpreter():
    assert backend.MODE in ("cpu", "gpu")
    assert backend.on_gpu() == (backend.MODE == "gpu")
    if not torch.cuda.is_available():
        assert backend.MODE == "cpu"
    if backend.MODE == "cpu":
        assert os.environ["TRITON_INTERPRET"] == "1"


def test_pick_and_device_follow_mode():
    assert backend.pick(cpu="small", gpu="large") == ("large" if backend.on_gpu() else "small")
    assert backend.device().type == ("cuda" if backend.on_gpu() else "cpu")
    assert ("GPU mode" if backend.on_gpu() else "CPU mode") in labkit.describe()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh process, from a file: Triton compiles a kernel from its source file."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LABKIT_MODE")}
    full_env.update(env)
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "program.py"
        program.write_text(code)
        return subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=full_env,
                              timeout=120)


def test_forced_cpu_mode_sets_interpreter_before_triton():
    out = _run("import labkit, os, triton; print(labkit.MODE, os.environ['TRITON_INTERPRET'])", LABKIT_MODE="cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "1"]


def test_bad_mode_is_a_clear_error():
    out = _run("import labkit", LABKIT_MODE="tpu")
    assert out.returncode != 0
    assert "LABKIT_MODE must be 'cpu', 'gpu' or unset" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU guard")
def test_triton_imported_first_without_interpreter_is_refused():
    out = _run("import triton, labkit")
    assert out.returncode != 0
    assert "triton was imported before labkit" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU guard")
def test_gpu_mode_without_gpu_is_refused():
    out = _run("import labkit", LABKIT_MODE="gpu")
    assert out.returncode != 0
    assert "no CUDA device" in out.stderr


_PROGRAM_ID_RANGE = """
import labkit, torch, triton, triton.language as tl

@triton.jit
def count_from_program_id(out_ptr, n):
    total = 0
    for _ in tl.range(tl.program_id(0), n, tl.num_programs(0)):
        total += 1
    tl.store(out_ptr + tl.program_id(0), total)

out = torch.zeros(3, dtype=torch.int32)
count_from_program_id[(3,)](out, 7)
print(out.tolist())
"""


def test_program_id_bounds_a_range_in_cpu_mode():
    """Triton 3.6's interpreter refused a program id as a loop bound; labkit patches it (3.9 needs nothing)."""
    out = _run(_PROGRAM_ID_RANGE, LABKIT_MODE="cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[3, 2, 2]"  # a grid-stride loop over 7 items with 3 programs


def test_sm_count_is_the_interpreters_stand_in_off_a_gpu():
    """Without a GPU (or for a CPU tensor's device) the interpreter's stand-in is the SM count."""
    if backend.on_gpu():
        assert backend.sm_count() == torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    else:
        assert backend.sm_count() == 4 and backend.sm_count(interpreter=3) == 3
    assert backend.sm_count(torch.device("cpu"), interpreter=7) == 7


_HELPER_CALLS = """
import labkit, torch, triton, triton.language as tl
from triton.runtime import interpreter

@triton.jit
def add_one(x):
    return x + 1

@triton.jit
def count_up(out_ptr, n: tl.constexpr):
    total = tl.zeros([4], dtype=tl.int32)
    for _ in tl.static_range(n):
        total = add_one(total)
    tl.store(out_ptr + tl.arange(0, 4), total)

scans = []
scan = interpreter._patch_builtin
interpreter._patch_builtin = lambda *args: scans.append(1) or scan(*args)
for n in (1, 2, 8):  # the first launch also swaps what triton's own helpers (tl.zeros) reach
    out = torch.zeros(4, dtype=torch.int32)
    before = len(scans)
    count_up[(2,)](out, n)
    print(n, out.tolist(), len(scans) - before)
print(tl.core.is_builtin(tl.load), tl.core.is_builtin(tl.core.tensor.__add__))
"""


def test_a_launch_swaps_triton_language_once_however_often_helpers_run():
    """Triton 3.6's interpreter re-scanned triton.language at every helper call, per program
    and iteration; labkit scans once per launch, and the launch still restores everything."""
    out = _run(_HELPER_CALLS, LABKIT_MODE="cpu")
    assert out.returncode == 0, out.stderr
    once, twice, eight, restored = out.stdout.strip().split("\n")[-4:]
    assert once.startswith("1 [1, 1, 1, 1]") and twice.startswith("2 [2, 2, 2, 2]")
    assert eight.startswith("8 [8, 8, 8, 8]")
    assert twice.split()[-1] == eight.split()[-1] != "0"  # the same scans for 4 and 16 helper calls
    assert restored == "True True"
