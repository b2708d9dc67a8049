"""Turn benchmark records into text: Markdown, CSV, JSON, JSONL, comparison rows (against a saved baseline or the
mlx-lm peer) and a terminal bar chart of decode speed against depth. Nothing here prints; the CLI renders."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

from ..errors import InvalidParameter
from .provenance import flatten
from .stats import format_mean_std

FORMATS = ("md", "csv", "json", "jsonl")
SUFFIX_FORMATS = {".md": "md", ".markdown": "md", ".csv": "csv", ".json": "json", ".jsonl": "jsonl"}
COLUMNS = ("model", "engine", "threads", "test", "prefill t/s", "decode t/s", "TTFT s", "ITL p50/p95/p99 ms", "e2e s",
           "peak mem", "KV cache", "eff. BW GB/s")
LLAMA_COLUMNS = ("model", "size", "params", "backend", "threads", "test", "t/s")  # llama-bench's Markdown table
# The CSV columns by default (llama-bench's CSV is a curated set too); --csv-all writes every field of the record.
CSV_COLUMNS = (
    "timestamp", "model.name", "model.revision", "model.model_type", "model.quantization", "model.params",
    "model.weight_bytes", "model.dtype", "model.path", "engine.name", "engine.version", "engine.git_commit",
    "engine.git_dirty", "engine.mlx", "engine.mlx_lm", "engine.backend", "engine.kernels", "engine.threads",
    "hardware.chip", "hardware.cpu_cores", "hardware.memory_bytes", "hardware.bandwidth_gbps",
    "hardware.bandwidth_method", "hardware.load_avg_1m", "test", "workload.kind", "workload.prompt_tokens",
    "workload.gen_tokens", "workload.depth", "workload.batch", "workload.prompt_source", "workload.warmup",
    "workload.repetitions", "workload.kv_bits", "workload.max_kv_size",
    "results.prefill_tps.mean", "results.prefill_tps.std", "results.decode_tps.mean", "results.decode_tps.std",
    "results.decode_tps_per_sequence.mean", "results.ttft_s.mean", "results.e2e_s.mean", "results.itl_s.p50",
    "results.itl_s.p95", "results.itl_s.p99", "results.ttft_cold_s.mean", "results.ttft_warm_s.mean",
    "results.ttft_speedup", "results.peak_memory_bytes", "results.kv_cache_bytes", "results.bandwidth_gbps.mean", "results.bandwidth_share",
)
# Metrics compared between runs/engines: (results key, label, higher is better).
COMPARED = (("prefill_tps", "prefill t/s", True), ("decode_tps", "decode t/s", True), ("ttft_s", "TTFT s", False),
            ("ttft_cold_s", "TTFT cold s", False), ("ttft_warm_s", "TTFT warm s", False),
            ("peak_memory_bytes", "peak mem MB", False))


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _engine_label(e: dict) -> str:
    return e["name"] if e.get("kernels") in (None, "builtin") else f"{e['name']} ({e['kernels']})"


def _threads(r: dict) -> str:
    t = r["engine"].get("threads")
    return "-" if t is None else str(t)


def over_peak(r: dict) -> bool:
    """More than 100% of the peak bandwidth: a measurement problem (a low peak, caches), never a real share."""
    share = r["results"].get("bandwidth_share")
    return share is not None and share > 1


def summary_row(r: dict) -> list[str]:
    """One table row for a record, in COLUMNS order."""
    res, base = r["results"], [r["model"]["name"], _engine_label(r["engine"]), _threads(r), r["test"]]
    if r["workload"]["kind"] == "prefix":
        cold, warm = res["ttft_cold_s"], res["ttft_warm_s"]
        ttft = f"{format_mean_std(cold, 3)} cold → {format_mean_std(warm, 3)} warm ({res['ttft_speedup']:.1f}x)"
        return base + ["-", "-", ttft, "-", "-", fmt_bytes(res["peak_memory_bytes"]), "-", "-"]
    itl = res["itl_s"]
    # Tenths of a millisecond: a fast model's 3.2/5.0/6.5 ms read 3/5/7, or one number for all three.
    itl_text = f"{itl['p50'] * 1e3:.1f}/{itl['p95'] * 1e3:.1f}/{itl['p99'] * 1e3:.1f}" if itl and itl["n"] else "-"
    bw = format_mean_std(res["bandwidth_gbps"]) if r["workload"]["gen_tokens"] > 1 else "-"
    if res.get("bandwidth_share") is not None and bw != "-":
        bw += " (over peak!)" if over_peak(r) else f" ({res['bandwidth_share'] * 100:.0f}%)"
    decode = format_mean_std(res["decode_tps"], 1) if r["workload"]["gen_tokens"] > 1 else "-"
    return base + [format_mean_std(res["prefill_tps"], 1), decode,
                   format_mean_std(res["ttft_s"], 3), itl_text, format_mean_std(res["e2e_s"]),
                   fmt_bytes(res["peak_memory_bytes"]), fmt_bytes(res["kv_cache_bytes"]), bw]


def summary_table(records: list[dict], compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of the main table; ``compact`` drops the model/engine columns when they never change."""
    columns, rows = list(COLUMNS), [summary_row(r) for r in records]
    if compact:
        for name in ("threads", "engine", "model"):
            i = columns.index(name)
            if len({row[i] for row in rows}) <= 1:
                columns.pop(i)
                rows = [row[:i] + row[i + 1:] for row in rows]
    return columns, rows


