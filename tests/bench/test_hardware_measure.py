"""Hardware description, the cached bandwidth probe, and the measuring primitives on a tiny random model."""

from __future__ import annotations

import json

import pytest

from mlxinfer.bench import hardware, measure


@pytest.mark.parametrize("label,cores,expected", [
    ("Apple M1", 8, 68.25), ("Apple M2 Pro", 12, 200), ("Apple M3 Max", 14, 300), ("Apple M3 Max", 16, 400),
    ("Apple M4 Max", 14, 410), ("Apple M4 Max", 16, 546), ("Apple M4 Pro", 14, 273), ("Apple M2 Ultra", 24, 800),
])
def test_apple_bandwidth_table(label, cores, expected):
    gbps, source = hardware.apple_bandwidth(label, cores)
    assert gbps == expected and "Apple specification" in source


def test_non_apple_chips_are_not_in_the_table():
    assert hardware.apple_bandwidth("Intel(R) Xeon(R) Processor", 2) is None
    assert hardware.apple_chip_name("AMD EPYC 9M14") is None


def test_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setitem(hardware._PROBES, "cpu", (lambda: calls.append(1) or 12.5, "fake"))
    monkeypatch.setitem(hardware._PROBES, "gpu", (lambda: calls.append(2) or 900.0, "fake gpu"))
    first = hardware.measured_bandwidth("cpu X", 4, 8 << 30)
    second = hardware.measured_bandwidth("cpu X", 4, 8 << 30)
    assert first[0] == second[0] == 12.5 and len(calls) == 1
    assert "cached" in second[1] and "cached" not in first[1]
    saved = json.loads((tmp_path / "bench" / "bandwidth.json").read_text())
    assert list(saved.values())[0]["gbps"] == 12.5
    hardware.measured_bandwidth("cpu Y", 4, 8 << 30)  # another machine: probed again
    assert len(calls) == 2
    assert hardware.measured_bandwidth("cpu X", 4, 8 << 30, device="gpu")[0] == 900.0  # the GPU: its own entry
    assert calls == [1, 1, 2]


def test_real_probes_and_machine_info():
    assert hardware.probe_copy_bandwidth(size_mb=8, repeats=1) > 0
    assert hardware.probe_device_bandwidth(size_mb=8, repeats=1) > 0  # MLX's default device (the CPU here)
    info = hardware.hardware_info(bandwidth_gbps=100.0)
    assert info["bandwidth_gbps"] == 100.0 and info["bandwidth_source"] == "given with --bandwidth"
    assert info["cpu_cores"] >= 1 and info["memory_bytes"] > 0 and info["chip"]


def _tiny(tied: bool):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=tied)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _nbytes(module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def test_weights_read_per_token_counts_one_embedding_row_unless_tied():
    untied = _tiny(tied=False)
    table = _nbytes(untied.model.embed_tokens)
    assert measure.weights_read_per_token(untied, {}) == _nbytes(untied) - table + table // 256
    tied = _tiny(tied=True)  # the table is the output projection too: read in full every step
    assert measure.weights_read_per_token(tied, {}) == _nbytes(tied)


def test_kv_layout_measures_bytes_per_token():
    model = _tiny(tied=True)
    cache = measure.new_cache(model, list(range(10)))
    per_token, capacity = measure.kv_layout(cache)
    # 2 layers × (K + V) × 2 kv heads × head_dim 16 × float32
    assert per_token == 2 * 2 * 2 * 16 * 4 and capacity is None
    assert cache[0].offset == 10
    assert measure.kv_bytes(per_token, None, 100, 2) == per_token * 100


def test_batch_sweep_reports_aggregate_tokens_per_second():
    model = _tiny(tied=True)
    for b in (1, 2, 4):
        prompts = [[1 + i, 2, 3, 4] for i in range(b)]
        s = measure.run_batch(model, prompts, 3)
        assert len(s.token_times) == 3 and s.tokens_per_step == b
        assert s.prompt_tokens == 4 * b and s.kv_per_token > 0
        assert s.decode_tps > 0 and s.decode_tps == pytest.approx(2 * b / (s.e2e - s.ttft))
        assert all(x >= 0 for x in s.latencies)
    with_context = measure.run_batch(model, [[1, 2], [3, 4]], 2, contexts=[[5, 6, 7], [8, 9, 10]])
    assert len(with_context.token_times) == 2
