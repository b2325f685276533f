"""labkit.streams: the weight-streaming pipeline against a float64 chain, the time model,
the trace-to-spans converter on hand-made traces, the Gantt traces, every input check, and
the benchmarks at CPU sizes. The GPU-only facts (overlap, the allocator race) are marked."""

import labkit  # noqa: F401  (before triton)
import pytest
import torch
from labkit import backend, benchmarks, check, plots, streams
from labkit.streams import pipeline

DEV = backend.device()


def _weights(d, n, dtype, seed=0):
    return [check.randn(d, d, seed=seed + i).div_(d ** 0.5).to(dtype) for i in range(n)]


def _chain64(x, weights):
    out = x.double()
    for w in weights:
        out = out @ w.double().to(x.device)
    return out


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("n_buffers", [1, 2, 3])
@pytest.mark.parametrize("tokens,d,n_layers", [(1, 8, 1), (37, 24, 5), (130, 40, 7)])
def test_stream_layers_matches_the_chain(overlap, n_buffers, tokens, d, n_layers):
    weights = _weights(d, n_layers, torch.float32, seed=tokens)
    x = check.randn(tokens, d, device=DEV, seed=3 * d)
    out = streams.stream_layers(x, weights, overlap=overlap, n_buffers=n_buffers)
    streams.runtime.synchronize()
    check.assert_close(out, _chain64(x, weights), dtype=torch.float32, name="stream_layers")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stream_layers_low_precision(dtype):
    weights = _weights(32, 3, dtype, seed=5)
    x = check.randn(19, 32, dtype=dtype, device=DEV, seed=6)
    out = streams.stream_layers(x, weights)
    assert out.dtype == dtype
    check.assert_close(out, pipeline.compute_layers(x, [w.to(DEV) for w in weights]), dtype=dtype, name="low precision")


def test_stream_layers_rejects_bad_input():
    x = check.randn(4, 8, device=DEV)
    w = _weights(8, 2, torch.float32)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        streams.stream_layers([[1.0]], w)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        streams.stream_layers(x[0], w)
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        streams.stream_layers(x, [])
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        streams.stream_layers(x, w[0])
    with pytest.raises(ValueError, match=r"host_weights\[1\] must have shape \(8, 8\)"):
        streams.stream_layers(x, [w[0], w[1][:, :4]])
    with pytest.raises(TypeError, match=r"host_weights\[0\] must have dtype in \(float32\), got bfloat16"):
        streams.stream_layers(x, [w[0].bfloat16()])
    with pytest.raises(TypeError, match="overlap must be a bool"):
        streams.stream_layers(x, w, overlap="yes")
    with pytest.raises(ValueError, match="n_buffers must be positive"):
        streams.stream_layers(x, w, n_buffers=0)


def test_time_model():
    assert streams.pipelined_time_model(2.0, 3.0, 4, overlap=False) == pytest.approx(20.0)
    # the first copy and the last matmul stand alone; in between the longer of the two
    assert streams.pipelined_time_model(2.0, 3.0, 4, overlap=True) == pytest.approx(2 + 3 * 3 + 3)
    assert streams.pipelined_time_model(3.0, 2.0, 4, overlap=True) == pytest.approx(3 + 3 * 3 + 2)
    balanced = streams.pipelined_time_model(1.0, 1.0, 16, overlap=True)
    assert balanced == pytest.approx(16 * (1 + 1 / 16))
    assert streams.pipelined_time_model(5.0, 0.0, 3, overlap=True) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="copy_ms must be a non-negative number"):
        streams.pipelined_time_model(-1.0, 1.0, 2, overlap=True)
    with pytest.raises(ValueError, match="compute_ms must be a non-negative number"):
        streams.pipelined_time_model(1.0, float("nan"), 2, overlap=True)
    with pytest.raises(TypeError, match="n_layers must be an int"):
        streams.pipelined_time_model(1.0, 1.0, 2.5, overlap=True)


def _event(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": args.pop("tid", 1),
            "args": args}


def test_spans_from_a_device_trace():
    trace = {"traceEvents": [
        _event("cuda_runtime", "cudaMemcpyAsync", 100.0, 5.0),
        _event("cuda_runtime", "cudaLaunchKernel", 106.0, 4.0),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 110.0, 600.0, stream=13),
        _event("kernel", "sm90_gemm", 711.0, 500.0, stream=7),
        _event("cpu_op", "aten::mm", 105.0, 10.0),  # host ops are not drawn when device work exists
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 106.0, "id": 3},  # flow arrows are not spans
        {"ph": "M", "name": "process_name", "args": {"name": "python"}},
    ]}
    rows = streams.spans_from_chrome_trace(trace)
    assert [(r["track"], r["kind"], r["start_us"], r["dur_us"]) for r in rows] == [
        ("host", "host call", 0.0, 5.0), ("host", "host call", 6.0, 4.0),
        ("stream 13", "copy", 10.0, 600.0), ("stream 7", "kernel", 611.0, 500.0)]
    assert streams.busy_us([r for r in rows if r["track"] != "host"]) == pytest.approx(1100.0)


