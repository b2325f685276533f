"""Shared pytest setup: labkit is imported first (it sets TRITON_INTERPRET without a GPU)."""

import os

import labkit  # noqa: F401  (must precede any triton import)
import pytest


def pytest_collection_modifyitems(config, items):
    if labkit.on_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine runs Triton's interpreter")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# The variables that choose how labkit and Triton run (libraries set others of their own on
# first use, e.g. torch's TORCHINDUCTOR_CACHE_DIR, and those are harmless).
_MODE_VARIABLES = ("LABKIT_", "TRITON_")


@pytest.fixture(autouse=True)
def mode_variables_left_as_found():
    """A test that leaves LABKIT_MODE or a TRITON_ variable changed poisons every later item on
    its worker: the notebooks' kernels inherit it (LABKIT_MODE=gpu once made CI's appendix fail)."""
    def snapshot():
        return {k: v for k, v in os.environ.items() if k.startswith(_MODE_VARIABLES)}

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
