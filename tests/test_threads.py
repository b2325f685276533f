"""Torch threads in the test run: every pytest worker and every notebook kernel it starts
stays within its share of the cores (tests/conftest.py sets the cap), so two workers never
oversubscribe two cores."""

import os
from pathlib import Path

import torch
from conftest import threads_per_worker
from nbval.kernel import start_new_kernel

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def test_this_worker_uses_its_share_of_the_cores():
    assert torch.get_num_threads() <= threads_per_worker()
    assert int(os.environ["OMP_NUM_THREADS"]) == threads_per_worker()


def test_a_notebook_kernel_starts_within_the_cap():
    """The kernel is started the way nbval starts a chapter's (same function, the chapters'
    kernel name and folder), and asked how many threads its torch uses."""
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(CHAPTERS))
    printed = []

    def keep_stdout(message):
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])

    try:
        reply = client.execute_interactive(
            "import labkit, torch; print(torch.get_num_threads())", output_hook=keep_stdout, timeout=120
        )
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", reply["content"]
    kernel_threads = int("".join(printed).split()[-1])
    assert kernel_threads <= threads_per_worker(), (
        f"a notebook kernel started with {kernel_threads} torch threads; "
        f"this worker's share of the cores is {threads_per_worker()}"
    )