def _int8_clause(detail: str) -> str:
    """" (decode and prefill at int8)" and the like: where the kernel report says activations were rounded to int8
    (numbers at llama.cpp's precision, not the built-ins')."""
    parts = [part for part in ("decode", "prefill") if f"{part} at int8" in detail]
    return f" ({' and '.join(parts)} at int8)" if parts else ""


def provenance_lines(records: list[dict]) -> list[str]:
    """One line per distinct model, engine, machine: what the numbers were measured on."""
    lines, seen = [], set()
    for r in records:
        m, e, h, o = r["model"], r["engine"], r["hardware"], r["os"]
        quant = m["quantization"]
        items = [
            f"model {m['name']}: {m['model_type']}, {m['params'] / 1e6:.1f}M params, {quant}, {m['dtype']}, "
            f"{fmt_bytes(m['weight_bytes'])} weights, revision {m['revision'] or '-'}",
            f"engine {e['name']} {e['version']}"
            + (f" @ {e['git_commit'][:10]}{' (dirty)' if e.get('git_dirty') else ''}" if e.get("git_commit") else "")
            + f": mlx {e['mlx']}, mlx-lm {e['mlx_lm']}, backend {e['backend']}, kernels {e['kernels']}"
            + _int8_clause(e.get("kernels_detail") or ""),
            f"hardware: {h['chip']}, {h['cpu_cores']} cores, {fmt_bytes(h['memory_bytes'])} memory, peak bandwidth "
            + (f"{h['bandwidth_gbps']:.1f} GB/s ({h['bandwidth_source']})" if h.get("bandwidth_gbps") else "unknown")
            + f"; {o['platform']}, Python {o['python']}",
        ]
        for item in items:
            if item not in seen:
                seen.add(item)
                lines.append(item)
    threads = sorted({r["engine"]["threads"] for r in records if r["engine"].get("threads") is not None})
    if threads:
        lines.append(f"threads: {', '.join(map(str, threads))} (the native CPU kernels' worker threads; "
                     "MLX's built-in ops and the mlx-lm peer have no thread setting)")
    over = [r for r in records if over_peak(r)]
    if over:
        h = over[-1]["hardware"]
        lines.append(f"bandwidth: {len(over)} test(s) read faster than the peak {h['bandwidth_gbps']:.1f} GB/s "
                     f"({h['bandwidth_source']}): a measurement problem (the peak is too low, or CPU caches held "
                     "the weights), so no share is shown for them; pass --bandwidth GB/s to set the peak")
    if records:
        w = records[0]["workload"]
        kv = (f", KV cache {w['kv_bits']}-bit" if w.get("kv_bits") else "") + (
            f", KV cache at most {w['max_kv_size']} tokens (rotating)" if w.get("max_kv_size") else "")
        reps = f"{w['repetitions']} repetition{'s' if w['repetitions'] != 1 else ''}"
        lines.append(f"workload: prompt {w['prompt_source']}, {w['warmup']} warmup + {reps}, "
                     f"{w['sampler']}, EOS ignored{kv}; mean ± std; {records[0]['timestamp']}, "
                     f"load average {records[0]['hardware'].get('load_avg_1m')}")
    return lines


