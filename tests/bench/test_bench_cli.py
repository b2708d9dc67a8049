"""``mlxinfer bench`` through the CLI entry point: bad input is refused before anything runs, and short real runs
on the bundled SmolLM2 model produce complete, parseable records. Speeds are never asserted."""

from __future__ import annotations

import csv
import json

import pytest

from mlxinfer.bench.runner import PROVENANCE
from mlxinfer.cli.main import main


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything tries to load a model (bad input must be caught first)."""
    import mlxinfer.engine.loader as loader

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loader, "load", refuse)


@pytest.mark.parametrize("args,needle", [
    (["nosuchmodel"], "unknown model 'nosuchmodel'"),
    (["-p", "0"], "invalid prompt length 0"),
    (["-n", "-3"], "invalid generation length -3"),
    (["-p", "16,abc"], "cannot read prompt length value 'abc'"),
    (["-b", "0"], "invalid batch size 0"),
    (["-r", "0"], "invalid repetitions 0"),
    (["--peer", "llama.cpp"], "unknown peer 'llama.cpp'"),
    (["--bandwidth", "-1"], "invalid bandwidth"),
    (["--kernels", "fastest"], "unknown kernel mode"),
    (["-o", "/nonexistent-dir/out.json"], "folder /nonexistent-dir does not exist"),
    (["-o", "out.txt"], "unknown output 'out.txt'"),
    (["--compare", "/nonexistent-dir/base.json"], "cannot read baseline"),
    (["--prompt-file", "/nonexistent-dir/p.txt"], "prompt file /nonexistent-dir/p.txt does not exist"),
    (["-d", "9000", "-p", "16", "-n", "8"], "pp16+tg8 @ d9000 needs 9024 tokens of context but smollm2 holds 8192"),
    (["-t", "0"], "invalid thread count 0"),
    (["-t", "1,2", "--kernels", "builtin"], "-t sets the worker threads of the native CPU kernels, which do not run"),
    (["--llama-bench", "-b", "2"], "--llama-bench runs ppP and tgN tests only"),
    (["--llama-bench", "-p", "0", "-n", "0"], "nothing to run (give -p/-n lengths above 0)"),
    # the bench/serve audit: each list was capped, their product was not; a folder was "does not exist"; the
    # output was found unwritable only when the run ended (os.access passes for root in /sys, cannot see /proc)
    (["-p", "1-4000", "-n", "1-4000"], "the lists make 16,000,000 tests"),
    (["--prompt-file", "/"], "prompt file / is a folder"),
    (["-o", "/proc/out.json"], "cannot write /proc/out.json"),
    (["-o", "/dev/null/out.json"], "/dev/null is not a folder"),
    (["--kv-bits", "3"], "invalid --kv-bits 3: use 4 or 8"),
    (["--max-kv-size", "9000"], "invalid --max-kv-size 9000: must be between 32 and 8192"),
    (["--kv-bits", "8", "-b", "2"], "--kv-bits / --max-kv-size apply to single-stream tests"),
    (["--csv-all"], "--csv-all shapes CSV output: add -o csv"),  # was ignored: a Markdown table came out
    (["--csv-all", "-o", "json"], "--csv-all shapes CSV output"),
])
def test_bad_input_is_one_clear_error_before_any_run(args, needle, capsys, no_loading, smollm2_dir):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def _check_record(r: dict) -> None:
    for section, names in PROVENANCE.items():
        assert not [n for n in names if n not in r[section]], section
    m, e, h = r["model"], r["engine"], r["hardware"]
    assert m["name"] == "smollm2" and m["params"] > 100_000_000 and m["bits"] == 4 and m["group_size"] == 32
    assert m["revision"].startswith("sha256:") and m["weight_bytes"] > 0 and m["context_length"] == 8192
    assert e["mlx"] and e["mlx_lm"] and e["backend"] in ("cpu", "metal", "cuda") and e["kernels"]
    assert h["cpu_cores"] >= 1 and h["memory_bytes"] > 0 and h["bandwidth_gbps"] == 50.0


@pytest.mark.slow
def test_short_real_run_writes_json_then_compares(tmp_path, capsys, smollm2_dir):
    out = tmp_path / "run.json"
    assert main(["bench", "smollm2", "-p", "16", "-n", "8", "-r", "1", "--bandwidth", "50", "-o", str(out)]) == 0
    records = json.loads(out.read_text())
    assert len(records) == 1
    r = records[0]
    _check_record(r)
    assert r["engine"]["name"] == "mlxinfer" and r["test"] == "pp16+tg8"
    assert r["workload"] | {} == {**r["workload"], "prompt_tokens": 16, "gen_tokens": 8, "warmup": 1,
                                  "repetitions": 1, "ignore_eos": True}
    res = r["results"]
    assert res["itl_s"]["n"] == 7 and res["itl_s"]["p50"] <= res["itl_s"]["p95"] <= res["itl_s"]["p99"]
    assert res["decode_tps"]["mean"] > 0 and res["prefill_tps"]["mean"] > 0 and res["peak_memory_bytes"] > 0
    assert res["ttft_s"]["mean"] <= res["e2e_s"]["mean"]
    capsys.readouterr()

    # Same workload on real text, compared against the saved run; stdout is not a terminal: Markdown comes out.
    text = tmp_path / "prompt.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    assert main(["bench", "-p", "16", "-n", "8", "-r", "1", "--warmup", "0", "--bandwidth", "50",
                 "--prompt-file", str(text), "--compare", str(out)]) == 0
    md = capsys.readouterr().out
    assert "| smollm2 |" in md and "against the baseline" in md and "| smollm2 | pp16+tg8 | mlxinfer" in md
    assert "prompt file prompt.txt (" in md


@pytest.mark.slow
def test_sweep_with_batches_prefix_and_mlx_lm_peer(tmp_path, capsys, smollm2_dir):
    out = tmp_path / "sweep.csv"
    args = ["bench", "-p", "4", "-n", "3", "-b", "1,2", "--prefix-cache", "8", "--peer", "mlx-lm",
            "-r", "1", "--warmup", "0", "--bandwidth", "50", "-o", str(out)]
    assert main(args) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * (2 + 1)  # engines × (batch sizes + prefix)
    for engine in ("mlxinfer", "mlx-lm"):
        mine = [r for r in rows if r["engine.name"] == engine]
        batch = {(int(r["workload.depth"]), int(r["workload.batch"])): r for r in mine if r["workload.kind"] == "batch"}
        assert sorted(batch) == [(0, 1), (0, 2)]
        for r in batch.values():  # aggregate decode tok/s per batch size
            assert float(r["results.decode_tps.mean"]) > 0
            assert float(r["results.decode_tps_per_sequence.mean"]) == pytest.approx(
                float(r["results.decode_tps.mean"]) / int(r["workload.batch"]))
        prefix = [r for r in mine if r["workload.kind"] == "prefix"][0]
        assert prefix["test"] == "prefix8+pp4" and float(prefix["results.ttft_warm_s.mean"]) > 0
    # mlx-lm keeps the dtype the weights were saved in; both engines ran the same directory.
    assert all(r["model.path"] == str(smollm2_dir) for r in rows)
    import mlx.core as mx

    saved = [str(v.dtype) for f in smollm2_dir.glob("*.safetensors") for v in mx.load(str(f)).values()
             if mx.issubdtype(v.dtype, mx.floating)]
    majority = max(set(saved), key=saved.count).replace("mlx.core.", "")
    assert {r["model.dtype"] for r in rows if r["engine.name"] == "mlx-lm"} == {majority}


def test_microbench_subcommand_wraps_the_kernel_micro_benchmark(monkeypatch, capsys):
    import mlxinfer.kernels.microbench as mb

    monkeypatch.setattr(mb, "MODELS", {"tiny": (128, 256, 2, 1, 64)})  # small shapes: seconds, not minutes
    assert main(["microbench", "tiny", "--rows", "1,2", "--context", "32", "-r", "1", "-o", "json"]) == 0
    out = capsys.readouterr()
    records = json.loads(out.out)
    assert "deprecated" not in out.err
    kernels = [r["kernel"]["kernel"] for r in records]
    assert kernels == ["qmv"] * 4 + ["swiglu"] + ["qmv"] * 4 + ["swiglu", "sdpa", "sdpa-q8"]
    for r in records:
        assert r["engine"]["name"] == "mlxinfer" and r["engine"]["mlx"] and r["engine"]["kernels"]
        assert r["hardware"]["cpu_cores"] >= 1 and r["os"]["platform"] and r["kernel"]["builtin_us"] > 0
        assert r["kernel"]["shape"].startswith("tiny: ") and r["kernel"]["repeat"] == 1
    assert main(["microbench", "llama-9b"]) == 2
    assert "unknown micro-benchmark shape set 'llama-9b'" in capsys.readouterr().err
    assert main(["microbench", "--rows", "5000"]) == 2
    assert "invalid rows (--rows) 5000 for microbench: must be at most 4,096" in capsys.readouterr().err


def test_bench_microbench_is_a_deprecated_alias(monkeypatch, capsys):
    import mlxinfer.kernels.microbench as mb

    monkeypatch.setattr(mb, "MODELS", {"tiny": (128, 256, 2, 1, 64)})
    assert main(["bench", "--microbench", "tiny", "-b", "1", "-d", "32", "-r", "1", "-o", "json"]) == 0
    out = capsys.readouterr()
    assert [r["kernel"]["kernel"] for r in json.loads(out.out)] == ["qmv"] * 4 + ["swiglu", "sdpa", "sdpa-q8"]
    assert out.err.strip().splitlines() == [
        "warning: `bench --microbench` is deprecated: use `mlxinfer microbench` (-b is --rows there, -d is --context)"]
    assert main(["bench", "--microbench", "--compare", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "--compare does not apply to --microbench" in err and "deprecated" not in err
