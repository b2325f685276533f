"""serve.decode_matmuls: the layers' weights it reads, its bare reads and graphs, and the benchmark's record."""

import pytest
import torch
import torch.nn.functional as F

from labkit import backend, benchmarks, check, results
from labkit.serve import bench_decode_matmuls as bench
from labkit.serve.bench_engine import engine_model


def fused_model():
    model = engine_model()
    model.fuse_projections()
    return model


def test_layer_weights_are_each_layers_four_matmuls_in_step_order():
    model = fused_model()
    cfg = model.config
    weights = bench.layer_weights(model)
    assert len(weights) == cfg.num_layers
    q, kv, hidden, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    for block, layer in zip(model.blocks, weights):
        assert tuple(layer) == bench.MATMULS
        assert [tuple(w.shape) for w in layer.values()] == [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden),
                                                           (hidden, inter)]
        # the model's own storage: the stacked matrices the engine's forward multiplies by
        assert layer["qkv"].data_ptr() == block.attn.wq.weight.data_ptr()
        assert layer["gate_up"].data_ptr() == block.mlp.gate.weight.data_ptr()
        assert layer["o"] is block.attn.wo.weight and layer["down"] is block.mlp.down.weight
    linear_bytes = sum(m.weight.nbytes for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
    assert sum(w.nbytes for layer in weights for w in layer.values()) == linear_bytes


def test_layer_weights_asks_for_the_stacked_projections():
    with pytest.raises(ValueError, match="fuse_projections"):
        bench.layer_weights(engine_model())


def test_bare_read_reads_every_byte_of_its_tensor():
    t = check.randn(3, 517, dtype=torch.float32, device=backend.device(), seed=1)
    read = bench.bare_read(t)
    assert read().double().sum().item() == pytest.approx(t.double().sum().item(), rel=1e-5, abs=1e-3)
    t.add_(1.0)  # the call reads the tensor as it is now, into the same partial sums
    assert read().double().sum().item() == pytest.approx(t.double().sum().item(), rel=1e-5, abs=1e-3)


@pytest.mark.skipif(backend.on_gpu(), reason="on a GPU graphed() captures a CUDA graph")
def test_graphed_runs_the_calls_in_order_once_then_at_every_replay():
    seen = []
    replay = bench.graphed([lambda: seen.append("a"), lambda: seen.append("b")])
    assert seen == ["a", "b"]
    replay()
    assert seen == ["a", "b", "a", "b"]


@pytest.mark.skipif(backend.on_gpu(), reason="on a GPU it runs at full size: python -m labkit.bench "
                                              "serve.decode_matmuls")
def test_decode_matmuls_benchmark_records_every_rung_at_each_batch():
    rec = benchmarks.run("serve.decode_matmuls", record=False)
    assert results.validate(rec.to_dict()) == []
    read_tbps = rec.limits["read_tbps"]
    for batch in bench.BATCHES:
        rows = {r["matmul"]: r for r in rec.rows if r["batch"] == batch}
        assert set(rows) == {"layer (all four)", *bench.MATMULS}
        layer = rows["layer (all four)"]
        assert layer["bytes"] == sum(rows[n]["bytes"] for n in bench.MATMULS)
        assert layer["launches"] == len(bench.MATMULS)
        for r in rows.values():
            assert r["floor_us"] == pytest.approx(r["bytes"] / (read_tbps * 1e6))
            assert r["torch/read"] == pytest.approx(r["torch_us"] / r["read_us"])
            assert all(r[k] > 0 for k in ("torch_us", "split_k_us", "read_us"))
        assert layer["read_per_layer_us"] > 0 and layer["read_once_us"] > 0


@pytest.mark.skipif(backend.on_gpu(), reason="the interpreter's tiny model keeps this quick")
def test_decode_matmuls_benchmark_checks_the_products_before_timing(monkeypatch):
    monkeypatch.setattr(bench, "inference_linear", lambda x, w, way: F.linear(x, w) * 1.01)
    with pytest.raises(check.CheckFailed, match="torch qkv at batch 1"):
        benchmarks.run("serve.decode_matmuls", record=False)
