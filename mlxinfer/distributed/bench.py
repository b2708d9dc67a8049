"""What ``mlxinfer bench`` under ``mlx.launch`` adds to each record: world size, backend, strategy, this split,
every rank's peak memory, and the communication one token needs, timed on its own (the same collectives, with
the same sizes, as a decode step of the strategy: pipeline hand-offs plus the final all_gather, or tensor
parallel's two all-reduces per layer), since inside a step they overlap with compute and cannot be separated."""

from __future__ import annotations

import time

from .group import World

_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def per_rank(value: int, world: World) -> list[int]:
    """Every rank's ``value`` (an int below 2**62), in rank order, on every rank."""
    import mlx.core as mx

    slots = [0] * (2 * world.size)
    slots[2 * world.rank], slots[2 * world.rank + 1] = value & 0x7FFFFFFF, value >> 31
    out = mx.distributed.all_sum(mx.array(slots, dtype=mx.int64), group=world.group, stream=mx.cpu).tolist()
    return [int(out[2 * r]) | (int(out[2 * r + 1]) << 31) for r in range(world.size)]


def token_traffic(world: World, dtype: str = "float32", iters: int = 50) -> dict:
    """Time the collectives of one decode token of this plan (mean of ``iters``); bytes each rank sends."""
    import mlx.core as mx

    hidden, layers = world.plan["hidden"], world.plan["n_layers"]
    dt = getattr(mx, dtype, mx.float32)
    x = mx.zeros((1, 1, hidden), dtype=dt)
    g, r, n = world.group, world.rank, world.size
    width = _DTYPES.get(dtype, 4) * hidden

    def one_token():
        if world.plan["strategy"] == "tensor":
            y = x
            for _ in range(2 * layers):
                y = mx.distributed.all_sum(y, group=g)
            return [y]
        h = x
        if r > 0:
            h = mx.distributed.recv_like(h, r - 1, group=g)
        if r < n - 1:
            h = mx.distributed.send(h, r + 1, group=g)
        return [mx.distributed.all_gather(h, group=g)]

    for _ in range(3):
        mx.eval(one_token())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(one_token())
    seconds = (time.perf_counter() - start) / iters
    if world.plan["strategy"] == "tensor":
        sent = 2 * layers * 2 * (n - 1) * width // n   # a ring all-reduce sends 2(n-1)/n of the data per rank
    else:
        sent = (width if r < n - 1 else 0) + (n - 1) * width  # the hand-off, then the all_gather
    return {"comm_s_per_token": seconds, "bytes_sent_per_token": sent}


def annotate(records: list[dict], world: World) -> list[dict]:
    """Add the ``distributed`` section to each record (a collective: every rank calls it)."""
    import mlx.core as mx

    peaks = per_rank(int(mx.get_peak_memory()), world)
    dtype = next((r.get("model", {}).get("dtype") for r in records), None) or "float32"
    traffic = token_traffic(world, dtype)
    for record in records:
        record["distributed"] = {
            "world_size": world.size, "backend": world.backend, "strategy": world.plan["strategy"],
            "rank0_layers": world.plan["layers"], "fallback": world.plan.get("fallback"),
            "peak_memory_bytes_per_rank": peaks, **traffic,
            "comm_measured": "the collectives of one decode token, timed alone on rank 0",
        }
    return records
