"""Interconnects: the links between GPUs, what one machine measures of them, and what they cost.

- :mod:`.links`: NVLink, PCIe, InfiniBand and RoCE from their datasheets (modelled, cited);
- :mod:`.topology`: ``nvidia-smi topo -m`` and NCCL's path types, parsed and explained;
- :mod:`.model`: alpha-beta lines through measured copy sweeps, and each parallelism's
  traffic priced on NVLink and on the network (:func:`strategy_costs`);
- :mod:`.figures`: the chapter's plotly figures; :mod:`.bench`: ``interconnect.host_link``.

The functions below check their arguments and call those modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from . import links, model, topology
from .links import LINKS, bandwidth_ratio, link, pcie_gbps, per_direction_gbps
from .model import (STRATEGIES, CopyStep, LinkModel, MoeSpec, best_plans, half_bandwidth_bytes, strategy_costs,
                    strategy_traffic)
from .topology import NCCL_PATH_TYPES, NVSMI_LEGEND, nccl_paths, parse_topo_matrix

__all__ = [
    "LINKS", "NCCL_PATH_TYPES", "NVSMI_LEGEND", "STRATEGIES", "CopyStep", "LinkModel", "MoeSpec", "bandwidth_ratio",
    "best_plans", "copy_fit", "copy_step", "half_bandwidth_bytes", "link", "links", "model", "nccl_paths",
    "parse_topo_matrix",
    "pcie_gbps", "per_direction_gbps", "strategy_costs", "strategy_traffic", "topology",
]


def copy_fit(rows: Sequence[Mapping], direction: str, *, kind: str = "pinned", fit_from_bytes: float = 0.0):
    """The alpha-beta line through one direction of a recorded copy sweep; see :func:`.model.copy_fit`."""
    _check_sweep(rows, direction)
    if isinstance(fit_from_bytes, bool) or not isinstance(fit_from_bytes, (int, float)) or fit_from_bytes < 0:
        raise ValueError(f"fit_from_bytes must be a number >= 0, got {fit_from_bytes!r}")
    return model.copy_fit(rows, direction, kind=kind, fit_from_bytes=fit_from_bytes)


def copy_step(rows: Sequence[Mapping], direction: str, *, kind: str = "pinned"):
    """The step in one direction's small copies of a recorded sweep, or ``None``; see :func:`.model.copy_step`."""
    _check_sweep(rows, direction)
    return model.copy_step(rows, direction, kind=kind)


def _check_sweep(rows, direction) -> None:
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a list of dicts (a record's rows), got {type(rows).__name__}")
    if not isinstance(direction, str):
        raise TypeError(f"direction must be a str, got {type(direction).__name__}")
