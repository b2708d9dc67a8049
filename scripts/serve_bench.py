#!/usr/bin/env python
"""Load generator for OpenAI-compatible servers: ``mlxinfer serve`` against ``mlx_lm.server`` on the same model.

For each concurrency level (default 1,2,4,8,16) it runs that many clients, each sending ``--requests`` streamed
chat requests back to back (greedy, a fixed ``--max-tokens``, prompts of about ``--prompt-words`` words that
differ per request so no prefix cache helps), and reports requests/s, time to first token p50/p99, inter-token
latency p50/p99 and aggregate generated tokens/s (usage numbers when the server gives them, else streamed chunks:
output throughput, prefill time included), and the decode rate alone: clients ÷ mean inter-token latency, what
the streams receive while they decode (other requests' prefills that stall them included).

    # both engines on the bundled model, servers started and stopped by the script:
    python scripts/serve_bench.py --model smollm2 --engines mlxinfer,mlx_lm -o docs/serve-bench.json
    # an already running server:
    python scripts/serve_bench.py --url http://127.0.0.1:8080 --concurrency 1,8

By default every request asks for the same number of tokens and all clients start together, so they stay in
lockstep: every request arrives in a burst with the others' (the worst case for time to first token). ``--vary``
gives a desynchronised closed loop instead, closer to real traffic: each request's ``max_tokens`` is drawn from
[0.5, 1.5] x ``--max-tokens`` (seeded by the request's number) and the clients' first requests are spread
uniformly over the duration of the warm-up request. mlxinfer's server runs without its prefix cache unless
``--prefix-cache-mb`` gives it one (every prompt starts with the chat template's system prompt: with the cache,
that start is prefilled once, by a burst's first forward or by the first request).

TTFT p99 comes twice: over all requests, and over each client's requests after its first ("later"). A client's
first request meets the start: in lockstep the burst of all first requests, under ``--vary`` the ramp, where the
first requests arrive faster than one prefill each; the later ones see the steady state.

Run it on a quiet machine: it measures the machine as much as the server. Each row also gives the load average
at its end and, for servers the script started, the server process's CPU time per generated token (user + system,
from /proc): on a shared machine that moves much less with the other load than the wall-clock numbers do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

try:
    import httpx
except ImportError:  # a test extra, not a dependency of mlxinfer
    sys.exit("error: serve_bench.py needs httpx: pip install -e '.[test]' (make test installs it)")

WORDS = ("river stone light garden window paper music silver morning forest city ocean story winter bridge "
         "letter market mountain candle harbor").split()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"Request {i}. Write a short story using these words: " + " ".join(rng.choice(WORDS) for _ in range(words))


def max_tokens(i: int, args) -> int:
    if not args.vary:
        return args.max_tokens
    return random.Random(10**6 + i).randint(max(1, args.max_tokens // 2), args.max_tokens * 3 // 2)


async def one_request(client: httpx.AsyncClient, url: str, model: str, i: int, args) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt(i, args.prompt_words)}],
            "max_tokens": max_tokens(i, args), "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=args.headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else len(times)
    return {"start": start, "end": time.perf_counter(), "times": times, "tokens": tokens}


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process ``pid`` (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def ttft_stats(results: list[dict]) -> dict:
    """TTFT p50 and p99 over all requests that streamed a token, and p99 over each client's later requests (its
    ``nth`` > 0: past the start's burst or ramp); None where there are none."""
    every = [r["times"][0] - r["start"] for r in results if r["times"]]
    later = [r["times"][0] - r["start"] for r in results if r["times"] and r.get("nth", 0) > 0]
    return {"ttft_p50_s": percentile(every, 0.5), "ttft_p99_s": percentile(every, 0.99),
            "ttft_p99_later_s": percentile(later, 0.99) if later else None}


