"""labkit.nccl: the hand-built bootstrap, the protocol model, the pipelined ring, the log parser."""

import random

import pytest
import torch

from labkit import check
from labkit.collectives import launch
from labkit.nccl import bootstrap, log, protocols, ring

# A two-rank log in NCCL 2.2x's INFO format (the shapes log.py parses), made up for the test:
# the one-GPU record cannot show transports between two ranks.
SAMPLE = """\
node:100:100 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
node:100:100 [0] NCCL INFO cudaDriverVersion 12040
NCCL version 2.21.5+cuda12.4
node:100:120 [0] NCCL INFO NET/IB : No device found.
node:100:120 [0] NCCL INFO Using network Socket
node:100:120 [0] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0.
node:100:120 [0] NCCL INFO ncclCommInitRank comm 0x55aa rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 commId 0x1f - Init START
node:100:120 [0] NCCL INFO Setting affinity for GPU 0 to ffff
node:100:120 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 2, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1
node:100:120 [0] NCCL INFO Channel 00/02 :    0   1
node:100:120 [0] NCCL INFO Channel 01/02 :    0   1
node:100:120 [0] NCCL INFO Trees [0] 1/-1/-1->0->-1 [1] 1/-1/-1->0->-1
node:100:120 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
node:100:120 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
node:100:120 [0] NCCL INFO Connected all rings
node:100:120 [0] NCCL INFO 2 coll channels, 2 collnet channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer
node:100:120 [0] NCCL INFO ncclCommInitRank comm 0x55aa rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 commId 0x1f - Init COMPLETE
node:100:120 [0] NCCL INFO Init timings: rank 0 nranks 2 total 0.52 (kernels 0.20, bootstrap 0.01, allgathers 0.00, topo 0.05, graphs 0.00, connections 0.10, rest 0.16)
not an NCCL line
"""


# --- log ------------------------------------------------------------------------------

def test_parse_reads_every_section_of_the_sample():
    parsed = log.parse(SAMPLE)
    assert parsed.version == "2.21.5+cuda12.4"
    assert [c["phase"] for c in parsed.comms] == ["START", "COMPLETE"]
    assert parsed.comms[0]["nranks"] == 2 and parsed.comms[0]["bus_id"] == "18000"
    assert parsed.rings == {0: [0, 1], 1: [0, 1]}
    assert parsed.channels == 2 and parsed.channel_counts["p2p"] == 2 and parsed.channel_counts["nvls"] == 0
    assert {t["transport"] for t in parsed.transports} == {"P2P"}
    assert parsed.transports[0]["via"] == "P2P/CUMEM/read"
    assert parsed.environment == {"NCCL_NVLS_ENABLE": "0"}  # the value without the line's closing period
    assert parsed.graphs == [{"pattern": 4, "channels": 2, "bw_gbps": 40.0, "type": "NVL/PIX"}]
    assert parsed.init_timings["total"] == pytest.approx(0.52) and parsed.init_timings["connections"] == 0.10
    assert parsed.network == "Socket"
    assert parsed.nccl_lines == 17  # every prefixed line, and not the bare version or the foreign line


def test_transport_kinds_are_told_apart():
    lines = ["h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct",
             "h:1:2 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA",
             "h:1:2 [0] NCCL INFO Channel 01/0 : 2[0] -> 0[0] via P2P/IPC"]
    assert [t["transport"] for t in log.parse(lines).transports] == ["SHM", "NET", "P2P"]
    assert [t["src"] for t in log.parse(lines).transports] == [0, 1, 2]


def test_annotate_puts_each_line_in_its_stage():
    stages = [row["stage"] for row in log.annotate(SAMPLE)]
    assert stages[:3] == ["bootstrap", "version", "version"]
    for expected in ("network", "env", "comm", "graph", "channels", "transport", "timing", "topology"):
        assert expected in stages, expected
    assert len(stages) == 18  # the foreign line is dropped, the bare version line kept


