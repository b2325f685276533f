"""ZeRO and FSDP from scratch: the 16 bytes per parameter of AdamW, sharded across ranks.

>>> from labkit.zero import state_bytes_per_rank, MIXED_ADAMW
>>> state_bytes_per_rank(7_000_000_000, 8, stage=3)["total"] / 2**30   # GiB per rank

- :mod:`.memory`: what each stage holds per rank and sends per step (the formulas).
- :mod:`.layout`: FSDP1's flat cut and FSDP2's per-parameter cut of a group of tensors.
- :mod:`.comm`: the collectives the wrappers call, every byte counted.
- :mod:`.optim`: AdamW on a flat shard, a chunk at a time.
- :mod:`.accounting`: the bytes a rank holds, measured from its tensors' storage.
- :mod:`.zero`: ZeRO-1 and ZeRO-2 (:class:`ZeroDataParallel`).
- :mod:`.fsdp`: ZeRO-3 as FSDP does it (:class:`FullyShard`), with prefetching.
- :mod:`.programs`: what each rank runs, against torch's FSDP2 and ZeroRedundancyOptimizer.

The tests check losses and parameters step by step against ``torch.distributed.fsdp.fully_shard``
and ``torch.distributed.optim.ZeroRedundancyOptimizer`` on gloo processes.
"""

from .accounting import MemoryMeter, held_bytes
from .comm import Communicator, Transfer, counting_torch_collectives
from .fsdp import FullyShard, ShardedUnit
from .layout import LAYOUTS, FlatLayout, PerParameterLayout
from .memory import (FP32_ADAMW, KINDS, MIXED_ADAMW, STAGE_NAMES, STAGES, Precision, fsdp_bytes_per_rank,
                     ring_bytes_sent, state_bytes_per_rank, traffic_per_rank)
from .optim import ShardedAdamW
from .zero import ZeroDataParallel, trainable_parameters

__all__ = [
    "FP32_ADAMW", "KINDS", "LAYOUTS", "MIXED_ADAMW", "STAGES", "STAGE_NAMES", "Communicator", "FlatLayout",
    "FullyShard", "MemoryMeter", "PerParameterLayout", "Precision", "ShardedAdamW", "ShardedUnit", "Transfer",
    "ZeroDataParallel", "counting_torch_collectives", "fsdp_bytes_per_rank", "held_bytes", "ring_bytes_sent", "state_bytes_per_rank", "traffic_per_rank",
    "trainable_parameters",
]
