"""Shared pytest setup: labkit is imported first (it sets TRITON_INTERPRET without a GPU)."""

import labkit  # noqa: F401  (must precede any triton import)
import pytest


def pytest_collection_modifyitems(config, items):
    if labkit.on_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine runs Triton's interpreter")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