def md_table(headers, rows) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
    return "\n".join(out)


def to_markdown(records: list[dict], baseline: list[dict] | None = None) -> str:
    parts = ["\n".join(f"- {line}" for line in provenance_lines(records)), md_table(COLUMNS, map(summary_row, records))]
    peer = peer_rows(records)
    if peer:
        parts.append("mlxinfer vs mlx-lm (ratio = mlxinfer / mlx-lm)\n\n" + md_table(PEER_COLUMNS, peer)
                     + peer_dtype_note(records))
    if baseline is not None:
        parts.append(compare_part(records, baseline))
    chart = depth_chart(records)
    if chart:
        parts.append("```\n" + "\n".join(chart) + "\n```")
    return "\n\n".join(parts) + "\n"


def llama_row(r: dict) -> list[str]:
    """One llama-bench row: t/s is prompt processing for ppP tests, generation for the others."""
    m, e, w, res = r["model"], r["engine"], r["workload"], r["results"]
    backend = e["backend"] + (f" ({e['kernels']})" if e["name"] == "mlxinfer" else f" ({e['name']})")
    params = m["params"]
    label = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    if w["kind"] == "prefix":
        tps = "-"
    else:
        tps = format_mean_std(res["prefill_tps"] if w["kind"] == "pp" or w["gen_tokens"] <= 1
                              else res["decode_tps"], 2)
    return [m["name"], f"{m['weight_bytes'] / 2**30:.2f} GiB" if m["weight_bytes"] >= 2**30
            else f"{m['weight_bytes'] / 2**20:.2f} MiB", label, backend, _threads(r), r["test"], tps]


def to_llama_markdown(records: list[dict], baseline: list[dict] | None = None) -> str:
    """llama-bench's table (model | size | params | backend | threads | test | t/s) under the provenance."""
    parts = ["\n".join(f"- {line}" for line in provenance_lines(records)),
             md_table(LLAMA_COLUMNS, map(llama_row, records))]
    if baseline is not None:
        parts.append(compare_part(records, baseline))
    return "\n\n".join(parts) + "\n"


def _csv_value(v) -> object:
    if isinstance(v, list):
        return " ".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in v)
    return "" if v is None else v


def to_csv(records: list[dict], all_columns: bool = False) -> str:
    """One row per record, dotted column names (``results.decode_tps.mean``): CSV_COLUMNS (those any record has),
    or with ``all_columns`` the union of all records' fields, raw samples included."""
    flat = [flatten(r) for r in records]
    columns: list[str] = []
    for f in flat:
        columns += [k for k in f if k not in columns]
    if not all_columns:
        columns = [c for c in CSV_COLUMNS if c in columns]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    w.writeheader()
    for f in flat:
        w.writerow({k: _csv_value(f.get(k)) for k in columns})
    return buf.getvalue()


def to_json(records: list[dict]) -> str:
    return json.dumps(records, indent=1) + "\n"


def to_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def render(records: list[dict], fmt: str, baseline: list[dict] | None = None, *, llama: bool = False,
           csv_all: bool = False) -> str:
    if fmt == "md":
        return to_llama_markdown(records, baseline) if llama else to_markdown(records, baseline)
    if fmt == "csv":
        return to_csv(records, all_columns=csv_all)
    return {"json": to_json, "jsonl": to_jsonl}[fmt](records)


# ---- comparisons -------------------------------------------------------------------------------------------------
PEER_COLUMNS = ("model", "test", "metric", "mlxinfer", "mlx-lm", "ratio")  # test: "pp16+tg8 t2" in a -t sweep
COMPARE_COLUMNS = ("model", "test", "engine", "metric", "this run", "baseline", "ratio")


def _key(r: dict) -> tuple:
    return (r["model"]["name"], r["test"], r["engine"]["name"], r["engine"].get("threads"))


def pair_metrics(a: dict, b: dict) -> list[dict]:
    """Mean of each compared metric in two records and the ratio a / b (None when b's is zero)."""
    out = []
    for key, label, higher in COMPARED:
        va, vb = a["results"].get(key), b["results"].get(key)
        if va is None or vb is None:
            continue
        ma = va["mean"] if isinstance(va, dict) else float(va)
        mb = vb["mean"] if isinstance(vb, dict) else float(vb)
        if key == "peak_memory_bytes":
            ma, mb = ma / 2**20, mb / 2**20
        out.append({"metric": label, "a": ma, "b": mb, "ratio": ma / mb if mb else None, "higher_is_better": higher})
    return out


