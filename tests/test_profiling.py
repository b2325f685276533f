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
    for calls in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="calls must be a positive int"):
            profiling.kernels_run(lambda: None, calls)
