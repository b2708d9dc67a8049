#!/usr/bin/env python
"""A cold burst in the serving engine, in process (no HTTP): 8 chat requests arriving together with one long system
prompt (~750 tokens on the bundled model), the prefix cache on and empty; prints when each got its first token.

    python scripts/burst_bench.py          # the engine as it is (a shared start is prefilled once)
    python scripts/burst_bench.py --base   # without the shared-start prefill: each prompt prefills all of it

Each round uses a new system prompt, a new engine and an empty cache. Numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import mlxinfer
from mlxinfer.serve import schemas as s
from mlxinfer.serve.metrics import Metrics
from mlxinfer.serve.scheduler import Engine
from mlxinfer.serve.sequence import Ticket

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?", "Who wrote Hamlet?",
             "What is 2 + 2?", "Name a color.", "What is water made of?", "How many legs does a spider have?"]


def first_tokens(loaded, prompts: list[list[int]]) -> list[float]:
    """Seconds from submitting all ``prompts`` to each one's first token."""
    engine = Engine(loaded, Metrics(), parallel=len(prompts), prefix_cache_bytes=256 << 20)

    async def go() -> list[float]:
        loop = asyncio.get_running_loop()
        tickets = [Ticket(s.Job("chat", p, mlxinfer.SamplingParams(temperature=0), 4), loop, asyncio.Queue())
                   for p in prompts]
        t0 = time.perf_counter()
        for t in tickets:
            engine.submit(t)
        engine.start()
        out = []
        for t in tickets:
            first = None
            while (event := await t.queue.get())[0] != "done":
                if event[0] == "text" and first is None:
                    first = time.perf_counter() - t0
                elif event[0] == "error":
                    raise SystemExit(str(event[1]))
            out.append(first)
        return out

    try:
        return asyncio.run(go())
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", action="store_true", help="turn the shared-start prefill off")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.base:
        Engine._prefill_shared_start = lambda self, tickets: None
    loaded = mlxinfer.load(args.model)
    rules = " ".join(f"Rule {i}: always answer politely and check the facts about topic number {i}." for i in range(40))
    for r in range(args.rounds):
        system = f"{rules} (session {r})"
        prompts = [mlxinfer.chat_prompt(loaded, [{"role": "system", "content": system}, {"role": "user", "content": q}])
                   for q in QUESTIONS]
        firsts = sorted(first_tokens(loaded, prompts))
        print(f"{'base' if args.base else 'shared start'}: {len(prompts)} prompts of ~{len(prompts[0])} tokens, "
              f"first tokens p50 {firsts[len(firsts) // 2] * 1e3:.0f} ms, last {firsts[-1] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