def test_stage_of_single_messages():
    assert log.stage("P2P Chunksize set to 131072") == "transport"
    assert log.stage("Channel 03/32 :    0") == "channels"
    assert log.stage("=== System : maxBw 0.0 totalBw 0.0 ===") == "topology"
    assert log.stage("NCCL_DEBUG_SUBSYS set by environment to INIT,GRAPH,ENV") == "env"
    assert log.stage("something new") == "other"


def test_parse_rejects_what_is_not_a_log():
    with pytest.raises(TypeError, match="list of strings"):
        log.parse([1, 2])
    assert log.parse("").comms == [] and log.parse("").channels == 0


# --- protocols ------------------------------------------------------------------------

def test_wire_bytes_follow_the_line_formats():
    assert protocols.PROTOCOLS["LL"].payload_fraction == 0.5
    assert protocols.PROTOCOLS["LL128"].payload_fraction == 120 / 128
    assert protocols.PROTOCOLS["LL128"].wire_bytes(121) == 256  # two lines: 120 + 1 payload bytes
    assert protocols.PROTOCOLS["LL"].wire_bytes(4) == 8
    assert protocols.PROTOCOLS["Simple"].wire_bytes(1000) == 1000
    with pytest.raises(ValueError, match="non-negative int"):
        protocols.PROTOCOLS["LL"].wire_bytes(-1)


def test_small_messages_pick_ll_and_large_ones_simple():
    """The model's latency favours LL at a few KB and its bandwidth favours Simple at hundreds of MB."""
    args = dict(world_size=8, channels=16, channel_gbps=20.0)
    assert protocols.fastest_protocol(4096, **args) == "LL"
    assert protocols.fastest_protocol(1 << 28, **args) == "Simple"
    times = [protocols.ring_all_reduce_time_us("Simple", s, **args) for s in (1 << 20, 1 << 22, 1 << 24)]
    assert times == sorted(times)


def test_time_model_matches_its_formula():
    n, c, bw, size = 4, 8, 25.0, 3 << 20
    steps = 2 * (n - 1)
    want = 8.4 + steps * 3.4 + size / (c * bw * n / steps * 1e3)
    assert protocols.ring_all_reduce_time_us("Simple", size, n, c, bw) == pytest.approx(want)
    assert protocols.ring_all_reduce_time_us("LL", size, 1, c, bw) == 0.0


def test_protocol_model_errors():
    with pytest.raises(ValueError, match="protocol"):
        protocols.ring_all_reduce_time_us("LL64", 1, 2, 1, 1.0)
    with pytest.raises(ValueError, match="channel_gbps"):
        protocols.ring_all_reduce_time_us("LL", 1, 2, 1, 0)
    with pytest.raises(ValueError, match="link"):
        protocols.ring_all_reduce_time_us("LL", 1, 2, 1, 1.0, link="carrier pigeon")


# --- ring -----------------------------------------------------------------------------

def _reduce_by_sends(sends, n, nbytes):
    """Run the sends on sets of contributors per byte range; every rank must end with all of them."""
    held = [[frozenset({r})] * nbytes for r in range(n)]
    for key in sorted({(s.channel, s.round, s.step, s.slice) for s in sends}):
        step_sends = [s for s in sends if (s.channel, s.round, s.step, s.slice) == key]
        payload = [(s, held[s.src][s.start:s.stop]) for s in step_sends]  # all sends of a step at once
        for s, data in payload:
            reduce_scatter = s.step < n - 1
            held[s.dst][s.start:s.stop] = [(a | b) if reduce_scatter else b
                                           for a, b in zip(held[s.dst][s.start:s.stop], data)]
    everyone = frozenset(range(n))
    return all(x == everyone for row in held for x in row)


@pytest.mark.parametrize("n, nbytes, channels, chunk_bytes, slices", [(2, 37, 1, 5, 2), (3, 100, 2, 7, 3),
                                                                       (5, 61, 3, 4, 1), (4, 9, 1, 64, 2),
                                                                       (1, 10, 2, 3, 2)])
