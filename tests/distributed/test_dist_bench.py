"""``mlxinfer bench`` on two ranks writes one valid record (rank 0 only) with world size, backend, strategy,
per-rank peak memory and the communication one token needs."""

from __future__ import annotations

import json

from dist_cli import launch, needs_launch, tiny_llama

pytestmark = needs_launch


def test_bench_record_under_two_ranks(tmp_path):
    model = tiny_llama(tmp_path / "m")
    out = tmp_path / "run.json"
    proc = launch("bench", model, "-p", "16", "-n", "8", "-r", "2", "--warmup", "0", "-o", str(out), "--pipeline")
    assert "exited with code" not in proc.stderr, proc.stderr
    assert proc.stderr.count("saved 1 records") == 1  # rank 1 wrote and said nothing
    records = json.loads(out.read_text())
    assert len(records) == 1
    rec = records[0]
    d = rec["distributed"]
    assert (d["world_size"], d["backend"], d["strategy"], d["rank0_layers"]) == (2, "ring", "pipeline", "0-1 of 4")
    peaks = d["peak_memory_bytes_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    assert 0 < d["comm_s_per_token"] < 5
    assert d["bytes_sent_per_token"] == 2 * 64 * 4  # rank 0: one hand-off + its all_gather share, float32
    assert "pipeline parallel over 2 ranks" in rec["engine"]["kernels_detail"]
    assert rec["results"]["decode_tps"]["n"] == 2 and rec["results"]["decode_tps"]["mean"] > 0
    from mlxinfer.bench import report

    assert report.load_baseline(out)  # readable as a --compare baseline


def test_a_batch_runs_the_serving_engine_on_every_rank(tmp_path):
    """``-b``: each rank runs the serving engine on the same prompts, replaying the same rounds (one forward pass
    per step), so their collectives pair up; rank 0 reports."""
    model = tiny_llama(tmp_path / "m")
    out = tmp_path / "run.json"
    proc = launch("bench", model, "-p", "16", "-n", "8", "-b", "2", "-r", "1", "--warmup", "0", "-o", str(out))
    assert "exited with code" not in proc.stderr, proc.stderr
    records = json.loads(out.read_text())
    assert len(records) == 1
    rec = records[0]
    assert rec["workload"]["batch"] == 2 and rec["results"]["decode_tps"]["mean"] > 0
    assert rec["distributed"]["world_size"] == 2 and rec["distributed"]["strategy"] == "tensor"