async def run_level(url: str, model: str, clients: int, args, pid: int | None = None) -> dict:
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        warm = await one_request(client, url, model, -1 - clients, args)  # warm-up (not counted)
        spread = warm["end"] - warm["start"] if args.vary else 0.0

        async def worker(k: int):
            await asyncio.sleep(spread * k / clients)  # --vary: first requests spread over one request's time
            return [{**await one_request(client, url, model, next(counter) + 1000 * clients, args), "nth": n}
                    for n in range(args.requests)]

        t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
        results = [r for rs in await asyncio.gather(*(worker(k) for k in range(clients))) for r in rs]
        wall, cpu1 = time.perf_counter() - t0, cpu_seconds(pid)
    ttft = ttft_stats(results)
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "wall_s": wall, "req_per_s": len(results) / wall,
            **ttft,
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
            "tokens": tokens, "aggregate_tok_s": tokens / wall,
            "decode_tok_s": clients * len(itl) / sum(itl) if itl and sum(itl) > 0 else None,
            "load_avg_1m": os.getloadavg()[0],
            "server_cpu_ms_per_token": (cpu1 - cpu0) / tokens * 1e3 if cpu0 is not None and cpu1 and tokens else None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, model: str, parallel: int, log_dir: Path, prefix_cache_mb: int = 0
          ) -> tuple[subprocess.Popen, str, str]:
    """Start a server for ``engine`` on a free port; returns (process, base url, model name to send)."""
    port = free_port()
    if engine == "mlxinfer":
        cmd = [sys.executable, "-m", "mlxinfer", "serve", model, "--port", str(port), "--parallel", str(parallel),
               "--queue-size", "256", "--prefix-cache-mb", str(prefix_cache_mb)]
        name = model
    else:
        from mlxinfer.engine.loader import model_dir
        from mlxinfer.registry import Registry

        path = model_dir(Registry.load().resolve(model))  # the same MLX directory mlxinfer loads
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port", str(port),
               "--decode-concurrency", str(parallel), "--prompt-concurrency", str(parallel)]
        name = str(path)
    log = open(log_dir / f"{engine}-{port}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{engine} server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/v1/models", timeout=2, headers=HEADERS).status_code == 200:
                return proc, url, name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"{engine} server did not start within 300 s; see {log.name}")


HEADERS: dict = {}


def table(rows: list[dict]) -> str:
    out = ["| engine | clients | req/s | TTFT p50 ms | TTFT p99 ms | TTFT p99 later ms | ITL p50 ms | ITL p99 ms | "
           "aggregate tok/s | decode tok/s (clients ÷ mean ITL) | server CPU ms/token | load |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cpu, decode, later = r.get("server_cpu_ms_per_token"), r.get("decode_tok_s"), r.get("ttft_p99_later_s")
        out.append(f"| {r['engine']} | {r['clients']} | {r['req_per_s']:.2f} | {r['ttft_p50_s'] * 1e3:.0f} | "
                   f"{r['ttft_p99_s'] * 1e3:.0f} | {'—' if later is None else f'{later * 1e3:.0f}'} | "
                   f"{r['itl_p50_s'] * 1e3:.1f} | {r['itl_p99_s'] * 1e3:.1f} | "
                   f"{r['aggregate_tok_s']:.1f} | {'—' if decode is None else f'{decode:.1f}'} | "
                   f"{'—' if cpu is None else f'{cpu:.1f}'} | {r['load_avg_1m']:.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="benchmark this running server instead of starting servers")
    ap.add_argument("--model", default="smollm2", help="model to serve (and to name in requests)")
    ap.add_argument("--engines", default="mlxinfer,mlx_lm", help="servers to start: mlxinfer, mlx_lm")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per client and level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--prefix-cache-mb", type=int, default=0,
                    help="mlxinfer's prefix cache (default 0: off, so that no request is helped by another's; the "
                         "server's own default is 512: requests then share the chat template's start)")
    ap.add_argument("--vary", action="store_true",
                    help="vary max_tokens per request (0.5-1.5x) and spread the clients' starts (see above)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--api-key", default=os.environ.get("MLXINFER_API_KEY"))
    ap.add_argument("-o", "--output", help="also write the results as JSON here")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    args.headers = HEADERS
    if args.api_key:
        HEADERS["Authorization"] = f"Bearer {args.api_key}"
    rows = []
    targets = [("server", None)] if args.url else [(e.strip(), e.strip()) for e in args.engines.split(",")]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    for label, engine in targets:
        proc = None
        if engine:
            proc, url, name = start(engine, args.model, max(levels), log_dir, args.prefix_cache_mb)
        else:
            url, name = args.url.rstrip("/"), args.model
        try:
            for n in levels:
                row = {"engine": label, **asyncio.run(run_level(url, name, n, args, proc.pid if proc else None))}
                rows.append(row)
                print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    print(table(rows))
    if args.output:
        tmp = Path(args.output + ".tmp")
        tmp.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")},
                                   "results": rows}, indent=2))
        tmp.replace(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
