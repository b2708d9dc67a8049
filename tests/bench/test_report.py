"""Report formats, comparisons and the depth chart on synthetic records."""

from __future__ import annotations

import copy
import csv
import io
import json
import os

import pytest

from mlxinfer.bench import report
from mlxinfer.bench.runner import PROVENANCE, SCHEMA
from mlxinfer.errors import InvalidParameter


def assert_provenance(record: dict) -> None:
    assert record["schema"] == SCHEMA and record["timestamp"] and record["test"]
    for section, names in PROVENANCE.items():
        missing = [n for n in names if n not in record[section]]
        assert not missing, (section, missing)


def test_json_and_jsonl_round_trip_with_provenance(records):
    parsed = json.loads(report.render(records, "json"))
    assert parsed == records
    lines = report.render(records, "jsonl").splitlines()
    assert [json.loads(line) for line in lines] == records
    for r in parsed:
        assert_provenance(r)


def test_csv_has_one_row_per_record_and_every_provenance_column(records):
    rows = list(csv.DictReader(io.StringIO(report.render(records, "csv"))))
    assert len(rows) == len(records)
    for section, names in PROVENANCE.items():
        for name in names:
            assert f"{section}.{name}" in rows[0], f"{section}.{name}"
    first = rows[0]
    assert first["engine.name"] == "mlxinfer" and first["model.group_size"] == "32"
    assert float(first["results.decode_tps.mean"]) == pytest.approx(records[0]["results"]["decode_tps"]["mean"])
    # Raw samples survive as space-separated numbers.
    assert len(first["results.samples.decode_tps"].split()) == 2


def test_decode_results_follow_the_timings(records):
    res = records[0]["results"]  # mlxinfer, pp16+tg5: ttft 0.5/0.6, gaps 0.1/0.12
    assert res["decode_tps"]["mean"] == pytest.approx((4 / 0.4 + 4 / 0.48) / 2)
    assert res["prefill_tps"]["mean"] == pytest.approx((16 / 0.5 + 16 / 0.6) / 2)
    assert res["itl_s"]["p50"] == pytest.approx(0.11) and res["itl_s"]["n"] == 8
    assert res["e2e_s"]["max"] == pytest.approx(0.6 + 0.48)
    assert res["kv_cache_bytes"] == 1000 * (16 + 5)
    # bytes per step = weights + KV at mid-decode; bandwidth = bytes × tok/s
    step = (1 << 20) + 1000 * (16 + 2.5)
    assert res["decode_bytes_per_step"] == int(step)
    assert res["bandwidth_gbps"]["mean"] == pytest.approx(step * res["decode_tps"]["mean"] / 1e9)
    assert res["bandwidth_share"] == pytest.approx(res["bandwidth_gbps"]["mean"] / 10.0)


def test_batch_results_are_aggregate(records):
    from mlxinfer.bench.workload import Case

    from bench_fakes import make_record, stream_sample

    rec = make_record(Case("batch", 8, 3, 0, 4), [stream_sample(0.4, [0.2, 0.2], 8, batch=4)])
    res = rec["results"]
    assert res["decode_tps"]["mean"] == pytest.approx(2 * 4 / 0.4)      # 2 steps × 4 sequences in 0.4 s
    assert res["decode_tps_per_sequence"]["mean"] == pytest.approx(5.0)
    assert res["prefill_tps"]["mean"] == pytest.approx(32 / 0.4)
    assert res["kv_cache_bytes"] == 4 * 1000 * 11


