"""Read an ``NCCL_DEBUG=INFO`` log: what NCCL found, built and connected when a communicator came up.

NCCL prefixes each line ``host:pid:tid [cudaDev] NCCL INFO``; the rest is free text whose
shapes are stable enough to parse (formats from NCCL 2.18-2.27's ``init.cc``, ``graph/*.cc``
and ``transport.cc``). :func:`parse` turns the lines into an :class:`NcclLog`;
:func:`annotate` says, per line, which stage of initialization it belongs to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PREFIX = re.compile(r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL (?P<level>INFO|WARN) (?P<msg>.*)$")
VERSION = re.compile(r"NCCL version (?P<version>\S+)")
COMM_INIT = re.compile(r"(?P<fn>ncclCommInit\w*) comm (?P<comm>0x[0-9a-f]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+)"
                       r" cudaDev (?P<cuda_dev>\d+)(?: nvmlDev (?P<nvml_dev>\d+))? busId (?P<bus_id>[0-9a-f]+)"
                       r".*- Init (?P<phase>START|COMPLETE)")
RING_CHANNEL = re.compile(r"^Channel (?P<channel>\d+)/(?P<total>\d+) :\s+(?P<ranks>(?:\d+\s*)+)$")
TRANSPORT = re.compile(r"^Channel (?P<channel>\d+)/(?:\d+|\d+) : (?P<src>\d+)\[(?P<src_dev>\d+)\] -> "
                       r"(?P<dst>\d+)\[(?P<dst_dev>\d+)\] (?:\[(?P<kind>send|receive)\] )?via (?P<via>\S+)")
TREES = re.compile(r"^Trees (?P<trees>.*)$")
CHANNEL_COUNTS = re.compile(r"^(?P<coll>\d+) coll channels, (?:(?P<collnet>\d+) collnet channels, )?"
                            r"(?:(?P<nvls>\d+) nvls channels, )?(?P<p2p>\d+) p2p channels")
ENV_SET = re.compile(r"^(?P<name>NCCL_\w+) set by environment to (?P<value>.*?)\.?$")  # NCCL ends the line with "."
INIT_TIMINGS = re.compile(r"^Init timings.*?: rank \d+ nranks \d+ total (?P<total>[\d.]+) \((?P<parts>[^)]*)\)")
GRAPH_PATTERN = re.compile(r"^Pattern (?P<pattern>\d+), crossNic (?P<cross_nic>\d+), nChannels (?P<channels>\d+), "
                           r"bw (?P<bw>[\d.]+)/(?P<bw_inter>[\d.]+), type (?P<type>\S+), sameChannels (?P<same>\d)")
NETWORK = re.compile(r"^Using network (?P<net>\S+)")

# What each stage of initialization is, in the order NCCL reaches them.
STAGES = {
    "version": "library and CUDA driver versions",
    "bootstrap": "bootstrap: the out-of-band socket network the unique id points at",
    "network": "network plugin and the NICs NCCL may use (NET transport)",
    "comm": "ncclCommInitRank: a communicator starts and completes",
    "env": "an NCCL_* variable read from the environment",
    "topology": "topology detection: the system graph of CPUs, PCI switches, GPUs, NICs, NVLinks",
    "graph": "graph search: the rings and trees, their channel count and bandwidth",
    "channels": "channels: one ring (and tree) per channel, each run by its own thread block",
    "transport": "transports: how each channel's connection to a peer moves data (P2P, SHM, NET)",
    "timing": "how long each part of initialization took",
    "other": "everything else",
}


@dataclass
class NcclLog:
    version: str | None = None
    comms: list[dict] = field(default_factory=list)
    rings: dict[int, list[int]] = field(default_factory=dict)
    trees: str | None = None
    transports: list[dict] = field(default_factory=list)
    channel_counts: dict[str, int] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    graphs: list[dict] = field(default_factory=list)
    init_timings: dict[str, float] = field(default_factory=dict)
    network: str | None = None
    nccl_lines: int = 0

    @property
    def channels(self) -> int:
        """Collective channels: from the summary line where NCCL printed one, else the rings seen."""
        return self.channel_counts.get("coll", len(self.rings))


def message(line: str) -> str | None:
    """The text after ``NCCL INFO``, or ``None`` for a line NCCL did not write."""
    m = PREFIX.match(line.rstrip("\n"))
    return m["msg"].strip() if m else None


def stage(msg: str) -> str:
    """Which stage of :data:`STAGES` an INFO message belongs to."""
    rules = [
        ("version", ("NCCL version", "cudaDriverVersion")),
        ("bootstrap", ("Bootstrap",)),
        ("network", ("NET/", "Using network", "Using non-device net", "Using internal net", "Failed to open libibverbs")),
        ("comm", ("ncclCommInit", "comm 0x")),
        ("transport", ("P2P Chunksize", "Check P2P Type", "P2P/", "SHM/")),
        ("timing", ("Init timings",)),
        ("env", (" set by environment to ",)),
        ("graph", ("Pattern ", "Ring ", "Tree ", "Trees", "Pattern", "Connected all", "Search")),
        ("topology", ("===", "CPU/", "GPU/", "PCI/", "NIC/", "NET/", "+ ", "Setting affinity", "NVLS multicast",
                      "Topology", "topo")),
    ]
    if TRANSPORT.match(msg):
        return "transport"
    if RING_CHANNEL.match(msg) or CHANNEL_COUNTS.match(msg) or "channels" in msg:
        return "channels"
    for name, needles in rules:
        if any(n in msg for n in needles):
            return name
    return "other"


def parse(lines: list[str] | str) -> NcclLog:
    """Everything :class:`NcclLog` holds, from a log's lines (or its text)."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    if not isinstance(lines, (list, tuple)) or not all(isinstance(x, str) for x in lines):
        raise TypeError("lines must be a string or a list of strings (an NCCL_DEBUG=INFO log)")
    log = NcclLog()
    for line in lines:
        v = VERSION.search(line)
        if v and log.version is None:
            log.version = v["version"]
        msg = message(line)
        if msg is None:
            continue
        log.nccl_lines += 1
        if m := COMM_INIT.search(msg):
            log.comms.append({k: (int(x) if k in ("rank", "nranks", "cuda_dev") else x)
                              for k, x in m.groupdict().items() if x is not None})
        elif m := RING_CHANNEL.match(msg):
            log.rings[int(m["channel"])] = [int(r) for r in m["ranks"].split()]
        elif m := TRANSPORT.match(msg):
            log.transports.append({"channel": int(m["channel"]), "src": int(m["src"]), "dst": int(m["dst"]),
                                   "transport": m["via"].split("/")[0], "via": m["via"]})
        elif m := TREES.match(msg):
            log.trees = m["trees"]
        elif m := CHANNEL_COUNTS.match(msg):
            log.channel_counts = {k: int(x) for k, x in m.groupdict().items() if x is not None}
        elif m := ENV_SET.match(msg):
            log.environment[m["name"]] = m["value"].strip()
        elif m := INIT_TIMINGS.match(msg):
            log.init_timings = {"total": float(m["total"])}
            for part in m["parts"].split(","):
                name, _, value = part.strip().rpartition(" ")
                if name:
                    log.init_timings[name] = float(value)
        elif m := GRAPH_PATTERN.match(msg):
            log.graphs.append({"pattern": int(m["pattern"]), "channels": int(m["channels"]),
                               "bw_gbps": float(m["bw"]), "type": m["type"]})
        elif m := NETWORK.match(msg):
            log.network = m["net"]
    return log


def annotate(lines: list[str] | str) -> list[dict]:
    """One row per NCCL line: its stage, what that stage is, and the message."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    rows = []
    for line in lines:
        msg = message(line)
        if msg is None:
            v = VERSION.search(line)
            if v:
                rows.append({"stage": "version", "meaning": STAGES["version"], "message": line.strip()})
            continue
        name = stage(msg)
        rows.append({"stage": name, "meaning": STAGES[name], "message": msg})
    return rows
