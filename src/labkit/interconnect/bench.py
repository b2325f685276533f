"""The interconnects chapter's benchmark: this machine's host link, from a few bytes up, and its topology.

``streams.copy_bandwidth`` (the cuda-streams chapter) times host-device copies from 4 KiB
up, which is where bandwidth lives. The alpha of the alpha-beta model lives below that:
this benchmark times pinned copies each way, and device-to-device copies in HBM, from
4 bytes to 64 MiB, fits each with :func:`labkit.interconnect.model.copy_fit` (from the
step up where :func:`~labkit.interconnect.model.copy_step` finds one), and records
what the driver says of the machine: ``nvidia-smi topo -m`` and the PCIe link's
generation and width (current and maximum), so the chapter can compare the measured rate
with the link's own.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import torch

from .. import backend, timing
from ..benchmarks import Measurement, benchmark
from ..results import Goal
from ..streams import bandwidth
from . import links, model

CHAPTER = "interconnects"
SIZES_GPU = [4 ** k for k in range(1, 14)]  # 4 B .. 64 MiB
SIZES_CPU = [4 ** k for k in range(1, 8)]
FIT_GOAL = 0.35     # worst relative error of the fitted line over the copies it describes
PCIE_QUERY = "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def pcie_link() -> dict:
    """The GPU's PCIe generation and width as the driver reports them (empty where it cannot)."""
    out = _nvidia_smi(f"--query-gpu={PCIE_QUERY}", "--format=csv,noheader,nounits")
    if not out:
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    keys = ("gen_current", "gen_max", "width_current", "width_max")
    info = {k: int(v) for k, v in zip(keys, values) if v.isdigit()}
    if info.get("gen_max") in links.PCIE_GENERATIONS and info.get("width_max") in (1, 2, 4, 8, 16):
        info["gbps_max"] = links.pcie_gbps(info["gen_max"], info["width_max"])
    return info


def _device_copy(n_bytes: int):
    src = torch.empty(n_bytes, dtype=torch.uint8, device=backend.device()).fill_(bandwidth.FILL_BYTE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


@benchmark("interconnect.host_link", chapter=CHAPTER,
           title="Small to large copies over PCIe (pinned, each way) and within HBM, with alpha-beta fits")
def host_link() -> Measurement:
    rows = []
    for direction in ("h2d", "d2h", "d2d"):
        for n_bytes in backend.pick(cpu=SIZES_CPU, gpu=SIZES_GPU):
            if direction == "d2d":
                t = timing.measure(_device_copy(n_bytes), flush_l2=False)
            else:
                t, _ = bandwidth.transfer_timing(n_bytes, direction, pinned=True)
            rows.append({"direction": direction, "bytes": n_bytes, "pinned_us": t.median_ms * 1e3,
                         "gbps": n_bytes / t.seconds / 1e9})
    fits, goals = {}, []
    for direction in ("h2d", "d2h", "d2d"):
        # Where the small copies show a step (two mechanisms, two levels), the line is fitted
        # from the step up and the copies below it are described by their level.
        step = model.copy_step(rows, direction)
        fit_from = step.above_bytes if step else 0
        fit = model.copy_fit(rows, direction, fit_from_bytes=fit_from)
        sizes = sorted(r["bytes"] for r in rows if r["direction"] == direction)
        worst = fit.max_rel_error(sizes, fit_from)
        fits[direction] = {"alpha_us": fit.fixed_s * 1e6, "bandwidth_gbps": fit.bandwidth_gbps,
                           "worst_rel_error": worst,
                           # A sweep whose copies all cost the same (the CPU's memcpy of a few KiB) has no slope.
                           "half_bandwidth_bytes": model.half_bandwidth_bytes(fit) if fit.per_byte_s > 0 else None,
                           "fit_from_bytes": fit_from, "step": dataclasses.asdict(step) if step else None}
        for r in rows:
            if r["direction"] == direction:
                r["model_us"] = fit.predict(r["bytes"]) * 1e6
                r["model/measured"] = r["model_us"] / r["pinned_us"]
        # Over PCIe a copy is one line (from the step up, where there is one); in HBM the middle sizes
        # sit in the L2 (60 MiB on the H200) and copy faster than the line through both ends, so the
        # d2d fit is shown, not held to a goal.
        if direction != "d2d":
            where = f" from the step up ({fit_from} B)" if step else ""
            goals.append(Goal(f"{direction}: worst relative error of the alpha-beta line{where}", worst, "<=",
                              FIT_GOAL))
    best = {d: max(r["gbps"] for r in rows if r["direction"] == d) for d in ("h2d", "d2h", "d2d")}
    pcie = pcie_link() if backend.on_gpu() else {}
    limits = {f"{d}_best_gbps": v for d, v in best.items()}
    if "gbps_max" in pcie:
        limits["pcie_link_gbps"] = pcie["gbps_max"]
        goals += [Goal(f"{d} best / the PCIe link's rate (gen {pcie['gen_max']} x{pcie['width_max']})",
                       best[d] / pcie["gbps_max"], "<=", 1.0) for d in ("h2d", "d2h")]
    return Measurement(
        rows=rows, metric="microseconds per copy (CUDA-event median); GB/s of bytes copied",
        limits=limits, goals=goals,
        config={"fits": fits, "pcie": pcie, "topo_matrix": _nvidia_smi("topo", "-m") if backend.on_gpu() else None,
                "gpus": torch.cuda.device_count() if backend.on_gpu() else 0,
                "host_memory": "pinned" if backend.on_gpu() else "pageable (no CUDA driver to pin)",
                "d2d": "torch copy_ of a uint8 buffer within one GPU's memory; bytes copied (not read+written)",
                "timing": "labkit.timing.measure, no L2 flush: the copy of a few bytes is all launch and DMA setup"})
