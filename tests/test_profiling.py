"""labkit.profiling: the kernels (on the CPU, the ATen ops) a function runs, by torch.profiler;
the host's CUDA calls and the GPU's busy time; the host's Python functions, by cProfile."""

import time
from types import SimpleNamespace

import pytest
import torch
from labkit import profiling
from torch.profiler import DeviceType


def test_counts_every_launch_of_every_call():
    x = torch.randn(64, 33)
    kernels = profiling.kernels_run(lambda: torch.softmax(x @ x.T, -1), calls=3)
    by_name = {k.name: k for k in kernels}
    matmul = next(k for name, k in by_name.items() if "mm" in name)
    assert matmul.launches % 3 == 0 and matmul.launches >= 3
    assert any("softmax" in name for name in by_name)
    assert all(k.us >= 0 for k in kernels)


def test_rejects_a_call_count_that_is_not_positive():
    for profiler in (profiling.kernels_run, profiling.runtime_calls, profiling.python_hotspots):
        for calls in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="calls must be a positive int"):
                profiler(lambda: None, calls)


def test_runtime_calls_need_a_gpu_to_have_any():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the calls are real: test_runtime_calls_count_each_synchronization")
    profile = profiling.runtime_calls(lambda: torch.ones(3).sum(), calls=2)
    assert profile.calls == [] and profile.wall_us == 0.0 and profile.device_busy_us == 0.0


@pytest.mark.gpu
def test_runtime_calls_count_each_synchronization():
    x = torch.randn(256, 256, device="cuda")
    profile = profiling.runtime_calls(lambda: (x @ x).sum().item(), calls=4)
    calls = profile.calls
    names = {c.name: c for c in calls}
    assert profile.wall_us >= sum(c.us for c in calls) > 0 and profile.outside_us >= 0
    assert 0 < profile.device_busy_us <= profile.wall_us
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
    # stops waits for that kernel, and is not fn's call. The GPU starts idle, the sleep kernel
    # loaded, so the window holds two launches and nothing an earlier test left queued.
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    profile = profiling.runtime_calls(lambda: torch.cuda._sleep(50_000_000), calls=2)
    assert "cudaDeviceSynchronize" not in {c.name for c in profile.calls}
    assert any("Launch" in c.name for c in profile.calls)
    # nor is its wait in the wall time: two launches take microseconds, the kernels tens of milliseconds
    assert profile.wall_us < 10_000


@pytest.mark.gpu
def test_device_busy_time_is_the_gpus_share_of_the_window():
    # fn waits for a long kernel: the GPU is busy for most of the window. Then fn spends as
    # long on the host alone: the GPU idles for about half of it.
    def gpu_then_host():
        torch.cuda._sleep(20_000_000)
        torch.cuda.synchronize()
        start = time.perf_counter()
        while time.perf_counter() - start < 0.01:
            pass

    torch.cuda._sleep(1000)  # the first launch's set-up stays out of the profile
    torch.cuda.synchronize()
    profile = profiling.runtime_calls(gpu_then_host, calls=2)
    # (counting the window's own span on the GPU's timeline as work would put it near 0.8: that span
    # runs from the first sleep's start to the last one's end, the host-only 10 ms between them included)
    assert 0.25 < profile.device_busy_us / profile.wall_us < 0.75


def test_device_spans_are_the_gpus_work_not_its_annotations():
    def event(device, begin, end, annotation=False):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=begin, end=end),
                               is_user_annotation=annotation)

    events = [event(DeviceType.CPU, 0, 100),                      # the host's record_function range
              event(DeviceType.CUDA, 10, 90, annotation=True),    # its span on the GPU's timeline, gaps included
              event(DeviceType.CUDA, 10, 20), event(DeviceType.CUDA, 80, 90)]  # two kernels
    assert profiling.device_spans(events) == [(10, 20), (80, 90)]
    assert profiling.busy_time(profiling.device_spans(events), 0, 100) == 20


def test_busy_time_counts_overlaps_once_and_clips_to_the_window():
    assert profiling.busy_time([], 0.0, 10.0) == 0.0
    assert profiling.busy_time([(1, 3), (2, 5), (7, 8)], 0.0, 10.0) == 5.0  # [1, 5] and [7, 8]
    assert profiling.busy_time([(4, 6), (1, 2)], 0.0, 10.0) == 3.0          # any order
    assert profiling.busy_time([(-5, 2), (9, 15)], 0.0, 10.0) == 3.0        # clipped: [0, 2] and [9, 10]
    assert profiling.busy_time([(-5, -1), (11, 12)], 0.0, 10.0) == 0.0      # wholly outside
    assert profiling.busy_time([(2, 3), (2.5, 2.7)], 0.0, 10.0) == 1.0      # one inside another
    with pytest.raises(ValueError, match="ends before it starts"):
        profiling.busy_time([], 5.0, 1.0)


def _busy(steps: int) -> int:
    total = 0
    for i in range(steps):  # no calls inside: all of its time is its own
        total += i * i
    return total


def _quick() -> int:
    return sum(range(10))


def test_python_hotspots_rank_functions_by_their_own_time():
    def work():
        _busy(200_000)
        for _ in range(5):
            _quick()
        profiling.busy_time([(0, 1)], 0, 1)

    spots = profiling.python_hotspots(work, calls=3, top=4)
    assert len(spots) == 4 and spots == sorted(spots, key=lambda h: -h.own_us)
    assert spots[0].function.endswith("(_busy)") and "tests/test_profiling.py:" in spots[0].function
    by_name = {h.function.rsplit("(", 1)[1].rstrip(")"): h for h in profiling.python_hotspots(work, calls=3, top=100)}
    busy, quick = by_name["_busy"], by_name["_quick"]
    assert busy.calls == 3 and quick.calls == 15 and busy.cumulative_us >= busy.own_us > quick.own_us
    assert by_name["busy_time"].function.startswith("labkit/profiling.py:")  # a package's file, from its root
    with pytest.raises(ValueError, match="top must be a positive int"):
        profiling.python_hotspots(work, top=0)


def test_hotspot_labels_keep_the_path_from_the_package_root():
    label = profiling._function_label
    assert label("/usr/local/lib/python3.12/dist-packages/torch/cuda/graphs.py", 88, "replay") == \
        "torch/cuda/graphs.py:88(replay)"
    assert label("/venv/lib/python3.11/site-packages/numpy/core/a.py", 1, "f") == "numpy/core/a.py:1(f)"
    assert label("/repo/src/labkit/serve/engine.py", 300, "step") == "labkit/serve/engine.py:300(step)"
    assert label("/usr/lib/python3.12/threading.py", 5, "wait") == "threading.py:5(wait)"
    assert label("~", 0, "<built-in method time.sleep>") == "~:0(<built-in method time.sleep>)"
