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


def test_csv_all_has_one_row_per_record_and_every_provenance_column(records):
    rows = list(csv.DictReader(io.StringIO(report.render(records, "csv", csv_all=True))))
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


def test_peer_ratios_say_when_the_engines_ran_different_dtypes(records):
    """mlx-lm runs its float16 default on the CPU, far slower than mlxinfer's float32: the 77x ratios said
    nothing of it below the table."""
    assert "different dtypes" not in report.render(records, "md")
    mixed = copy.deepcopy(records)
    for r in mixed:
        r["model"]["dtype"] = "float16" if r["engine"]["name"] == "mlx-lm" else "float32"
    assert ("note: the engines ran different dtypes (mlxinfer float32, mlx-lm float16), each its own default; the "
            "ratios include that") in report.render(mixed, "md")


def test_markdown_has_provenance_table_peer_section_and_chart(records):
    md = report.render(records, "md", baseline=records)
    assert "Test CPU, 2 cores" in md and "abc1234def" in md and "4-bit affine, group 32" in md
    assert "| tiny | mlxinfer | - | pp16+tg5 |" in md
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


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "md"])
def test_an_existing_file_is_replaced_only_when_it_is_a_bench_report(tmp_path, records, fmt):
    """-o settings.json or -o README.md replaced the user's file; a report from an earlier run is replaced."""
    earlier = tmp_path / f"run.{fmt}"
    earlier.write_text(report.render(records, fmt))
    assert report.output_target(str(earlier)) == (fmt, earlier)
    llama = tmp_path / "llama.md"
    llama.write_text(report.render(records, "md", llama=True))
    assert report.output_target(str(llama))[1] == llama
    other = tmp_path / f"settings.{fmt}"
    other.write_text({"json": '{"theme": "dark"}', "jsonl": '{"a": 1}\n', "csv": "name,value\nx,1\n",
                      "md": "# My notes\n\nkeep me\n"}[fmt])
    with pytest.raises(InvalidParameter, match=f"refusing to overwrite .*settings.{fmt}: it is not a bench report"):
        report.output_target(str(other))
    empty = tmp_path / f"empty.{fmt}"
    empty.touch()
    assert report.output_target(str(empty))[1] == empty


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


