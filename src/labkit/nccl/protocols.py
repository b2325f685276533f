"""NCCL's three protocols, Simple, LL and LL128, and the cost model NCCL itself uses to pick one.

A receiver must know when data has landed. The protocols differ in how:

- **Simple** writes a whole chunk, then a memory fence, then bumps a step counter the receiver
  polls: every byte is payload, but each step pays the fence and the flag round trip;
- **LL** (low latency) stores 8 bytes at a time, 4 of data and a 4-byte flag, in one 8-byte
  write the hardware makes atomic: no fence, the receiver polls the data itself, half the bytes
  are flags (``union ncclLLFifoLine`` in NCCL's ``device.h``);
- **LL128** stores 128-byte lines of which 8 bytes are the flag (``NCCL_LL128_DATAELEMS`` = 15 of
  16 8-byte words): 120/128 payload, relying on NVLink delivering a warp's 128-byte store whole.

The time NCCL predicts for a collective is ``latency + bytes / algorithm_bandwidth``
(``ncclTopoGetAlgoTime`` in ``src/graph/tuning.cc``); the constants below are that file's
(NCCL 2.8-era: later versions retune them per architecture, so these are a model, labelled so).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_positive_int

# From NCCL's tuning.cc (2.8-era), ring algorithm, microseconds.
RING_BASE_LATENCY_US = {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}
RING_HOP_LATENCY_US = {  # per ring step, by the link type the ring uses
    "NVLink": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4},
    "PCI": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
    "NET": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6},
}
LL128_MAX_ALLREDUCE_GBPS_PER_CHANNEL = 16.7  # ll128MaxBwPerCh[ncclCollAllReduce]
LINKS = tuple(RING_HOP_LATENCY_US)


@dataclass(frozen=True)
class Protocol:
    """How a protocol lays out what it stores: ``line_bytes`` per store, of which ``flag_bytes`` flag."""

    name: str
    line_bytes: int
    flag_bytes: int
    # NCCL's ring all-reduce bandwidth factor against the link (tuning.cc): LL's 1/4 is its
    # half-payload lines, paid on the read and the write side; LL128's 0.92 is about 120/128.
    ring_bandwidth_factor: float

    @property
    def payload_fraction(self) -> float:
        return (self.line_bytes - self.flag_bytes) / self.line_bytes

    def wire_bytes(self, payload_bytes: int) -> int:
        """Bytes stored to move ``payload_bytes``: whole lines, each with its flag."""
        if isinstance(payload_bytes, bool) or not isinstance(payload_bytes, int) or payload_bytes < 0:
            raise ValueError(f"payload_bytes must be a non-negative int, got {payload_bytes!r}")
        data_per_line = self.line_bytes - self.flag_bytes
        return -(-payload_bytes // data_per_line) * self.line_bytes


# Simple's "line" is its step: flags live in a separate head/tail counter, not beside the data.
PROTOCOLS = {
    "LL": Protocol("LL", line_bytes=8, flag_bytes=4, ring_bandwidth_factor=1 / 4),
    "LL128": Protocol("LL128", line_bytes=128, flag_bytes=8, ring_bandwidth_factor=0.92),
    "Simple": Protocol("Simple", line_bytes=1, flag_bytes=0, ring_bandwidth_factor=1.0),
}


def ring_all_reduce_time_us(protocol: str, nbytes: int, world_size: int, channels: int,
                            channel_gbps: float, link: str = "NVLink") -> float:
    """NCCL's predicted time of a ring all-reduce of ``nbytes`` over ``world_size`` ranks on one node.

    Bus bandwidth is ``channels * channel_gbps`` scaled by the protocol's factor (LL128 also
    capped per channel); algorithm bandwidth is bus bandwidth times ``n / 2(n-1)``; latency
    is the protocol's base plus one hop per ring step, ``2(n-1)`` of them.
    """
    check_choice(protocol, "protocol", PROTOCOLS)
    check_choice(link, "link", LINKS)
    check_positive_int(world_size, "world_size")
    check_positive_int(channels, "channels")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if isinstance(channel_gbps, bool) or not isinstance(channel_gbps, (int, float)) or channel_gbps <= 0:
        raise ValueError(f"channel_gbps must be a positive number of GB/s, got {channel_gbps!r}")
    if world_size == 1:
        return 0.0
    steps = 2 * (world_size - 1)
    bus_gbps = channels * channel_gbps * PROTOCOLS[protocol].ring_bandwidth_factor
    if protocol == "LL128":
        bus_gbps = min(bus_gbps, LL128_MAX_ALLREDUCE_GBPS_PER_CHANNEL * channels)
    algorithm_gbps = bus_gbps * world_size / steps
    latency_us = RING_BASE_LATENCY_US[protocol] + steps * RING_HOP_LATENCY_US[link][protocol]
    return latency_us + nbytes / (algorithm_gbps * 1e3)  # GB/s = 1e3 bytes per microsecond


def fastest_protocol(nbytes: int, world_size: int, channels: int, channel_gbps: float,
                     link: str = "NVLink") -> str:
    """The protocol NCCL's model would pick for this all-reduce (ties go to the first listed)."""
    times = {p: ring_all_reduce_time_us(p, nbytes, world_size, channels, channel_gbps, link) for p in PROTOCOLS}
    return min(times, key=times.get)