def test_compare_ratios_against_a_synthetic_baseline(records):
    baseline = copy.deepcopy(records)
    for r in baseline:
        res = r["results"]
        if "decode_tps" in res:
            res["decode_tps"]["mean"] /= 2        # this run decodes 2x faster than the baseline
            res["ttft_s"]["mean"] *= 4            # and reaches the first token in a quarter of the time
    pairs = report.compare_pairs(records, baseline)
    assert len(pairs) == len(records)
    for a, b in pairs:
        metrics = {m["metric"]: m for m in report.pair_metrics(a, b)}
        if a["workload"]["kind"] == "prefix":
            assert metrics["TTFT warm s"]["ratio"] == pytest.approx(1.0)
            continue
        assert metrics["decode t/s"]["ratio"] == pytest.approx(2.0)
        assert metrics["TTFT s"]["ratio"] == pytest.approx(0.25)
        assert metrics["prefill t/s"]["ratio"] == pytest.approx(1.0)
    rows = report.compare_rows(records, baseline)
    assert ["tiny", "pp16+tg5", "mlxinfer", "decode t/s"] == rows[1][:4] and rows[1][-1] == "2.00x"


def test_compare_falls_back_to_test_and_engine_when_the_model_differs(records):
    other = copy.deepcopy(records[:1])
    other[0]["model"]["name"] = "other-model"
    assert len(report.compare_pairs(records[:1], other)) == 1


def test_peer_rows_pair_engines_on_the_same_test(records):
    pairs = report.peer_pairs(records)
    assert [(a["test"], b["engine"]["name"]) for a, b in pairs] == [
        ("pp16+tg5", "mlx-lm"), ("pp16+tg5 @ d64", "mlx-lm"), ("prefix32+pp16", "mlx-lm")]
    decode = [m for m in report.pair_metrics(*pairs[0]) if m["metric"] == "decode t/s"][0]
    assert decode["ratio"] == pytest.approx(2.0)  # the synthetic mlx-lm is twice as slow


def test_markdown_has_provenance_table_peer_section_and_chart(records):
    md = report.render(records, "md", baseline=records)
    assert "Test CPU, 2 cores" in md and "abc1234def" in md and "4-bit affine, group 32" in md
    assert "| tiny | mlxinfer | pp16+tg5 |" in md
    assert "mlxinfer vs mlx-lm" in md and "against the baseline" in md
    assert "decode tok/s vs depth: tiny, mlxinfer, pp16+tg5" in md


def test_depth_chart_scales_bars_to_the_fastest_depth(records):
    chart = report.depth_chart(records, width=20)
    block = chart[:3]
    assert block[0].startswith("decode tok/s vs depth")
    assert block[1].split()[0] == "d0" and block[2].split()[0] == "d64"
    assert report.depth_chart(records[:1]) == []  # one depth: no chart


def test_baseline_loading_errors(tmp_path, records):
    good = tmp_path / "base.json"
    good.write_text(report.to_json(records))
    assert report.load_baseline(good) == records
    jsonl = tmp_path / "base.jsonl"
    jsonl.write_text(report.to_jsonl(records))
    assert report.load_baseline(jsonl) == records
    with pytest.raises(InvalidParameter, match="cannot read baseline"):
        report.load_baseline(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidParameter, match="not JSON"):
        report.load_baseline(bad)
    bad.write_text('[{"a": 1}]')
    with pytest.raises(InvalidParameter, match="no mlxinfer bench records"):
        report.load_baseline(bad)


def test_output_target_checks_before_running(tmp_path):
    assert report.output_target("csv") == ("csv", None)
    assert report.output_target(str(tmp_path / "r.jsonl")) == ("jsonl", tmp_path / "r.jsonl")
    with pytest.raises(InvalidParameter, match="unknown output"):
        report.output_target(str(tmp_path / "r.txt"))
    with pytest.raises(InvalidParameter, match="does not exist"):
        report.output_target(str(tmp_path / "nope" / "r.json"))
    (tmp_path / "d.json").mkdir()
    with pytest.raises(InvalidParameter, match="is a directory"):
        report.output_target(str(tmp_path / "d.json"))
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(InvalidParameter, match="permission denied"):
            report.output_target(str(locked / "r.json"))


def test_write_atomic_leaves_no_temp_files(tmp_path):
    target = tmp_path / "out.md"
    report.write_atomic(target, "hello\n")
    report.write_atomic(target, "again\n")
    assert target.read_text() == "again\n" and [p.name for p in tmp_path.iterdir()] == ["out.md"]
