"""Threads in bench records (a -t sweep, MLXINFER_THREADS), llama-bench rows, and each engine with its own kernels,
on the bundled SmolLM2 model at tiny sizes. Speeds are never asserted."""

from __future__ import annotations

import csv
import io
import json
import re
import os
import subprocess
import sys

import pytest

from mlxinfer.cli.main import main


def _native_available() -> bool:
    from mlxinfer import native
    from mlxinfer.engine.backend import backend

    return backend() == "cpu" and native.extension() is not None


needs_native = pytest.mark.skipif(not _native_available(), reason="the native CPU kernels are not built here")


@pytest.mark.slow
@needs_native
def test_thread_sweep_gives_llama_bench_rows_per_thread_count(tmp_path, capsys, smollm2_dir):
    from mlxinfer import native

    before = native.extension().num_threads()
    out = tmp_path / "sweep.json"
    assert main(["bench", "smollm2", "-p", "8", "-n", "4", "-r", "1", "--warmup", "0", "-t", "1,2",
                 "--llama-bench", "--bandwidth", "50", "-o", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["engine"]["threads"], r["test"], r["workload"]["kind"]) for r in records] == [
        (1, "pp8", "pp"), (1, "tg4", "tg"), (2, "pp8", "pp"), (2, "tg4", "tg")]
    for r in records:
        assert r["engine"]["kernels"] == "cpu-native"
        w, res = r["workload"], r["results"]
        if w["kind"] == "pp":
            assert (w["prompt_tokens"], w["gen_tokens"]) == (8, 1) and res["prefill_tps"]["mean"] > 0
        else:
            assert (w["prompt_tokens"], w["gen_tokens"]) == (1, 4) and res["decode_tps"]["mean"] > 0
    assert native.extension().num_threads() == before  # the sweep leaves the pool as it found it
    # llama-bench's Markdown table comes to stdout with the saved file (as llama-bench prints on a terminal).
    md = capsys.readouterr().out
    assert "| model | size | params | backend | threads | test | t/s |" in md
    # The size is the weights as loaded (float16 scales where the native kernels run them), not a file size.
    assert re.search(r"\| smollm2 \| \d+\.\d\d MiB \| 134\.52 M \| cpu \(cpu-native\) \| 2 \| tg4 \| [\d.]+ \|", md), md


@pytest.mark.slow
@needs_native
def test_mlxinfer_threads_leaves_a_trace_in_the_record(tmp_path, smollm2_dir):
    """MLXINFER_THREADS=1 changes decode speed: the record says which thread count ran."""
    env = {**os.environ, "MLXINFER_THREADS": "1", "MLXINFER_DEBUG": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlxinfer", "bench", "smollm2", "-p", "4", "-n", "2", "-r", "1",
                           "--warmup", "0", "--bandwidth", "50", "-o", "csv"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (row,) = csv.DictReader(io.StringIO(proc.stdout))
    assert row["engine.threads"] == "1" and row["engine.kernels"] == "cpu-native"


@pytest.mark.slow
def test_bench_with_the_peer_gives_each_engine_its_own_kernels(monkeypatch, smollm2_dir):
    """Kernel swaps are per model: the mlx-lm peer loaded after mlxinfer's model (kept alive here) runs MLX's own
    layers and mlx-lm's own attention, while mlxinfer's model keeps its kernels."""
    from mlx_lm.models import llama

    from mlxinfer.bench import runner
    from mlxinfer.kernels import layers
    from mlxinfer.registry import Registry

    attention_fn = llama.scaled_dot_product_attention
    seen: dict = {}

    def spy(cases, *, model, engine, **kwargs):
        kernel_modules = [m for _, m in model.named_modules() if layers.is_kernel_class(type(m))]
        seen[engine["name"]] = (model, len(kernel_modules), engine["kernels"])

    monkeypatch.setattr(runner, "_run_engine", spy)
    opts = runner.BenchOptions(prompts=[4], gens=[2], repetitions=1, warmup=0, peer="mlx-lm", bandwidth_gbps=50)
    runner.run_bench([Registry.load().resolve("smollm2")], opts)
    mine, peer = seen["mlxinfer"], seen["mlx-lm"]
    assert peer[1] == 0 and peer[2] == "builtin"
    assert llama.scaled_dot_product_attention is attention_fn  # nothing patched at module level
    if mine[2] != "builtin":  # with a kernel provider (native CPU, Metal, CUDA) mlxinfer's model keeps its layers
        assert mine[1] > 0
        assert len([m for _, m in mine[0].named_modules() if layers.is_kernel_class(type(m))]) == mine[1]


@needs_native
def test_microbench_thread_sweep(monkeypatch, capsys):
    import mlxinfer.kernels.microbench as mb

    monkeypatch.setattr(mb, "MODELS", {"tiny": (128, 256, 2, 1, 64)})
    assert main(["microbench", "tiny", "-m", "1", "-c", "32", "-r", "1", "-t", "1,2"]) == 0
    md = capsys.readouterr().out
    assert "native kernels on 1 threads" in md and "native kernels on 2 threads" in md
    assert md.count("| qmv |") == 8 and md.count("| sdpa |") == 2


@pytest.mark.slow
def test_kv_bits_run_both_engines_on_a_quantized_cache(tmp_path, smollm2_dir):
    out = tmp_path / "kv.json"
    assert main(["bench", "smollm2", "-p", "8", "-n", "3", "-r", "1", "--warmup", "0", "--kv-bits", "8",
                 "--bandwidth", "50", "-o", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["workload"]["kv_bits"] == 8 and r["workload"]["max_kv_size"] is None
    config = json.loads((smollm2_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    float_kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4 * (8 + 3)
    # 8-bit values plus a float32 scale and bias per group of 64: about 0.28 of the float32 cache
    assert 0.2 * float_kv < r["results"]["kv_cache_bytes"] < 0.35 * float_kv
    if r["engine"]["kernels"] != "builtin":
        assert "KV cache 8-bit (group 64)" in r["engine"]["kernels_detail"]


def test_more_threads_than_cores_are_run_with_a_warning(monkeypatch):
    """-t above the cores this process may use is allowed (llama-bench allows it) but said: those rows measure
    spinning workers taking turns on a core."""
    from mlxinfer.bench import hardware
    from mlxinfer.bench.runner import threads_warning

    monkeypatch.setattr(hardware, "cpu_cores", lambda: 2)
    assert threads_warning(None) is None and threads_warning([1, 2]) is None
    line = threads_warning([1, 2, 4])
    assert line.startswith("-t 4 is more than the 2 cores") and "that row measures" in line and "up to 2" in line
    assert "-t 3, 4 " in threads_warning([3, 4]) and "those rows" in threads_warning([3, 4])


@needs_native
def test_bench_cli_warns_before_an_oversubscribed_sweep(monkeypatch, capsys):
    """The warning reaches stderr before anything loads (here the run stops at an unknown model)."""
    from mlxinfer.bench import hardware

    monkeypatch.setattr(hardware, "cpu_cores", lambda: 1)
    assert main(["bench", "no-such-model-xyz", "-t", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("warning: -t 2 is more than the 1 core this process") and "no-such-model-xyz" in err
