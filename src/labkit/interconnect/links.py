"""The links a GPU talks over, from datasheets and specifications: modelled numbers, each cited.

Every rate here is one direction, per GPU (NVLink: all of a GPU's links together; PCIe: one
x16 link; a network: one NIC port per GPU), in GB/s of 1e9 bytes. Datasheets quote NVLink
as both directions added (900 GB/s for an H100 or H200) and networks in Gb/s per port
(400 Gb/s for NDR InfiniBand); :func:`per_direction_gbps` converts. None of these numbers
is measured by the book: the one machine it runs on has one GPU and no NIC worth timing.
The chapter says so wherever it shows them, and uses measured numbers where one exists
(the PCIe link and HBM, from the records of :mod:`labkit.streams` and :mod:`labkit.ceilings`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_choice, check_positive_int

# PCIe signalling rate per lane (GT/s) and line encoding, by generation (PCI-SIG base
# specifications). Gen 6 uses PAM4 with FLIT mode: no line code; its FLIT carries CRC and
# FEC bytes we do not subtract, so its number here is the raw rate, a slight overstatement.
PCIE_GENERATIONS = {
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 1.0),
}


def pcie_gbps(generation: int, lanes: int = 16) -> float:
    """One direction of a PCIe link in GB/s: GT/s per lane x lanes x encoding / 8 bits.

    The rate after line encoding and before packet (TLP/DLLP) overheads, which take a few
    percent more: no transfer reaches it.
    """
    check_choice(generation, "generation", tuple(PCIE_GENERATIONS))
    check_positive_int(lanes, "lanes")
    if lanes not in (1, 2, 4, 8, 16):
        raise ValueError(f"a PCIe link has 1, 2, 4, 8 or 16 lanes, got {lanes}")
    gt_per_s, encoding = PCIE_GENERATIONS[generation]
    return gt_per_s * lanes * encoding / 8


def per_direction_gbps(value: float, unit: str) -> float:
    """GB/s one way from a datasheet figure: ``'GB/s both ways'`` (NVLink) or ``'Gb/s'`` (a port)."""
    check_choice(unit, "unit", ("GB/s both ways", "Gb/s", "GB/s"))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"value must be a positive number, got {value!r}")
    if unit == "GB/s both ways":
        return value / 2
    if unit == "Gb/s":
        return value / 8
    return float(value)


@dataclass(frozen=True)
class Link:
    """One link technology, as its datasheet gives it."""

    name: str
    family: str           # "NVLink", "PCIe", "InfiniBand", "Ethernet (RoCE)"
    scope: str            # "scale-up" (inside an NVLink domain) or "host" or "scale-out"
    gbps: float           # one direction, per GPU, GB/s
    quoted: str           # the figure as the source quotes it
    example: str          # a system that has it
    cite: str             # bib keys


def _pcie(gen: int, example: str) -> Link:
    gt, _ = PCIE_GENERATIONS[gen]
    return Link(f"PCIe {gen}.0 x16", "PCIe", "host", pcie_gbps(gen), f"{gt:g} GT/s per lane", example,
                "pcisig2019pcie5,pcisigspecs")


LINKS: tuple[Link, ...] = (
    Link("NVLink 2", "NVLink", "scale-up", per_direction_gbps(300, "GB/s both ways"), "300 GB/s per GPU",
         "V100", "nvidianvlinkswitch"),
    Link("NVLink 3", "NVLink", "scale-up", per_direction_gbps(600, "GB/s both ways"), "600 GB/s per GPU",
         "A100", "nvidianvlinkswitch"),
    Link("NVLink 4", "NVLink", "scale-up", per_direction_gbps(900, "GB/s both ways"), "900 GB/s per GPU",
         "H100, H200 (HGX: 8 GPUs on NVSwitch)", "nvidianvlinkswitch,h200datasheet"),
    Link("NVLink 5", "NVLink", "scale-up", per_direction_gbps(1800, "GB/s both ways"), "1,800 GB/s per GPU",
         "B200 (HGX, 8 GPUs), GB200 NVL72 (72 GPUs)", "nvidianvlinkswitch,nvidiagb200nvl72"),
    _pcie(3, "V100-era hosts"),
    _pcie(4, "A100 hosts"),
    _pcie(5, "H100, H200, B200 hosts and ConnectX-7 NICs"),
    _pcie(6, "ConnectX-8 NICs, Blackwell Ultra hosts"),
    Link("InfiniBand NDR", "InfiniBand", "scale-out", per_direction_gbps(400, "Gb/s"), "400 Gb/s per port",
         "ConnectX-7, one per GPU in DGX H100/H200 and B200", "nvidiaconnectx7,dgxh100userguide,dgxb200userguide"),
    Link("InfiniBand XDR", "InfiniBand", "scale-out", per_direction_gbps(800, "Gb/s"), "800 Gb/s per port",
         "ConnectX-8 SuperNIC", "nvidiaconnectx8"),
    Link("Ethernet 400G (RoCE)", "Ethernet (RoCE)", "scale-out", per_direction_gbps(400, "Gb/s"),
         "400 Gb/s per port", "ConnectX-7 in Ethernet mode", "nvidiaconnectx7"),
)


def link(name: str) -> Link:
    """The :class:`Link` called ``name`` (``'NVLink 4'``, ``'InfiniBand NDR'``, ...)."""
    check_choice(name, "name", tuple(x.name for x in LINKS))
    return next(x for x in LINKS if x.name == name)


def bandwidth_ratio(scale_up: str, scale_out: str) -> float:
    """How many times a scale-up link's bandwidth per GPU is the network's (one direction each)."""
    up, out = link(scale_up), link(scale_out)
    if up.scope != "scale-up" or out.scope != "scale-out":
        raise ValueError(f"need a scale-up link and a scale-out one, got {up.name} ({up.scope}) and "
                         f"{out.name} ({out.scope})")
    return up.gbps / out.gbps
