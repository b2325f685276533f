"""What a rank holds and what it sends: the ZeRO paper's formulas, per stage.

Training with AdamW keeps four kinds of state per parameter. In mixed precision
(:data:`MIXED_ADAMW`) they are a 2-byte bf16 parameter that forward and backward read, a
2-byte bf16 gradient, and 12 bytes of optimizer state in fp32: the master copy of the
parameter that the update writes, and Adam's two moments. That is the 16 bytes per
parameter of the ZeRO paper (its ``K = 12``). Plain fp32 training (:data:`FP32_ADAMW`) has
no separate master copy and also comes to 16: a 4-byte parameter, a 4-byte gradient and
two 4-byte moments.

Each ZeRO stage divides one more of them by the number of ranks ``N``:

======== ===================== =====================================
stage    sharded               bytes per rank, mixed precision
======== ===================== =====================================
0 (DDP)  nothing               ``(2 + 2 + 12) * P``
1        optimizer state       ``(2 + 2) * P + 12 * P / N``
2        + gradients           ``2 * P + (2 + 12) * P / N``
3        + parameters          ``16 * P / N``
======== ===================== =====================================

Traffic per step, with ring collectives (each rank sends ``(N-1)/N`` of a reduce-scatter's
or all-gather's tensor, twice that for an all-reduce): stages 0-2 move the gradients'
reduce-scatter and the parameters' all-gather, ``2 * (N-1)/N * P`` elements per rank (an
all-reduce is exactly those two halves); stage 3 gathers the parameters twice, for
forward and again for backward, ``3 * (N-1)/N * P``: 1.5 times DDP.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_positive_int

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}
KINDS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of training state.

    ``master`` is the fp32 copy the optimizer updates (0 when the parameters are fp32
    already); ``moments`` is the optimizer's own state (AdamW: two fp32 tensors, 8 bytes).
    """

    name: str
    param: int
    grad: int
    master: int
    moments: int

    @property
    def optimizer(self) -> int:
        """Bytes per parameter that only the update reads: what ZeRO-1 shards."""
        return self.master + self.moments

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


MIXED_ADAMW = Precision("bf16 params and grads, fp32 master and AdamW moments", 2, 2, 4, 8)
FP32_ADAMW = Precision("fp32 params, grads and AdamW moments", 4, 4, 0, 8)


def _check_stage(stage: object) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (0 is DDP), got {stage!r}")
    return stage


def _check_precision(precision: object) -> Precision:
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a labkit.zero.Precision (MIXED_ADAMW, FP32_ADAMW), "
                        f"got {type(precision).__name__}")
    return precision


def state_bytes_per_rank(num_params: int, world_size: int, stage: int,
                         precision: Precision = MIXED_ADAMW) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state one rank holds at ZeRO ``stage``.

    Returns ``{"params", "grads", "optimizer", "total"}``. Shards are ``P / N`` exactly
    (a real shard is padded to a whole number of elements: at most ``N - 1`` more).
    """
    check_positive_int(num_params, "num_params")
    check_positive_int(world_size, "world_size")
    stage, precision = _check_stage(stage), _check_precision(precision)
    shard = num_params / world_size
    held = {
        "params": precision.param * (shard if stage >= 3 else num_params),
        "grads": precision.grad * (shard if stage >= 2 else num_params),
        "optimizer": precision.optimizer * (shard if stage >= 1 else num_params),
    }
    held["total"] = sum(held.values())
    return held


COLLECTIVE_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


def ring_bytes_sent(collective: str, tensor_bytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring ``collective`` over a tensor of ``tensor_bytes``."""
    check_choice(collective, "collective", COLLECTIVE_FACTOR)
    check_positive_int(world_size, "world_size")
    return COLLECTIVE_FACTOR[collective] * (world_size - 1) / world_size * tensor_bytes


