import pytest
import torch
from labkit import backend, ceilings, timing


def test_measure_times_the_work_and_labels_the_method():
    calls = []
    t = timing.measure(lambda: calls.append(1), reps=4)
    assert t.reps == 4 and len(calls) >= 5  # warm-up call(s) plus the timed ones
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    expected = timing.CUDA_EVENTS if backend.on_gpu() else timing.INTERPRETER_WALL_CLOCK
    assert t.method == expected and t.is_performance == backend.on_gpu()
    if not backend.on_gpu():
        assert "not GPU performance" in str(t)


def test_slower_work_measures_slower():
    # Ten thousand times the FLOPs: a busy neighbour process cannot close that gap (64 vs 512 once did).
    small = torch.randn(48, 48)
    large = torch.randn(1024, 1024)
    fast = timing.measure(lambda: small @ small, reps=7)
    slow = timing.measure(lambda: large @ large, reps=7)
    assert slow.median_ms > fast.median_ms


def test_rotating_argument_sets():
    seen = []
    timing.measure(lambda x: seen.append(x), (1,), (2,), (3,), reps=6)
    assert set(seen) == {1, 2, 3}


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        timing.measure(3)
    with pytest.raises(TypeError, match=r"arg_sets\[0\] must be a tuple"):
        timing.measure(lambda x: x, [1])


def test_rates_from_timing():
    t = timing.Timing(median_ms=2.0, p20_ms=2.0, p80_ms=2.0, reps=1, method=timing.CUDA_EVENTS)
    assert timing.bandwidth_tbps(8e9, t) == pytest.approx(4.0)
    assert timing.tflops(2e12, t) == pytest.approx(1000.0)


def test_ceilings_are_measured_positive_numbers():
    lim = ceilings.limits()
    assert set(lim) == {"copy_tbps", "read_tbps", "matmul_bf16_tflops"}
    assert all(v > 0 for v in lim.values())
    assert lim["read_tbps"] == ceilings.read_bandwidth_tbps()  # cached: measured once per process


@pytest.mark.parametrize("bound, size, bad_sizes, least", [
    (ceilings.read_bandwidth_at_tbps, 4096, (0, 3, 4096.0), "4"),
    (ceilings.copy_bandwidth_at_tbps, 8192, (0, 1, 8192.0), "2"),
], ids=["read", "copy"])
def test_a_short_calls_bound_is_measured_per_size_and_checked(bound, size, bad_sizes, least):
    measured = bound(size)
    assert measured > 0
    assert bound(size) == measured  # cached per size
    for bad in bad_sizes:
        with pytest.raises(ValueError, match=f"n_bytes must be an int of at least {least}"):
            bound(bad)


def test_ceilings_import_no_topic_package():
    # The grader's sandbox ships labkit's core without its topic packages, and its harness
    # imports labkit.ceilings for the copy ceiling: the import must not need labkit.memory.
    import subprocess
    import sys

    code = "import sys, labkit.ceilings; assert 'labkit.memory' not in sys.modules, 'labkit.memory was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_timed_call_returns_the_result_and_milliseconds():
    result, ms = timing.timed_call(lambda: sum(range(1000)))
    assert result == 499500 and ms >= 0
    with pytest.raises(TypeError, match="callable"):
        timing.timed_call(3)


def test_host_ms_is_the_time_to_issue_a_call():
    import time

    assert timing.host_ms(lambda: time.sleep(0.002), reps=3) >= 2.0  # host work counts
    with pytest.raises(TypeError, match="callable"):
        timing.host_ms(3)
    with pytest.raises(ValueError, match="reps must be a positive int"):
        timing.host_ms(lambda: None, reps=0)


@pytest.mark.gpu
def test_host_ms_leaves_out_the_gpu_time_and_refuses_a_call_that_waits_for_the_gpu():
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gpu = timing.measure(lambda: big @ big).median_ms
    assert timing.host_ms(lambda: big @ big) < gpu / 2  # one launch: far shorter than the matmul
    with pytest.raises(RuntimeError, match="waits for the GPU"):
        timing.host_ms(lambda: (big @ big).sum().item())
