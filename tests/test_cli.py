import subprocess
import sys

import labkit
import pytest


def _cli(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600)


def test_bench_lists_benchmarks():
    out = _cli("labkit.bench", "--list")
    assert out.returncode == 0, out.stderr


def test_bench_unknown_selection_is_a_clear_error():
    out = _cli("labkit.bench", "no-such-chapter")
    assert out.returncode == 2 and "neither a benchmark nor a chapter" in out.stderr


@pytest.mark.skipif(labkit.on_gpu(), reason="checks the refusal on a machine without a GPU")
def test_record_refuses_without_gpu():
    out = _cli("labkit.record")
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_record_unknown_chapter():
    if not labkit.on_gpu():
        pytest.skip("record refuses before selecting on a CPU machine")
    out = _cli("labkit.record", "no-such-chapter")
    assert out.returncode == 2