def _rows(pairs: list[tuple[dict, dict]], with_engine: bool = False) -> list[list[str]]:
    rows = []
    sweep = len({a["engine"].get("threads") for a, _ in pairs}) > 1
    for a, b in pairs:
        test = a["test"] + (f" t{_threads(a)}" if sweep else "")
        for m in pair_metrics(a, b):
            ratio = "-" if m["ratio"] is None else f"{m['ratio']:.2f}x"
            head = [a["model"]["name"], test] + ([_engine_label(a["engine"])] if with_engine else [])
            rows.append(head + [m["metric"], f"{m['a']:.3f}", f"{m['b']:.3f}", ratio])
    return rows


def peer_pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """(mlxinfer record, mlx-lm record) for each model and test measured by both."""
    peers = {(r["model"]["name"], r["test"]): r for r in records if r["engine"]["name"] == "mlx-lm"}
    return [(r, peers[(r["model"]["name"], r["test"])]) for r in records
            if r["engine"]["name"] == "mlxinfer" and (r["model"]["name"], r["test"]) in peers]


def peer_rows(records: list[dict]) -> list[list[str]]:
    return _rows(peer_pairs(records))


def peer_dtype_note(records: list[dict]) -> str:
    """Under the peer ratios: each engine runs its own default dtype, which the ratios include (on a CPU mlx-lm's
    float16 is far slower than float32); said where they differ, not only in the header lines."""
    pairs = {(a["model"]["dtype"], b["model"]["dtype"]) for a, b in peer_pairs(records)
             if a["model"].get("dtype") != b["model"].get("dtype")}
    if not pairs:
        return ""
    ran = "; ".join(f"mlxinfer {a}, mlx-lm {b}" for a, b in sorted(pairs, key=str))
    return f"\n\nnote: the engines ran different dtypes ({ran}), each its own default; the ratios include that"


def compare_pairs(records: list[dict], baseline: list[dict]) -> list[tuple[dict, dict]]:
    """(record, baseline record) matched on model, test, engine and threads; failing that on model, test and engine
    (a baseline from another thread count, or from before records had threads); when the models differ (comparing
    two models on purpose) on test and engine. A looser key is used only when exactly one baseline record fits."""
    keys = (_key, lambda r: _key(r)[:3], lambda r: (r["test"], r["engine"]["name"]))
    index: list[dict[tuple, list[dict]]] = []
    for key in keys:
        found: dict[tuple, list[dict]] = {}
        for r in baseline:
            found.setdefault(key(r), []).append(r)
        index.append(found)
    pairs = []
    for r in records:
        for i, (key, found) in enumerate(zip(keys, index)):
            options = found.get(key(r), [])
            if options and (i == 0 or len(options) == 1):
                pairs.append((r, options[0]))
                break
    return pairs


def compare_rows(records: list[dict], baseline: list[dict]) -> list[list[str]]:
    return _rows(compare_pairs(records, baseline), with_engine=True)


def compare_part(records: list[dict], baseline: list[dict]) -> str:
    """The ratio table against a baseline, or a line saying that no test matched (an empty table said nothing)."""
    rows = compare_rows(records, baseline)
    if rows:
        return "against the baseline (ratio = this run / baseline)\n\n" + md_table(COMPARE_COLUMNS, rows)

    def tests(rs: list[dict]) -> str:
        return ", ".join(dict.fromkeys(r["test"] for r in rs)) or "none"

    return (f"against the baseline: no test of this run is in it (this run: {tests(records)}; baseline: "
            f"{tests(baseline)}); run the baseline's tests to compare")