def traffic_per_rank(num_params: int, world_size: int, stage: int, bytes_per_element: int,
                     regathered_params: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per training step at ZeRO ``stage``, by collective (ring algorithms).

    Stages 0-2: a reduce-scatter of the gradients and an all-gather of the parameters
    (DDP's all-reduce is the two together); stage 3: one reduce-scatter and two
    all-gathers (forward, and backward after the unit was freed). At stage 3,
    ``regathered_params`` says how many parameters are gathered again for backward
    (default all; FSDP keeps the root unit, which backward needs first, gathered).
    Returns ``{"reduce_scatter", "all_gather", "total"}``.
    """
    check_positive_int(num_params, "num_params")
    check_positive_int(world_size, "world_size")
    check_positive_int(bytes_per_element, "bytes_per_element")
    stage = _check_stage(stage)
    regathered = num_params if regathered_params is None else regathered_params
    if isinstance(regathered, bool) or not isinstance(regathered, int) or not 0 <= regathered <= num_params:
        raise ValueError(f"regathered_params must be an int in [0, num_params={num_params}], got {regathered!r}")
    gathered = num_params + (regathered if stage == 3 else 0)
    sent = {"reduce_scatter": ring_bytes_sent("reduce_scatter", num_params * bytes_per_element, world_size),
            "all_gather": ring_bytes_sent("all_gather", gathered * bytes_per_element, world_size)}
    sent["total"] = sent["reduce_scatter"] + sent["all_gather"]
    return sent


def fsdp_bytes_per_rank(unit_params: list[int], world_size: int, precision: Precision = MIXED_ADAMW, *,
                        root_params: int = 0, prefetch: bool = True) -> dict[str, float]:
    """ZeRO-3's peak as FSDP runs it: the shards, and what is whole at backward's worst moment.

    :func:`state_bytes_per_rank` at stage 3 counts only the shards. While backward reduces a
    unit's gradients, FSDP also holds that unit's parameters and full gradients, the next
    unit's parameters (with ``prefetch``), and the root unit's parameters (gathered from the
    start of forward to the end of backward). ``unit_params`` are the units' sizes in
    parameters, ``root_params`` the root's.
    """
    if not isinstance(unit_params, (list, tuple)) or not unit_params:
        raise ValueError(f"unit_params must be a non-empty list of parameter counts, got {unit_params!r}")
    for n in unit_params:
        check_positive_int(n, "each of unit_params")
    if isinstance(root_params, bool) or not isinstance(root_params, int) or root_params < 0:
        raise ValueError(f"root_params must be a non-negative int, got {root_params!r}")
    precision = _check_precision(precision)
    held = state_bytes_per_rank(sum(unit_params) + root_params, world_size, 3, precision)
    largest = max(unit_params)
    held["params"] += precision.param * (root_params + largest * (2 if prefetch else 1))
    held["grads"] += precision.grad * largest
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    return held


def activation_bytes(tokens: int, hidden: int, num_layers: int, *, checkpointed: bool = False,
                     bytes_per_element: int = 2) -> float:
    """Activations one rank keeps for backward, after Korthikanti et al. (2022).

    A transformer layer keeps about ``34 * tokens * hidden`` bytes in 16-bit (their Eq. 2
    without the ``5 a s / h`` attention-score term, which FlashAttention does not store).
    With full activation checkpointing a layer keeps only its input, ``2 * tokens * hidden``
    bytes, and backward recomputes one layer at a time, which briefly needs one layer's
    full set again. Activations are per rank and not sharded by ZeRO: each rank runs its own
    micro-batch.
    """
    for value, name in ((tokens, "tokens"), (hidden, "hidden"), (num_layers, "num_layers"),
                        (bytes_per_element, "bytes_per_element")):
        check_positive_int(value, name)
    full_layer = 34 / 2 * bytes_per_element * tokens * hidden
    if not checkpointed:
        return num_layers * full_layer
    return num_layers * bytes_per_element * tokens * hidden + full_layer
