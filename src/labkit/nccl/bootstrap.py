"""A communicator built by hand through a ``torch.distributed.TCPStore``: what torchrun and
``init_process_group`` do before NCCL moves a byte.

The steps are NCCL's own bootstrap, played with the store as the out-of-band channel:

1. **rendezvous**: every rank connects to one TCP key-value store (rank 0 hosts it, at
   ``MASTER_ADDR:MASTER_PORT`` under torchrun);
2. **the unique id**: rank 0 makes a 128-byte ``ncclUniqueId`` (``ncclGetUniqueId``: the
   address of its bootstrap socket plus a random magic) and publishes it; the others block
   on ``get`` until it appears. Ours is random bytes of the same size;
3. **ranks meet**: each rank publishes what its peers need (host, process, device) and reads
   everyone else's: NCCL's bootstrap all-gather of ``peerInfo`` that feeds topology detection;
4. **the communicator**: a process group is created on the same store, and a collective proves it.

Run :func:`build_by_hand` on every rank: ``launch.run(build_by_hand, 4, args=(port,), join_group=False)``.
"""

from __future__ import annotations

import ast
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from .. import check
from ..validate import check_positive_int

SUM_CHECK_NUMEL = 1001  # the proving all-reduce: rank r contributes check.randn(1001, seed=r)
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h
UNIQUE_ID_KEY = "nccl_unique_id"
PEER_INFO_PREFIX = "peer_info/"


def _check_rank(rank: int, world_size: int) -> None:
    check_positive_int(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def connect(rank: int, world_size: int, port: int, host: str = "127.0.0.1",
            timeout_s: float = 60.0) -> dist.TCPStore:
    """Step 1: rank 0 hosts the store and waits for all ``world_size`` ranks; the others join it."""
    _check_rank(rank, world_size)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be a TCP port number in 1..65535, got {port!r}")
    return dist.TCPStore(host, port, world_size, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=True)


def share_unique_id(store: dist.Store, rank: int) -> bytes:
    """Step 2: rank 0 publishes a fresh id; every rank returns the same bytes (``get`` blocks until set)."""
    if rank == 0:
        store.set(UNIQUE_ID_KEY, os.urandom(UNIQUE_ID_BYTES))
    return bytes(store.get(UNIQUE_ID_KEY))


def exchange_peer_info(store: dist.Store, rank: int, world_size: int) -> list[dict]:
    """Step 3: publish this rank's host, process and device; read every rank's, in rank order."""
    _check_rank(rank, world_size)
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    mine = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "device": device}
    store.set(f"{PEER_INFO_PREFIX}{rank}", repr(mine))
    # repr/literal_eval rather than pickle: a store is shared, and unpickling runs code.
    return [ast.literal_eval(store.get(f"{PEER_INFO_PREFIX}{r}").decode()) for r in range(world_size)]


def build_by_hand(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> dict:
    """Every step on this rank; returns what it saw (the id's first bytes, the peers, the all-reduced tensor)."""
    started = time.perf_counter()
    store = connect(rank, world_size, port, timeout_s=timeout_s)
    unique_id = share_unique_id(store, rank)
    peers = exchange_peer_info(store, rank, world_size)
    # The group's own keys go under a prefix, as torch's do, so they never meet ours.
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        summed = check.randn(SUM_CHECK_NUMEL, seed=rank)  # rank r's input; any process can remake it
        dist.all_reduce(summed)
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "unique_id_head": unique_id[:8].hex(), "unique_id_bytes": len(unique_id),
            "peers": peers, "all_reduce": summed, "seconds": time.perf_counter() - started}
