"""How many warps of a kernel an H200 SM can hold at once, from its registers and warps.

A memory-bound kernel hides the ~microsecond latency of HBM by having many loads in
flight, and the loads in flight per SM grow with the warps resident on it. Residency is
capped by whichever runs out first: the SM's warp slots, its block slots, or its register
file. The limits are those of compute capability 9.0 in the CUDA programming guide's table
of technical specifications :cite:`nvidiacudaguide`; the allocation granularity
(registers are given to a warp in units of 256) is the one NVIDIA's occupancy calculator
uses for 9.0. Triton's copy kernels use no shared memory; kernels that do (a reduction's
scratch space, pipelined loads) pass ``shared_bytes``, and an SM's 228 KB of shared memory
:cite:`nvidiahoppertuning` caps their blocks too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import validate

MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 256  # registers per warp are rounded up to a multiple of this
WARP_SIZE = 32
SHARED_BYTES_PER_SM = 228 * 1024


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    limited_by: str

    @property
    def fraction(self) -> float:
        """Resident warps over the SM's 64 warp slots."""
        return self.warps_per_sm / MAX_WARPS_PER_SM


def occupancy(registers_per_thread: int, num_warps: int, shared_bytes: int = 0) -> Occupancy:
    """Resident blocks and warps per SM for a kernel of ``num_warps`` warps per block that
    uses ``shared_bytes`` of shared memory per block."""
    validate.check_positive_int(registers_per_thread, "registers_per_thread")
    validate.check_positive_int(num_warps, "num_warps")
    if isinstance(shared_bytes, bool) or not isinstance(shared_bytes, int) or shared_bytes < 0:
        raise ValueError(f"shared_bytes must be a non-negative int, got {shared_bytes!r}")
    if num_warps > MAX_WARPS_PER_SM // 2:
        raise ValueError(f"a block holds at most 32 warps, got num_warps={num_warps}")
    per_warp = -(-registers_per_thread * WARP_SIZE // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    limits = {
        "warp slots": MAX_WARPS_PER_SM // num_warps,
        "block slots": MAX_BLOCKS_PER_SM,
        "registers": (REGISTERS_PER_SM // per_warp) // num_warps,
    }
    if shared_bytes:
        limits["shared memory"] = SHARED_BYTES_PER_SM // shared_bytes
    limited_by = min(limits, key=limits.__getitem__)
    blocks = limits[limited_by]
    return Occupancy(blocks_per_sm=blocks, warps_per_sm=blocks * num_warps, limited_by=limited_by)


def compiled_registers(compiled) -> tuple[int, int]:
    """Registers per thread and spilled registers of a compiled Triton kernel (GPU only).

    Triton loads a kernel's binary, and learns its register count from the driver, on
    its first launch; a kernel compiled by ``warmup`` has not been loaded yet, so this
    loads it first (``_init_handles``, which launches nothing).
    """
    load = getattr(compiled, "_init_handles", None)
    if load is not None:
        load()
    return compiled.n_regs, compiled.n_spills