def load_baseline(path: Path) -> list[dict]:
    """Records saved with ``-o json`` (a list) or ``-o jsonl``; raises InvalidParameter with one clear line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidParameter(f"cannot read baseline {path}: {e.strerror or e}", hint="check the path") from None
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise InvalidParameter(f"baseline {path} is not JSON or JSONL ({e})",
                                   hint="save a run with -o json") from None
    if isinstance(data, dict):
        data = data.get("records", [data])
    if not isinstance(data, list) or not data or not all(_is_record(r) for r in data):
        raise InvalidParameter(f"baseline {path} holds no mlxinfer bench records", hint="save a run with -o json")
    return data


def _is_record(r) -> bool:
    return isinstance(r, dict) and all(k in r for k in ("test", "engine", "model", "workload", "results"))


# ---- chart and output ----------------------------------------------------------------------------------------------
def depth_chart(records: list[dict], width: int = 40) -> list[str]:
    """Bars of decode tok/s against depth, one group per (engine, model, prompt, gen, batch) with 2+ depths."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        w = r["workload"]
        if w["kind"] != "prefix" and r["results"].get("decode_tps"):  # (a prefill-only test decodes nothing)
            key = (r["engine"]["name"], r["model"]["name"], w["prompt_tokens"], w["gen_tokens"], w["batch"])
            groups.setdefault(key, []).append(r)
    lines: list[str] = []
    for (engine, model, p, n, b), rs in groups.items():
        if len({r["workload"]["depth"] for r in rs}) < 2:
            continue
        rs = sorted(rs, key=lambda r: r["workload"]["depth"])
        values = [r["results"]["decode_tps"]["mean"] for r in rs]
        top = max(values) or 1.0
        label_w = max(len(f"d{r['workload']['depth']}") for r in rs)
        lines.append(f"decode tok/s vs depth: {model}, {engine}, pp{p}+tg{n}" + (f" x b{b}" if b > 1 else ""))
        for r, v in zip(rs, values):
            cells = v / top * width
            partial = " ▏▎▍▌▋▊▉"[int((cells - int(cells)) * 8)] if cells < width else ""
            bar = "█" * int(cells) + partial
            lines.append(f"  {'d' + str(r['workload']['depth']):>{label_w}} {bar.rstrip():<{width}} {v:.2f}")
    return lines


def output_target(value: str | None) -> tuple[str | None, Path | None]:
    """``-o`` is a format name (write to stdout) or a file path whose suffix names the format."""
    if value is None:
        return None, None
    if value in FORMATS:
        return value, None
    path = Path(value).expanduser()
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InvalidParameter(f"unknown output {value!r}",
                               hint=f"use a format ({', '.join(FORMATS)}) or a file ending in .md/.csv/.json/.jsonl")
    check_writable(path)
    if path.is_file() and path.stat().st_size and not _is_report(path, fmt):
        raise InvalidParameter(f"refusing to overwrite {path}: it is not a bench report",
                               hint="choose another -o file, or remove that one first")
    return fmt, path


def _is_report(path: Path, fmt: str) -> bool:
    """Whether an existing file is one a bench run wrote (in ``fmt``): those are replaced, anything else is not."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(64 << 20 if fmt == "json" else 1 << 20)
    except (OSError, UnicodeDecodeError):
        return False
    try:
        if fmt == "json":  # bench and microbench records both carry "engine" (what ran) and "hardware"
            data = json.loads(head)
            return isinstance(data, list) and all(isinstance(r, dict) and {"engine", "hardware"} <= r.keys()
                                                  for r in data)
        if fmt == "jsonl":
            first = json.loads(head.splitlines()[0])
            return isinstance(first, dict) and {"engine", "hardware"} <= first.keys()
    except (ValueError, IndexError):
        return False
    if fmt == "csv":
        return bool(head) and "engine." in head.splitlines()[0]
    # Markdown: our table, llama-bench's, microbench's
    return any(mark in head for mark in ("| model |", "| kernel |", "no kernels measured"))


def check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InvalidParameter(f"output {path} is a directory", hint="give a file name")
    if parent.exists() and not parent.is_dir():
        raise InvalidParameter(f"cannot write {path}: {parent} is not a folder", hint="choose another path")
    if not parent.is_dir():
        raise InvalidParameter(f"cannot write {path}: folder {parent} does not exist", hint="create it first")
    # Tried for real, not with os.access (which passes for root in /sys and cannot see /proc): the report is
    # written when the run ends, and a path found unwritable then lost the whole run's results.
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
        if path.exists():
            os.close(os.open(path, os.O_WRONLY))
    except OSError as e:
        raise InvalidParameter(f"cannot write {path}: {(e.strerror or str(e)).lower()}",
                               hint="choose another path") from None
