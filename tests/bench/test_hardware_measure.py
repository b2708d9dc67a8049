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
    first = hardware.measured_bandwidth("cpu X", 4, 8 << 30, load=0.1)
    second = hardware.measured_bandwidth("cpu X", 4, 8 << 30, load=0.1)
    assert first[0] == second[0] == 12.5 and len(calls) == 1 and first[2] and second[2]
    assert "cached" in second[1] and "cached" not in first[1]
    saved = json.loads((tmp_path / "bench" / "bandwidth.json").read_text())
    assert list(saved.values())[0]["gbps"] == 12.5 and list(saved.values())[0]["load_avg_1m"] == 0.1
    hardware.measured_bandwidth("cpu Y", 4, 8 << 30, load=0.1)  # another machine: probed again
    assert len(calls) == 2
    assert hardware.measured_bandwidth("cpu X", 4, 8 << 30, device="gpu", load=0.1)[0] == 900.0  # its own entry
    assert calls == [1, 1, 2]


def _fake_probe(monkeypatch, tmp_path, values: list[float]):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    calls = []

    def probe():
        calls.append(1)
        return values[len(calls) - 1]

    monkeypatch.setitem(hardware._PROBES, "cpu", (probe, "fake read on {cores} threads"))
    return calls


def test_a_probe_on_a_loaded_machine_is_used_once_and_never_cached(tmp_path, monkeypatch):
    calls = _fake_probe(monkeypatch, tmp_path, [5.2, 6.0, 30.0])
    gbps, source, cached = hardware.measured_bandwidth("cpu X", 2, 8 << 30, load=4.0)  # 2 cores, load 4: busy
    assert (gbps, cached) == (5.2, False) and "not cached: the machine was loaded (load average 4.0" in source
    assert not (tmp_path / "bench" / "bandwidth.json").exists()
    assert hardware.measured_bandwidth("cpu X", 2, 8 << 30, load=4.0)[0] == 6.0  # probed again, still not kept
    assert hardware.measured_bandwidth("cpu X", 2, 8 << 30, load=0.3)[0] == 30.0  # quiet: measured and cached
    assert hardware.measured_bandwidth("cpu X", 2, 8 << 30, load=4.0)[:2] == (
        30.0, "measured probe, cached " + json.loads((tmp_path / "bench" / "bandwidth.json").read_text())
        [hardware.machine_key("cpu X", 2, 8 << 30)]["when"] + " (fake read on 2 threads)")
    assert len(calls) == 3
    assert hardware.machine_loaded(1.4, 2) is False and hardware.machine_loaded(1.6, 2) is True
    assert hardware.machine_loaded(None, 2) is False


def test_an_old_copy_probe_cache_is_ignored(tmp_path, monkeypatch):
    """Version 2 entries came from a single copy probe, cached even under load (5.2 GB/s on a 30 GB/s machine)."""
    calls = _fake_probe(monkeypatch, tmp_path, [30.0])
    (tmp_path / "bench").mkdir()
    old_key = hardware.machine_key("cpu X", 2, 8 << 30).replace(f"v{hardware.PROBE_VERSION}", "v2")
    (tmp_path / "bench" / "bandwidth.json").write_text(json.dumps({old_key: {"gbps": 5.2, "when": "x", "method": "c"}}))
    assert hardware.measured_bandwidth("cpu X", 2, 8 << 30, load=0.0)[0] == 30.0 and calls == [1]


def test_a_cached_peak_below_what_a_run_read_is_measured_again(tmp_path, monkeypatch):
    calls = _fake_probe(monkeypatch, tmp_path, [5.2, 31.0, 99.0])
    monkeypatch.setattr(hardware, "load_average", lambda: 0.2)
    monkeypatch.setattr(hardware, "cpu_label", lambda: "cpu X")
    monkeypatch.setattr(hardware, "cpu_cores", lambda: 2)
    monkeypatch.setattr(hardware, "memory_bytes", lambda: 8 << 30)
    hw = hardware.hardware_info()
    assert hw["bandwidth_gbps"] == 5.2 and hw["bandwidth_method"] == "probe"
    assert not hardware.remeasure_if_exceeded(hw, 4.0)  # below the peak: plausible, nothing probed
    assert hardware.remeasure_if_exceeded(hw, 16.0)      # a run read 16 GB/s > 5.2: implausible peak
    assert hw["bandwidth_gbps"] == 31.0 and "re-measured because a run read 16.0 GB/s, above the earlier 5.2" \
        in hw["bandwidth_source"]
    assert not hardware.remeasure_if_exceeded(hw, 40.0)  # once per run; the report flags what is still above
    assert len(calls) == 2
    again = hardware.hardware_info()  # the quiet re-measurement replaced the cached value
    assert again["bandwidth_gbps"] == 31.0 and len(calls) == 2
    given = hardware.hardware_info(bandwidth_gbps=10.0)  # a peak the user gave is never second-guessed
    assert not hardware.remeasure_if_exceeded(given, 40.0) and given["bandwidth_gbps"] == 10.0


def test_run_records_are_rescored_after_a_re_measurement(monkeypatch):
    """The runner re-measures once a record exceeds a probed peak and computes its share against the new one."""
    from bench_fakes import HARDWARE, stream_sample

    from mlxinfer.bench import runner
    from mlxinfer.bench.workload import Case

    hw = {**HARDWARE, "bandwidth_gbps": 1e-6, "bandwidth_method": "probe"}

    def fake_remeasure(h, achieved):
        h.update(bandwidth_gbps=achieved * 2, bandwidth_method="probe (re-measured)")
        return True

    monkeypatch.setattr(runner, "remeasure_if_exceeded", fake_remeasure)
    emitted = []
    case = Case("generate", 4, 5)
    monkeypatch.setattr(runner, "_measure", lambda *a, **k: stream_sample(0.5, [0.1] * 4, 4))
    monkeypatch.setattr(runner.measure, "weights_read_per_token", lambda model, config: 1 << 20)
    opts = runner.BenchOptions(repetitions=1, warmup=0)
    from mlxinfer.bench.workload import PromptSource

    runner._run_engine([case], model=None, config={}, timed=None, batch=None, engine={"name": "mlxinfer"},
                       model_info={"name": "tiny"}, hardware=hw, system={}, source=PromptSource(10), opts=opts,
                       ticker=lambda *a: None, emit=emitted.append)
    res = emitted[0]["results"]
    assert res["bandwidth_share"] == pytest.approx(0.5) and res["bandwidth_note"] is None
    assert emitted[0]["hardware"]["bandwidth_method"] == "probe (re-measured)"


def test_real_probes_and_machine_info():
    assert hardware.probe_read_bandwidth(size_mb=8, repeats=1, threads=2) > 0
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
