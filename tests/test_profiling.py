"""labkit.profiling: the kernels (on the CPU, the ATen ops) a function runs, by torch.profiler."""

import pytest
import torch
from labkit import profiling


def test_counts_every_launch_of_every_call():
    x = torch.randn(64, 33)
    kernels = profiling.kernels_run(lambda: torch.softmax(x @ x.T, -1), calls=3)
    by_name = {k.name: k for k in kernels}
    matmul = next(k for name, k in by_name.items() if "mm" in name)
    assert matmul.launches % 3 == 0 and matmul.launches >= 3
    assert any("softmax" in name for name in by_name)
    assert all(k.us >= 0 for k in kernels)


def test_rejects_a_call_count_that_is_not_positive():
    for profiler in (profiling.kernels_run, profiling.runtime_calls):
        for calls in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="calls must be a positive int"):
                profiler(lambda: None, calls)


def test_runtime_calls_need_a_gpu_to_have_any():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the calls are real: test_runtime_calls_count_each_synchronization")
    profile = profiling.runtime_calls(lambda: torch.ones(3).sum(), calls=2)
    assert profile.calls == [] and profile.wall_us == 0.0


@pytest.mark.gpu
def test_runtime_calls_count_each_synchronization():
    x = torch.randn(256, 256, device="cuda")
    profile = profiling.runtime_calls(lambda: (x @ x).sum().item(), calls=4)
    calls = profile.calls
    names = {c.name: c for c in calls}
    assert profile.wall_us >= sum(c.us for c in calls) > 0 and profile.outside_us >= 0
    assert calls == sorted(calls, key=lambda c: -c.us)
    # .item() copies to pageable memory and waits: one device-to-host copy per call
    copies = [c for name, c in names.items() if "Memcpy" in name]
    assert copies and sum(c.count for c in copies) >= 4


def test_events_inside_keep_the_window_and_drop_what_ran_after_it():
    x = torch.randn(32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.exp(x)
        with torch.profiler.record_function("window"):
            torch.mm(x, x)
            torch.tanh(x)
        torch.sigmoid(x)
    names = {e.name for e in profiling.events_inside(prof.events(), "window")}
    assert {"aten::mm", "aten::tanh"} <= names
    assert not names & {"aten::exp", "aten::sigmoid", "window"}
    with pytest.raises(ValueError, match="no record_function range named 'other'"):
        profiling.events_inside(prof.events(), "other")


@pytest.mark.gpu
def test_runtime_calls_leave_out_the_profilers_own_synchronization():
    # fn queues a long kernel and returns at once: the profiler's cudaDeviceSynchronize as it
    # stops waits for that kernel, and is not fn's call.
    profile = profiling.runtime_calls(lambda: torch.cuda._sleep(50_000_000), calls=2)
    assert "cudaDeviceSynchronize" not in {c.name for c in profile.calls}
    assert any("Launch" in c.name for c in profile.calls)
    # nor is its wait in the wall time: two launches take microseconds, the kernels tens of milliseconds
    assert profile.wall_us < 10_000