def test_default_csv_is_the_curated_column_set(records):
    text = report.render(records, "csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == len(records)
    columns = list(rows[0])
    # The curated columns in their order (those the records have), no raw samples, far fewer than --csv-all.
    assert columns == [c for c in report.CSV_COLUMNS if c in columns]
    assert {"model.name", "model.params", "model.weight_bytes", "engine.backend", "engine.threads", "test",
            "results.prefill_tps.mean", "results.decode_tps.mean", "results.ttft_warm_s.mean"} <= set(columns)
    # A row identifies the run (engine and library versions, model revision, memory, workload) and has p95 too.
    assert {"engine.mlx", "engine.mlx_lm", "model.revision", "hardware.memory_bytes", "workload.warmup",
            "workload.prompt_source", "results.itl_s.p50", "results.itl_s.p95", "results.itl_s.p99"} <= set(columns)
    assert not [c for c in columns if ".samples." in c]
    everything = list(csv.DictReader(io.StringIO(report.render(records, "csv", csv_all=True))))[0]
    assert len(columns) <= 55 < len(everything)


def _llama_records(share_peak: float = 10.0):
    from bench_fakes import HARDWARE, make_record, stream_sample

    from mlxinfer.bench.workload import expand_cases

    hw = {**HARDWARE, "bandwidth_gbps": share_peak}
    out = []
    for threads in (1, 2):
        for case in expand_cases([16], [5], split=True):
            gaps = [0.1 / threads] * (case.gen - 1)
            out.append(make_record(case, [stream_sample(0.5, gaps, case.prompt)] * 2, threads=threads, hardware=hw))
    return out


def test_llama_bench_rows_separate_pp_and_tg_with_a_threads_column():
    recs = _llama_records()
    assert [(r["test"], r["workload"]["kind"], r["engine"]["threads"]) for r in recs] == [
        ("pp16", "pp", 1), ("tg5", "tg", 1), ("pp16", "pp", 2), ("tg5", "tg", 2)]
    md = report.render(recs, "md", llama=True)
    assert "| model | size | params | backend | threads | test | t/s |" in md
    lines = [line for line in md.splitlines() if line.startswith("| tiny |")]
    assert lines[0] == "| tiny | 1.00 MiB | 1.00 M | cpu (builtin) | 1 | pp16 | 32.00 ± 0.00 |"  # 16 tokens / 0.5 s
    assert lines[1] == "| tiny | 1.00 MiB | 1.00 M | cpu (builtin) | 1 | tg5 | 10.00 ± 0.00 |"   # 4 gaps of 0.1 s
    assert lines[3].endswith("| 2 | tg5 | 20.00 ± 0.00 |")
    assert "threads: 1, 2 (the native CPU kernels' worker threads" in md
    # The default table has the threads column too; a pp row has no decode speed and no bandwidth share.
    default = report.render(recs, "md")
    assert "| tiny | mlxinfer | 2 | tg5 |" in default
    assert recs[0]["results"]["bandwidth_share"] is None


def test_compare_keeps_thread_counts_apart():
    recs = _llama_records()
    pairs = report.compare_pairs(recs, copy.deepcopy(recs))
    assert [(a["engine"]["threads"], b["engine"]["threads"]) for a, b in pairs] == [(1, 1), (1, 1), (2, 2), (2, 2)]
    rows = report.compare_rows(recs, copy.deepcopy(recs))
    assert rows[0][1] == "pp16 t1"
    # A baseline from before records had threads (or of one thread count) still matches on model, test, engine,
    # also when it holds several models with the same tests.
    old = copy.deepcopy(recs[:2]) + [copy.deepcopy(r) for r in recs[:2]]
    for r in old[:2]:
        del r["engine"]["threads"]
    for r in old[2:]:
        r["model"]["name"] = "other"
    assert [b["test"] for _, b in report.compare_pairs(recs, old)] == ["pp16", "tg5", "pp16", "tg5"]
    assert all(b["model"]["name"] == "tiny" for _, b in report.compare_pairs(recs, old))


def test_bandwidth_over_the_peak_is_flagged_not_printed_as_a_share():
    recs = _llama_records(share_peak=1e-6)  # a peak far below what the fake run read
    tg = recs[1]["results"]
    assert tg["bandwidth_share"] > 1 and "above the peak of 0.0 GB/s" in tg["bandwidth_note"]
    assert report.over_peak(recs[1]) and not report.over_peak(recs[0])
    md = report.render(recs, "md")
    assert "over peak!" in md and "%)" not in md.split("| test |")[1]
    assert "2 test(s) read faster than the peak" in md and "a measurement problem" in md
    fine = _llama_records()[1]
    assert "(" in report.summary_row(fine)[-1] and "%)" in report.summary_row(fine)[-1]


def test_provenance_says_when_prefill_ran_at_int8(records):
    """The kernel report's int8 prefill clause (the AVX2 default) reaches the engine line: prefill numbers depend
    on it."""
    assert "(prefill at int8)" not in "\n".join(report.provenance_lines(records))
    rows = copy.deepcopy(records)
    for r in rows:
        r["engine"]["kernels_detail"] = "cpu-native on cpu: 4 quantized linear layers; prefill at int8 (avx2+int8-prefill)"
    engine_lines = [line for line in report.provenance_lines(rows) if line.startswith("engine ")]
    assert engine_lines and all(line.endswith(" (prefill at int8)") for line in engine_lines), engine_lines
    for r in rows:
        r["engine"]["kernels_detail"] = ("cpu-native on cpu: 4 quantized linear layers; decode at int8 (avx2i8: ...); "
                                         "prefill at int8 (avx2i8+int8-prefill)")
    engine_lines = [line for line in report.provenance_lines(rows) if line.startswith("engine ")]
    assert engine_lines and all(line.endswith(" (decode and prefill at int8)") for line in engine_lines), engine_lines


def test_compare_with_no_common_test_says_so(records):
    """--compare against a run of other tests printed an empty table and nothing else."""
    baseline = copy.deepcopy(records)
    for r in baseline:
        r["test"] = "pp999+tg1"
    text = report.to_markdown(records, baseline)
    mine = ", ".join(dict.fromkeys(r["test"] for r in records))
    assert (f"against the baseline: no test of this run is in it (this run: {mine}; baseline: pp999+tg1); run "
            "the baseline's tests to compare") in text
    assert "ratio = this run / baseline" not in text
    assert "ratio = this run / baseline" in report.to_markdown(records, copy.deepcopy(records))


def test_a_prefill_only_test_records_no_decode_figures(records):
    """llama-bench's ppN decodes nothing: its record said decode 0.0 tok/s, ITL 0 ms and 0 GB/s (a script that
    averaged them got zeros) and --compare printed a 'decode t/s 0.000 0.000 -' row. They are null now."""
    from mlxinfer.bench.workload import Case

    from bench_fakes import make_record, stream_sample

    pp = make_record(Case("pp", 16, 1, 0, 1), [stream_sample(0.2, [], 16), stream_sample(0.25, [], 16)])
    res = pp["results"]
    assert res["decode_tps"] is None and res["itl_s"] is None and res["bandwidth_gbps"] is None
    assert res["prefill_tps"]["mean"] > 0
    assert [m["metric"] for m in report.pair_metrics(pp, copy.deepcopy(pp))] == ["prefill t/s", "TTFT s",
                                                                                 "peak mem MB"]
    for fmt in ("md", "csv", "json"):
        report.render(records + [pp], fmt)  # every format takes it
    assert report.render([pp], "md").count("| - |") >= 1


@pytest.mark.parametrize("width", [80, 200])
def test_the_results_table_is_never_cut_on_a_narrow_terminal(records, capsys, monkeypatch, width):
    """At 80 columns Rich cut every cell: the test column read "pp16+…" on each row and ITL "8.2/1…". A table too
    wide for the terminal is printed as one block of "column  value" lines per row instead."""
    from mlxinfer.bench import report
    from mlxinfer.ui.bench_view import print_bench

    monkeypatch.setenv("COLUMNS", str(width))
    print_bench(records, None, None)
    out = capsys.readouterr().out
    assert "…" not in out
    columns, rows = report.summary_table(records, compact=True)
    for row in rows:
        for cell in row:
            assert cell in out
    assert all(len(line) <= width for line in out.splitlines())
