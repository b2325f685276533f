"""NCCL from the inside: bootstrap, protocols, the pipelined ring, and its logs.

- :mod:`~labkit.nccl.bootstrap`: a communicator built by hand through a ``TCPStore``
  (rendezvous, the unique id, the peers), as torchrun and ``init_process_group`` do;
- :mod:`~labkit.nccl.protocols`: Simple, LL and LL128, and NCCL's own time model;
- :mod:`~labkit.nccl.ring`: the sliced, pipelined ring all-reduce as a schedule and a timeline,
  against the naive host-driven ring;
- :mod:`~labkit.nccl.log`: a parser for ``NCCL_DEBUG=INFO`` logs;
- :mod:`~labkit.nccl.bench`: the record, ``nccl.init_log`` (one rank, eager and lazy init).
"""

from .log import NcclLog, annotate, parse
from .protocols import PROTOCOLS, fastest_protocol, ring_all_reduce_time_us
from .ring import LinkModel, Send, Timeline, bytes_per_link, naive_ring, pipelined_ring, pipelined_ring_sends, simulate

__all__ = [
    "PROTOCOLS", "LinkModel", "NcclLog", "Send", "Timeline", "annotate", "bytes_per_link", "fastest_protocol",
    "naive_ring", "parse", "pipelined_ring", "pipelined_ring_sends", "ring_all_reduce_time_us", "simulate",
]