def test_spans_from_a_host_trace_keep_top_level_ops():
    trace = {"traceEvents": [
        _event("cpu_op", "aten::matmul", 50.0, 30.0),
        _event("cpu_op", "aten::mm", 55.0, 20.0),  # nested in matmul: dropped
        _event("cpu_op", "aten::copy_", 90.0, 5.0),
        _event("cpu_op", "aten::add", 60.0, 5.0, tid=2),  # another thread: its own top level
        _event("python_function", "foo", 0.0, 200.0),
    ]}
    rows = streams.spans_from_chrome_trace(trace)
    assert [(r["name"], r["start_us"]) for r in rows] == [("aten::matmul", 0.0), ("aten::add", 10.0),
                                                          ("aten::copy_", 40.0)]
    assert streams.spans_from_chrome_trace({"traceEvents": []}) == []
    with pytest.raises(ValueError, match="Chrome trace"):
        streams.spans_from_chrome_trace({"events": []})


def test_busy_is_the_union():
    spans = [{"start_us": 0.0, "dur_us": 10.0}, {"start_us": 5.0, "dur_us": 10.0}, {"start_us": 30.0, "dur_us": 1.0},
             {"start_us": 6.0, "dur_us": 2.0}]
    assert streams.busy_us(spans) == pytest.approx(16.0)
    assert streams.busy_us([]) == 0.0


def test_profile_spans_sees_the_work():
    a = check.randn(64, 64, device=DEV)
    spans = streams.profile_spans(lambda: a @ a)
    assert spans and all(s["dur_us"] >= 0 for s in spans)
    assert min(s["start_us"] for s in spans) == 0.0
    if not backend.on_gpu():
        assert any(s["name"] in ("aten::matmul", "aten::mm") for s in spans)
    else:
        assert any(s["kind"] == "kernel" for s in spans)


def test_gantt_traces():
    spans = [{"track": "stream 7", "kind": "kernel", "name": "gemm", "start_us": 10.0, "dur_us": 500.0},
             {"track": "stream 13", "kind": "copy", "name": "HtoD", "start_us": 0.0, "dur_us": 600.0}]
    traces = plots.gantt_traces(spans, kinds=["copy", "kernel", "host call"])
    assert [t.name for t in traces] == ["copy", "kernel", "host call"]
    assert list(traces[1].base) == [pytest.approx(0.01)] and list(traces[1].x) == [pytest.approx(0.5)]
    assert len(traces[2].x) == 0
    fig = plots.gantt(spans, title="t")
    assert len(fig.data) == 2
    with pytest.raises(ValueError, match=r"kinds \['kernel'\] that are not in kinds"):
        plots.gantt_traces(spans, kinds=["copy"])


@pytest.mark.parametrize("direction", streams.DIRECTIONS)
def test_transfer_timing_counts_bytes(direction):
    t, moved = streams.transfer_timing(4099, direction, pinned=True)
    assert moved == 4099 * (2 if direction == "both" else 1)
    assert t.median_ms > 0


def test_transfer_timing_rejects_bad_input():
    with pytest.raises(ValueError, match="direction must be one of"):
        streams.transfer_timing(16, "up", pinned=True)
    with pytest.raises(ValueError, match="n_bytes must be positive"):
        streams.transfer_timing(0, "h2d", pinned=True)
    with pytest.raises(TypeError, match="pinned must be a bool"):
        streams.transfer_timing(16, "h2d", pinned=1)


def test_host_buffer_is_written():
    buf = streams.host_buffer(1001, pinned=False)
    assert buf.dtype == torch.uint8 and buf.numel() == 1001
    assert bool((buf == streams.bandwidth.FILL_BYTE).all())


def test_reuse_race_rejects_bad_input():
    with pytest.raises(ValueError, match="protection must be one of"):
        streams.reuse_race("hope", 10)
    with pytest.raises(ValueError, match="n must be positive"):
        streams.reuse_race("nothing", 0)


@pytest.mark.skipif(backend.on_gpu(), reason="on a GPU the unprotected free races (test_reuse_race_on_gpu)")
def test_reuse_race_on_the_cpu_cannot_race():
    # Nothing queues on the CPU: the reader ran before the free, whatever the protection.
    for protection in streams.PROTECTIONS:
        assert streams.reuse_race(protection, 333)["wrong_elements"] == 0


