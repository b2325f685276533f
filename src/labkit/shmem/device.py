"""The same programs on real GPUs: PyTorch SymmetricMemory and NVSHMEM4Py, guarded.

These run only on a machine with at least two GPUs that can reach each other's memory,
under torchrun (one process per GPU); everywhere else :func:`require_gpus` refuses with a
message that says why. The book's multi-GPU issue runs them; the chapter shows their source.

Every call below is one the libraries document: ``symm_mem.empty`` allocates from the
symmetric heap, ``symm_mem.rendezvous`` exchanges the handles so each rank can map its
peers' buffers, ``handle.get_buffer(peer, ...)`` is a tensor view of a peer's buffer
(stores into it are NVLink writes: a put), and ``handle.barrier()`` synchronises through the
signal pad; ``torch.ops.symm_mem.one_shot_all_reduce`` is PyTorch's one-shot kernel.
NVSHMEM4Py's host API (``nvshmem.core``) puts and waits on signals from a CUDA stream.
"""

from __future__ import annotations

import torch

from ..collectives.schedule import chunk_bounds


def require_gpus(n: int = 2) -> None:
    """Refuse unless ``n`` GPUs are visible: these code paths move data between GPUs."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        raise RuntimeError(f"this code path needs {n} GPUs with peer access and runs under torchrun; "
                           f"{have} visible here (the multi-GPU issue runs it)")


def symm_mem_ring_all_gather(shard: torch.Tensor) -> torch.Tensor:
    """All-gather by direct stores into every peer's symmetric buffer (SymmetricMemory), then a barrier."""
    require_gpus(2)
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    n, rank = dist.get_world_size(), dist.get_rank()
    numel = shard.numel() * n
    buf = symm_mem.empty(numel, dtype=shard.dtype, device=shard.device)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    start, stop = chunk_bounds(numel, n)[rank]
    for k in range(n):
        peer = (rank + k) % n  # a put: a copy into the peer's buffer, over NVLink
        handle.get_buffer(peer, (numel,), shard.dtype)[start:stop].copy_(shard)
    handle.barrier(channel=0)  # every peer's stores have landed
    return buf.clone()


def symm_mem_one_shot_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's one-shot all-reduce: each rank reads every peer's buffer and sums, one step."""
    require_gpus(2)
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, dist.group.WORLD)
    buf.copy_(x)
    return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", dist.group.WORLD.group_name)


def nvshmem_ring_step(local_rank: int, chunk_elems: int):
    """One ring step with NVSHMEM4Py: put a chunk to the right neighbour with a signal, wait for ours."""
    require_gpus(2)
    import nvshmem.core as nvshmem
    from cuda.core.experimental import Device

    dev = Device(local_rank)
    dev.set_current()
    stream = dev.create_stream()
    me, n = nvshmem.my_pe(), nvshmem.n_pes()
    src = nvshmem.interop.torch.empty((chunk_elems,), dtype=torch.float32)
    dst = nvshmem.interop.torch.empty((chunk_elems,), dtype=torch.float32)
    src.fill_(float(me))
    nvshmem.put(dst, src, remote_pe=(me + 1) % n, stream=stream)
    nvshmem.quiet(stream=stream)  # the put has landed on the neighbour
    nvshmem.barrier(nvshmem.Teams.TEAM_WORLD, stream=stream)
    stream.sync()
    return dst


# The device side, as NVSHMEM's CUDA API writes it: what a DeepEP low-latency dispatch does per
# token (a warp puts one token's row and, after its last token to a rank, a fence and a signal).
NVSHMEM_DEVICE_DISPATCH = r"""
__global__ void dispatch(const float* tokens, const int* dest, int T, int H, int k,
                         float* recv /* symmetric [n][cap][H] */, uint64_t* recv_count /* symmetric [n] */,
                         int* sent /* local [n], zero */) {
  int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  for (int t = blockIdx.x; t < T; t += gridDim.x)            // a block per token
    for (int j = 0; j < k; ++j) {
      int d = dest[t * k + j];
      if (already_sent_to(dest, t, j, d)) continue;           // once per PE
      int slot = atomicAdd(&sent[d], 1);                      // the sender counts the slots
      nvshmemx_float_put_nbi_block(recv + ((size_t)me * cap + slot) * H, tokens + (size_t)t * H, H, d);
    }
  grid_sync();                                                // every token issued
  if (blockIdx.x == 0 && threadIdx.x < n) {
    nvshmem_fence();                                          // data before the signal, per target
    nvshmemx_signal_op(recv_count + me, sent[threadIdx.x] + 1, NVSHMEM_SIGNAL_SET, threadIdx.x);
  }
}
"""
