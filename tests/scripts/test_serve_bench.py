"""scripts/serve_bench.py's summary: TTFT over all requests and over each client's later ones (past the start's
burst or ramp), and the table row that shows both."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "scripts" / "serve_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _req(nth: int, ttft: float, start: float = 10.0) -> dict:
    return {"start": start, "times": [start + ttft, start + ttft + 0.01], "nth": nth, "tokens": 2}


def test_later_ttft_leaves_out_each_clients_first_request():
    sb = _module()
    # two clients: their first requests met a burst (0.6 s, 0.5 s), the later ones 0.1-0.2 s; one streamed nothing
    results = [_req(0, 0.6), _req(1, 0.1), _req(2, 0.2), _req(0, 0.5), _req(1, 0.15),
               {"start": 1.0, "times": [], "nth": 2, "tokens": 0}]
    stats = sb.ttft_stats(results)
    assert abs(stats["ttft_p99_s"] - 0.596) < 1e-9  # all five: the burst dominates p99
    assert 0.19 < stats["ttft_p99_later_s"] <= 0.2
    assert abs(stats["ttft_p50_s"] - 0.2) < 1e-9
    assert sb.ttft_stats([_req(0, 0.3)])["ttft_p99_later_s"] is None  # one request per client: no later ones


def test_the_table_shows_the_later_p99_or_a_dash():
    sb = _module()
    row = {"engine": "mlxinfer", "clients": 8, "req_per_s": 3.0, "ttft_p50_s": 0.2, "ttft_p99_s": 0.6,
           "ttft_p99_later_s": 0.25, "itl_p50_s": 0.02, "itl_p99_s": 0.1, "aggregate_tok_s": 200.0,
           "decode_tok_s": 300.0, "server_cpu_ms_per_token": 8.0, "load_avg_1m": 1.5}
    lines = sb.table([row, {**row, "ttft_p99_later_s": None}]).splitlines()
    assert "TTFT p99 later ms" in lines[0] and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| 600 | 250 | 20.0 |" in lines[2] and "| 600 | — | 20.0 |" in lines[3]