@pytest.mark.gpu
def test_reuse_race_on_gpu():
    rows = {p: streams.reuse_race(p, 2**22) for p in streams.PROTECTIONS}
    assert rows["nothing"]["block_reused"] and rows["nothing"]["wrong_elements"] > 0
    assert not rows["record_stream"]["block_reused"] and rows["record_stream"]["wrong_elements"] == 0
    assert rows["wait_stream"]["wrong_elements"] == 0


@pytest.mark.skipif(backend.on_gpu(), reason="GPU sizes: run python -m labkit.bench cuda-streams")
@pytest.mark.parametrize("name", ["streams.copy_bandwidth", "streams.overlap", "streams.timeline", "streams.record_stream"])
def test_benchmarks_run_at_cpu_sizes(name):
    rec = benchmarks.run(name, record=False)
    assert rec.rows and rec.chapter == "cuda-streams"
    if name == "streams.timeline":
        assert {r["run"] for r in rec.rows} == {"serial", "overlapped"}
        assert set(rec.config["summary"]) == {"serial", "overlapped"}
    if name == "streams.overlap":
        assert all(r["overlapped_ms"] > 0 and r["copy_ms"] > 0 for r in rec.rows)


@pytest.mark.parametrize("copy_ms,compute_ms", [(1.0, 1.0), (1.0, 2.5), (3.0, 0.5), (0.0, 1.0)])
@pytest.mark.parametrize("overlap", [True, False])
def test_schedule_spans_agree_with_the_closed_form(copy_ms, compute_ms, overlap):
    n = 7
    spans = pipeline.schedule_spans(copy_ms, compute_ms, n, overlap=overlap)
    end_ms = max(s["start_us"] + s["dur_us"] for s in spans) / 1e3
    assert end_ms == pytest.approx(streams.pipelined_time_model(copy_ms, compute_ms, n, overlap=overlap))
    by_name = {s["name"]: s for s in spans}
    for i in range(n):  # every matmul after its own copy; no two spans of one engine overlap
        assert by_name[f"x @ W{i}"]["start_us"] >= by_name[f"copy W{i}"]["start_us"] + by_name[f"copy W{i}"]["dur_us"] - 1e-9
    for kind in ("copy", "kernel"):
        mine = sorted((s for s in spans if s["kind"] == kind), key=lambda s: s["start_us"])
        assert all(a["start_us"] + a["dur_us"] <= b["start_us"] + 1e-9 for a, b in zip(mine, mine[1:]))


def test_one_buffer_cannot_overlap():
    # With one buffer the next copy must wait for the matmul reading it: serial again.
    spans = pipeline.schedule_spans(1.0, 1.0, 5, overlap=True, n_buffers=1)
    assert max(s["start_us"] + s["dur_us"] for s in spans) == pytest.approx(10e3)


def test_issue_end_leaves_out_the_final_synchronization():
    spans = [{"track": "host", "name": "cudaLaunchKernel", "start_us": 0.0, "dur_us": 5.0},
             {"track": "host", "name": "cudaMemcpyAsync", "start_us": 10.0, "dur_us": 2.0},
             {"track": "host", "name": "cudaDeviceSynchronize", "start_us": 13.0, "dur_us": 900.0},
             {"track": "stream 7", "name": "gemm", "start_us": 6.0, "dur_us": 905.0}]
    assert streams.issue_end_us(spans) == pytest.approx(12.0)
    assert streams.issue_end_us([]) == 0.0


class _LoggedStream:
    """A stream that logs the waits issued to it, in one shared log, to check orderings."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, other.name))


def test_both_directions_are_not_serialized(monkeypatch):
    """Both side streams must wait for the timed stream before it joins either: a side
    stream that waited after the join would wait for the other side's copy too."""
    log = []
    main = _LoggedStream("main", log)
    sides = iter([_LoggedStream("up", log), _LoggedStream("down", log)])
    monkeypatch.setattr(streams.runtime, "current_stream", lambda: main)
    monkeypatch.setattr(streams.runtime, "new_stream", lambda: next(sides))
    host = streams.host_buffer(64, pinned=False)
    device_buf = torch.empty(64, dtype=torch.uint8, device=DEV)
    streams.bandwidth._copy_fn("both", host, device_buf, False)()
    first_join = next(i for i, (waiter, _) in enumerate(log) if waiter == "main")
    assert sorted(log[:first_join]) == [("down", "main"), ("up", "main")], log
    assert sorted(log[first_join:]) == [("main", "down"), ("main", "up")], log
    assert torch.equal(device_buf, host.to(DEV))
