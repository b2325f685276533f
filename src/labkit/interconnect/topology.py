"""What a machine's topology says, read the way ``nvidia-smi`` and NCCL print it.

``nvidia-smi topo -m`` prints a matrix: one row and one column per GPU (and NIC), each cell
the *kind of path* between the two devices, from the closest (``NV#``: # NVLinks bonded)
to the farthest (``SYS``: across the CPUs' socket interconnect). Its legend is
:data:`NVSMI_LEGEND`. NCCL classifies paths with nearly the same words (``PATH_NVL``,
``PATH_PIX``, ... in ``src/graph/topo.h``; :data:`NCCL_PATH_TYPES`, closest first) and
prints them in its ``NCCL_DEBUG=INFO`` topology dump as ``GPU/0-60 (hops/bandwidth/type)``,
which :func:`nccl_paths` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# nvidia-smi topo -m's legend, closest path first (X is the device itself).
NVSMI_LEGEND = {
    "X": "the device itself",
    "NV#": "a bonded set of # NVLinks",
    "PIX": "at most a single PCIe bridge (both devices under one PCIe switch)",
    "PXB": "multiple PCIe bridges, without traversing the PCIe Host Bridge",
    "PHB": "PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "NODE": "PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node",
    "SYS": "PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
}

# NCCL's path types (src/graph/topo.h, NCCL 2.2x), closest first. NODE has no NCCL
# counterpart: NCCL calls it PHB.
NCCL_PATH_TYPES = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS")
NCCL_PATH_MEANING = {
    "LOC": "the device itself",
    "NVL": "NVLink, directly or through NVSwitch",
    "NVB": "NVLink through an intermediate GPU",
    "C2C": "a chip-to-chip link between CPU and GPU (Grace Hopper, Grace Blackwell)",
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges, no host bridge",
    "P2C": "GPU to NIC through C2C to the CPU, then PCIe",
    "PXN": "GPU to NIC through another GPU over NVLink (rail-local sends)",
    "PHB": "through a PCIe host bridge (the CPU)",
    "SYS": "across the CPU sockets' interconnect",
    "NET": "through the network",
    "DIS": "disconnected",
}
# What NCCL does with a path by default (src/graph/paths.cc): GPU-to-GPU P2P up to PXB
# (NCCL_P2P_LEVEL), GPUDirect RDMA between NIC and GPU up to PXB (NCCL_NET_GDR_LEVEL).
NCCL_DEFAULT_P2P_LEVEL = "PXB"
NCCL_DEFAULT_GDR_LEVEL = "PXB"


def nvsmi_code(cell: str) -> str:
    """The legend entry of one matrix cell: ``'NV18'`` -> ``'NV#'``, others as they are."""
    cell = cell.strip()
    if re.fullmatch(r"NV\d+", cell):
        return "NV#"
    if cell not in NVSMI_LEGEND:
        raise ValueError(f"{cell!r} is not an nvidia-smi topo -m path; known: NV<n>, "
                         + ", ".join(k for k in NVSMI_LEGEND if k != "NV#"))
    return cell


def closeness(cell: str) -> int:
    """Rank of a cell in the legend, 0 for ``X`` (closest) up to ``SYS``."""
    return list(NVSMI_LEGEND).index(nvsmi_code(cell))


@dataclass(frozen=True)
class TopoMatrix:
    """``nvidia-smi topo -m`` parsed: device names, the path matrix, and the other columns."""

    devices: tuple[str, ...]
    paths: tuple[tuple[str, ...], ...]
    extra: dict[str, dict[str, str]]

    def path(self, a: str, b: str) -> str:
        return self.paths[self.devices.index(a)][self.devices.index(b)]

    def nvlinks(self, a: str, b: str) -> int:
        """Bonded NVLinks between two devices (0 if their path is not NVLink)."""
        cell = self.path(a, b)
        return int(cell[2:]) if nvsmi_code(cell) == "NV#" else 0


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Read the matrix part of ``nvidia-smi topo -m`` (the legend below it is ignored).

    The header names the devices, then the extra columns (``CPU Affinity``, ``NUMA
    Affinity``, ``GPU NUMA ID``); each row is a device name, one cell per device, and the
    extra values. Raises ``ValueError`` on text without such a matrix.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header_at = next((i for i, ln in enumerate(lines) if re.match(r"^\s+(GPU|NIC)\d+", ln)), None)
    if header_at is None:
        raise ValueError("no nvidia-smi topo -m header (a line starting with blanks, then GPU0 ...) found")
    header = lines[header_at]
    # Columns are separated by tabs (or runs of spaces); the extra column names have single spaces.
    cols = [c.strip() for c in re.split(r"\t+|\s{2,}", header.strip()) if c.strip()]
    devices = tuple(c for c in cols if re.fullmatch(r"(GPU|NIC)\d+", c))
    extras = cols[len(devices):]
    paths, extra = [], {}
    for ln in lines[header_at + 1:]:
        cells = [c.strip() for c in re.split(r"\t+|\s+", ln.strip()) if c.strip()]
        if not cells or cells[0] not in devices:
            break
        row = cells[1:1 + len(devices)]
        if len(row) != len(devices):
            raise ValueError(f"row {cells[0]} has {len(row)} path cells for {len(devices)} devices")
        for cell in row:
            nvsmi_code(cell)
        paths.append(tuple(row))
        extra[cells[0]] = dict(zip(extras, cells[1 + len(devices):]))
    if len(paths) != len(devices):
        raise ValueError(f"found {len(paths)} rows for {len(devices)} devices")
    return TopoMatrix(devices, tuple(paths), extra)


NCCL_PATH_ENTRY = re.compile(r"(?P<node>[A-Z]+/[0-9a-fA-F-]+) \((?P<hops>\d+)/(?P<bw>[\d.]+)/(?P<type>[A-Z0-9]+)\)")
NCCL_PATH_LINE = re.compile(r"^(?P<src>[A-Z]+/[0-9a-fA-F-]+) :(?P<rest>.*)$")


def nccl_paths(lines: list[str]) -> list[dict]:
    """NCCL's computed paths from an INFO topology dump: one row per (from, to) pair.

    NCCL prints, for each GPU and NIC, ``GPU/0-60 :GPU/0-60 (0/5000.0/LOC) CPU/0-ff (1/48.0/PHB)``:
    to each node, the hops, the path's bandwidth in GB/s as NCCL models it, and the path type.
    """
    from ..nccl.log import message

    rows = []
    for line in lines:
        msg = message(line) if " NCCL " in line else line
        m = NCCL_PATH_LINE.match((msg or "").strip())
        if not m:
            continue
        for e in NCCL_PATH_ENTRY.finditer(m["rest"]):
            if e["type"] not in NCCL_PATH_TYPES:
                continue
            rows.append({"from": m["src"], "to": e["node"], "hops": int(e["hops"]), "nccl_gbps": float(e["bw"]),
                         "type": e["type"], "meaning": NCCL_PATH_MEANING[e["type"]]})
    return rows