def test_pipelined_schedule_reduces_every_byte(n, nbytes, channels, chunk_bytes, slices):
    sends = ring.pipelined_ring_sends(n, nbytes, channels, chunk_bytes, slices)
    assert all(s.nbytes <= -(-chunk_bytes // slices) for s in sends)
    assert _reduce_by_sends(sends, n, nbytes)


def test_bytes_per_link_is_two_n_minus_one_over_n_of_the_buffer():
    rng = random.Random(0)
    for _ in range(20):
        n, channels, chunk, slices = rng.randint(2, 7), rng.randint(1, 4), rng.randint(1, 50), rng.randint(1, 3)
        nbytes = rng.randint(n * channels * chunk, 4 * n * channels * chunk) + rng.randint(0, n - 1)
        sends = ring.pipelined_ring_sends(n, nbytes, channels, chunk, slices)
        per_link = ring.bytes_per_link(sends, n)
        assert sum(per_link) == 2 * (n - 1) * nbytes  # each byte crosses 2(n-1) links in all
        rounds = {(s.channel, s.round) for s in sends}
        assert len(sends) == len(rounds) * n * 2 * (n - 1) * slices
        assert max(per_link) - min(per_link) <= 2 * (n - 1) * len(rounds)  # uneven splits differ by a byte


def test_pipelining_beats_the_naive_ring_and_keeps_the_link_busier():
    link = ring.LinkModel(bandwidth_gbps=450.0, hop_latency_us=3.4)
    for n in (2, 4, 8):
        naive = ring.naive_ring(n, 1 << 26, link, step_overhead_us=20.0, reduce_gbps=1400.0)
        piped = ring.pipelined_ring(n, 1 << 26, link, channels=8, chunk_bytes=1 << 20)
        wire_us = 2 * (n - 1) / n * (1 << 26) / 450e3
        assert wire_us <= piped.finish_us < naive.finish_us
        assert piped.busy_fraction(n) > naive.busy_fraction(n)
        assert 1 <= piped.max_in_flight <= ring.FIFO_SLICES


def test_naive_ring_time_is_its_closed_form():
    """One round of whole chunks: every step pays overhead, transfer, hop, and (reduce-scatter) a reduction."""
    n, nbytes, alpha, hop, bw, red = 4, 4000, 5.0, 2.0, 100.0, 50.0
    chunk = nbytes / n
    want = 2 * (n - 1) * (alpha + chunk / (bw * 1e3) + hop) + (n - 1) * chunk / (red * 1e3) - hop + hop
    got = ring.naive_ring(n, nbytes, ring.LinkModel(bw, hop), step_overhead_us=alpha, reduce_gbps=red).finish_us
    assert got == pytest.approx(want)


def test_slices_hide_the_hop_and_the_fifo_bounds_what_is_in_flight():
    """A 1 MB chunk takes 10.5 us at 100 GB/s; cut in four, the 5 us hop hides behind the other slices."""
    link = ring.LinkModel(bandwidth_gbps=100.0, hop_latency_us=5.0)
    whole = ring.simulate(ring.pipelined_ring_sends(3, 3 << 22, 1, 1 << 20, 1), 3, link, fifo_depth=2)
    sliced = ring.simulate(ring.pipelined_ring_sends(3, 3 << 22, 1, 1 << 20, 4), 3, link, fifo_depth=5)
    assert sliced.finish_us < 0.8 * whole.finish_us
    assert sliced.busy_fraction(3) > 0.95 > whole.busy_fraction(3)
    assert whole.max_in_flight == 1 and 2 < sliced.max_in_flight <= 5


def test_channel_cap_limits_one_channel():
    capped = ring.LinkModel(bandwidth_gbps=400.0, hop_latency_us=1.0, channel_gbps=20.0)
    assert capped.per_channel_gbps(4) == 20.0 and capped.per_channel_gbps(40) == 10.0
    one = ring.pipelined_ring(4, 1 << 24, capped, channels=1, chunk_bytes=1 << 18).finish_us
    many = ring.pipelined_ring(4, 1 << 24, capped, channels=16, chunk_bytes=1 << 16).finish_us
    assert many < one / 8


def test_ring_errors():
    with pytest.raises(ValueError, match="chunk_bytes"):
        ring.pipelined_ring_sends(2, 10, 1, 0)
    with pytest.raises(ValueError, match="slices_per_chunk"):
        ring.pipelined_ring_sends(2, 10, 1, 4, 0)
    with pytest.raises(ValueError, match="fifo_depth"):
        ring.simulate(ring.pipelined_ring_sends(2, 10, 1, 4, 2), 2, ring.LinkModel(1.0, 0.0), fifo_depth=2)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        ring.LinkModel(0.0, 1.0)
    with pytest.raises(ValueError, match="ring successor"):
        bad = ring.Send(0, 0, 0, 0, 0, 0, 0, 0, 1)
        ring.simulate([bad], 2, ring.LinkModel(1.0, 0.0))


# --- bootstrap ------------------------------------------------------------------------

def test_hand_built_communicator_agrees_on_id_peers_and_sum():
    n = 3
    out = launch.run(bootstrap.build_by_hand, n, args=(launch.free_port(),), backend_name="gloo",
                     join_group=False, timeout_s=90)
    assert [o["rank"] for o in out] == list(range(n))
    assert len({o["unique_id_head"] for o in out}) == 1 and out[0]["unique_id_bytes"] == bootstrap.UNIQUE_ID_BYTES
    assert all(o["peers"] == out[0]["peers"] for o in out)
    assert [p["rank"] for p in out[0]["peers"]] == list(range(n))
    assert len({p["pid"] for p in out[0]["peers"]}) == n
    want = sum(check.randn(bootstrap.SUM_CHECK_NUMEL, seed=r, dtype=torch.float64) for r in range(n))
    for o in out:
        check.assert_close(o["all_reduce"], want, dtype=torch.float32, name=f"rank {o['rank']}'s all-reduce")


def test_bootstrap_errors():
    with pytest.raises(ValueError, match="rank"):
        bootstrap.connect(3, 2, 1234)
    with pytest.raises(ValueError, match="port"):
        bootstrap.connect(0, 1, 70000)


# --- the record's plumbing (NCCL itself needs a GPU) ------------------------------------

def test_capture_keeps_nccl_lines_and_the_result(monkeypatch):
    import subprocess

    from labkit.nccl import bench as nccl_bench

    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"], seen["env"] = cmd, kwargs["env"]
        out = ("h:1:1 [0] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0.\nnoise\n"
               'LABKIT_RESULT {"init": "lazy", "first_all_reduce_ms": 1.5}\n')
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(nccl_bench.subprocess, "run", fake_run)
    row, lines = nccl_bench.capture("lazy")
    assert row == {"init": "lazy", "first_all_reduce_ms": 1.5}
    assert lines == ["h:1:1 [0] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0."]
    assert seen["cmd"][-3:] == ["-m", "labkit.nccl.capture", "lazy"]
    assert seen["env"]["NCCL_DEBUG"] == "INFO" and seen["env"]["NCCL_NVLS_ENABLE"] == "0"


def test_capture_fails_loudly_without_a_result(monkeypatch):
    import subprocess

    from labkit.nccl import bench as nccl_bench

    monkeypatch.setattr(nccl_bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="NCCL WARN no GPU\n", stderr="Traceback ..."))
    with pytest.raises(RuntimeError, match="(?s)failed .exit 1.*no GPU"):
        nccl_bench.capture("eager")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs for real")
def test_init_log_needs_a_gpu():
    from labkit.nccl import bench as nccl_bench

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        nccl_bench.init_log()
