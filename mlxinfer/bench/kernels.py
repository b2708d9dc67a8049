"""``mlxinfer microbench``: the kernel engineer's micro-benchmark (``mlxinfer.kernels.microbench``:
custom provider vs MLX built-in at 1B–8B decode shapes) wrapped in records with the same provenance as model runs."""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import InvalidParameter
from . import provenance
from .hardware import hardware_info, os_info

SCHEMA = "mlxinfer-bench-kernels/1"


def shape_sets() -> list[str]:
    from ..kernels.microbench import MODELS

    return list(MODELS)


def check_shape_sets(names: Sequence[str]) -> list[str]:
    known = shape_sets()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidParameter(f"unknown micro-benchmark shape set {unknown[0]!r}", hint=f"use {', '.join(known)}")
    return list(names) or known


def run_kernel_bench(names: Sequence[str], *, rows: Sequence[int] = (1, 4),
                     contexts: Sequence[int] = (512, 4096, 16384), repeat: int = 10,
                     bandwidth_gbps: float | None = None, threads: Sequence[int] | None = None,
                     progress: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """One record per kernel × shape (× native thread count when ``threads`` is given): built-in and custom
    microseconds, speedup, max abs error."""
    from .. import __version__
    from ..kernels import microbench
    from ..kernels.patch import backend
    from .runner import check_threads

    names = check_shape_sets(names)
    check_threads(list(threads) if threads else None)
    sweep = list(threads) if threads else [None]
    per_set = len(rows) * 5 + 2 * len(contexts)  # 4 matmuls + swiglu per row count; sdpa + sdpa-q8 per context
    total, done = per_set * len(names) * len(sweep), [0]

    def tick(row) -> None:
        done[0] += 1
        if progress:
            progress(f"{row.kernel} {row.shape}", done[0], total)

    commit, dirty = provenance.git_commit()
    hw, system, stamp = hardware_info(bandwidth_gbps=bandwidth_gbps, probe=False), os_info(), provenance.timestamp()
    out = []
    from .. import native

    module = native.extension() if backend() == "cpu" else None
    before = module.num_threads() if module is not None else None
    try:
        for count in sweep:
            if count is not None:
                native.set_num_threads(count)
            engine = {"name": "mlxinfer", "version": __version__, "git_commit": commit, "git_dirty": dirty,
                      **provenance.library_versions(), "backend": backend(), "kernels": microbench.provider_name(),
                      "threads": module.num_threads() if module is not None else None}
            found = microbench.run_microbench(names, rows=tuple(rows), contexts=tuple(contexts), repeat=repeat,
                                              progress=tick)
            out += [{"schema": SCHEMA, "timestamp": stamp, "engine": engine, "hardware": hw, "os": system,
                     "kernel": {"kernel": r.kernel, "shape": r.shape, "dtype": r.dtype, "repeat": repeat,
                                "builtin_us": r.builtin_us, "custom_us": r.custom_us, "speedup": r.speedup,
                                "max_abs_err": r.max_abs_err}} for r in found]
    finally:
        if before is not None:
            native.set_num_threads(before)
    return out


def to_markdown(records: list[dict]) -> str:
    from ..kernels.microbench import BenchRow, markdown

    if not records:
        return "no kernels measured\n"
    e, h = records[0]["engine"], records[0]["hardware"]
    head = (f"- engine mlxinfer {e['version']}" + (f" @ {e['git_commit'][:10]}" if e.get("git_commit") else "")
            + f": mlx {e['mlx']}, backend {e['backend']}, custom kernels {e['kernels']}\n"
            f"- hardware: {h['chip']}, {h['cpu_cores']} cores; {records[0]['os']['platform']}; "
            f"{records[0]['timestamp']}")
    fields = ("kernel", "shape", "dtype", "builtin_us", "custom_us", "max_abs_err")
    parts = [head]
    for count in dict.fromkeys(r["engine"].get("threads") for r in records):  # one table per thread count
        rows = [BenchRow(**{k: r["kernel"][k] for k in fields}) for r in records
                if r["engine"].get("threads") == count]
        parts.append((f"native kernels on {count} threads\n\n" if count is not None else "") + markdown(rows))
    return "\n\n".join(parts) + "\n"
