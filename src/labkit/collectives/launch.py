"""Start ``n`` real processes with a process group, from a notebook, a test or torchrun.

:func:`run` spawns one process per rank on this machine (one per GPU with NCCL, or gloo
processes on the CPU), rendezvous over TCP on 127.0.0.1 at a free port, calls a
module-level function in each and returns what each rank returned, in rank order. It
is bounded: a rank that raises fails the call with its traceback, and a rank that hangs
(a collective some peer never joined) fails it with ``TimeoutError`` after ``timeout_s``;
the other ranks are terminated either way.

:func:`init_from_torchrun` is the same setup for a process that torchrun started: it
reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import backend
from ..validate import check_choice, check_positive_int

BACKENDS = ("gloo", "nccl")
# NVLink SHARP (multicast through the NVSwitch) stays off on the book's GPU machines:
# NCCL reads this when a communicator is created, so it is set before init.
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0"}


def default_backend() -> str:
    """NCCL when the book runs on GPUs, gloo on the CPU: the backend follows the device."""
    return "nccl" if backend.on_gpu() and dist.is_nccl_available() else "gloo"


def default_world_size() -> int:
    """One process per GPU; four gloo processes on the CPU."""
    return torch.cuda.device_count() if default_backend() == "nccl" else 4


def device_for(backend_name: str) -> torch.device:
    """Where a rank's tensors live: its own GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend_name == "nccl" else torch.device("cpu")


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it; a race with another program is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, backend_name: str, init_method: str,
                       timeout_s: float, local_rank: int | None = None) -> None:
    """Join the group: pick this rank's GPU (NCCL) or its share of the cores (gloo)."""
    for key, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    device_id = None
    if backend_name == "nccl":
        device_id = torch.device("cuda", (rank if local_rank is None else local_rank) % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    else:
        # Ranks share the machine's cores; more threads per rank than that only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend_name, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)


def init_from_torchrun(timeout_s: float = 300.0) -> str:
    """Initialise from the environment torchrun sets; return the backend chosen."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: {', '.join(missing)} unset. "
                           "Run: torchrun --nproc-per-node 4 -m labkit.collectives.cli")
    name = default_backend()
    init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), name, "env://",
                       timeout_s, local_rank=int(os.environ["LOCAL_RANK"]))
    return name


def _rank_main(rank: int, world_size: int, backend_name: str, init_method: str, timeout_s: float,
               fn: Callable[..., Any], args: tuple, results: Any, join_group: bool = True) -> None:
    try:
        if join_group:
            init_process_group(rank, world_size, backend_name, init_method, timeout_s)
            value = fn(*args)
            # No rank leaves before all are done: leaving closes its connections, and a rank
            # still connecting to it (a fast rank can finish while a slow one joins) would fail.
            dist.barrier()
        else:  # the function builds its own group (labkit.nccl.bootstrap does, by hand)
            value = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; torch's multiprocessing pickler would share
        # them through file descriptors that die with this process.
        results.put(("ok", rank, pickle.dumps(_to_cpu(value))))
    except BaseException:  # report everything, KeyboardInterrupt included, then exit
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# What every rank imports before it runs anything: done once, in the fork server.
PRELOAD = ["torch", "torch.distributed", "labkit", "labkit.collectives"]


def _context() -> mp.context.BaseContext:
    """How ranks start. Never a fork of the caller: CUDA cannot be used in a forked child,
    and a fork would inherit the notebook's threads and locks. On a GPU each rank is a fresh
    interpreter (spawn). Off a GPU every rank computes on the CPU, and importing torch was
    most of a rank's start (about 10 s for four gloo ranks on two cores), so ranks are forked
    from multiprocessing's fork server: a fresh interpreter that imported :data:`PRELOAD`
    once, started by the first call under the environment it sets (``LABKIT_MODE=cpu``)."""
    if backend.on_gpu():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _check_spawnable(fn: object, args: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) == "__main__" or "<" in qualname:
        raise ValueError(
            f"fn must be a module-level function the new processes can import, got {qualname or fn!r} "
            f"from {getattr(fn, '__module__', '?')}; define it in a module (see labkit.collectives.programs)")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    try:
        pickle.dumps(args)
    except Exception as e:
        raise TypeError(f"args must be picklable to reach the other processes: {e}") from None


def run(fn: Callable[..., Any], world_size: int | None = None, *, args: tuple = (),
        backend_name: str | None = None, timeout_s: float = 120.0, join_group: bool = True) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new processes in one group; return each rank's result.

    ``backend_name`` defaults to NCCL on GPUs (then ``world_size`` is at most the number of
    GPUs, one process each) and gloo on the CPU. ``timeout_s`` bounds the whole call.
    With ``join_group=False`` no group is made: each process calls ``fn(rank, world_size, *args)``
    and rendezvouses by itself.
    """
    world_size = default_world_size() if world_size is None else world_size
    check_positive_int(world_size, "world_size")
    backend_name = default_backend() if backend_name is None else backend_name
    check_choice(backend_name, "backend_name", BACKENDS)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if backend_name == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"NCCL runs one process per GPU: world_size {world_size} > "
                         f"{torch.cuda.device_count()} visible GPU(s)")
    _check_spawnable(fn, args)

    ctx = _context()
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(rank, world_size, backend_name, init_method, timeout_s, fn, args, results, join_group))
             for rank in range(world_size)]
    # gloo ranks compute on the CPU, so they run in labkit's CPU mode (wall-clock timing)
    # even on a GPU machine; a spawned process reads its environment when it starts.
    with _environment({"LABKIT_MODE": "cpu"} if backend_name == "gloo" else {}):
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {late} of {world_size} did not finish within {timeout_s:g} s "
                                   "(a collective that some rank never joined hangs; see which ranks)")
            try:
                kind, rank, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                       "before reporting (a crash, or killed for memory)") from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world_size)]
