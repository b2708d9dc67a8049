"""The machine a benchmark ran on: chip/CPU, cores, memory, and peak memory bandwidth with where it came from.

On Apple Silicon the bandwidth comes from Apple's published figures (table below). Elsewhere a short multi-threaded
read probe measures it and caches the result per machine, so later runs report the same reference, but only when
the machine was quiet: a probe taken under load is used for that run alone. A run that reads faster than the
probed peak triggers a new probe (``remeasure_if_exceeded``); what still exceeds it is flagged by the report.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ..fsutil import atomic_write_text

# Unified-memory bandwidth in GB/s (10^9 B/s) from Apple's specifications. Binned Max chips differ by CPU cores:
# (chip, CPU cores) entries win over the plain chip entry.
APPLE_BANDWIDTH_GBPS: dict[str, float] = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
    "M5": 153,
}
APPLE_BINNED_GBPS: dict[tuple[str, int], float] = {("M3 Max", 14): 300, ("M4 Max", 14): 410}
PROBE_VERSION = 3  # 3: multi-threaded read probe (2 was a copy probe, cached even from a loaded machine)
LOADED_PER_CORE = 0.25


def apple_chip_name(label: str) -> str | None:
    """'Apple M3 Max' -> 'M3 Max'; None when the label is not an Apple M-series chip."""
    import re

    m = re.search(r"\b(M\d+)(?:\s+(Pro|Max|Ultra))?\b", label)
    return f"{m[1]} {m[2]}" if m and m[2] else (m[1] if m else None)


def apple_bandwidth(label: str, cpu_cores: int | None) -> tuple[float, str] | None:
    """(GB/s, source) from the Apple table, or None for an unknown chip."""
    chip = apple_chip_name(label)
    if chip is None:
        return None
    if cpu_cores and (chip, cpu_cores) in APPLE_BINNED_GBPS:
        return APPLE_BINNED_GBPS[(chip, cpu_cores)], f"Apple specification ({chip}, {cpu_cores}-core CPU)"
    if chip in APPLE_BANDWIDTH_GBPS:
        return float(APPLE_BANDWIDTH_GBPS[chip]), f"Apple specification ({chip})"
    return None


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def cpu_label() -> str:
    if sys.platform == "darwin":
        brand = _sysctl("machdep.cpu.brand_string")
        if brand:
            return brand
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """Cores this process may use (the affinity mask on Linux, all logical CPUs elsewhere)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def memory_bytes() -> int:
    if sys.platform == "darwin":
        value = _sysctl("hw.memsize")
        if value and value.isdigit():
            return int(value)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_label() -> str | None:
    """The MLX GPU's name (Metal/CUDA), None on the CPU backend."""
    from ..engine.backend import backend, hardware_label

    return hardware_label() if backend() == "metal" else (_cuda_name() if backend() == "cuda" else None)


def _cuda_name() -> str | None:
    try:
        import mlx.core as mx

        return str(mx.device_info().get("device_name")) or None
    except Exception:  # noqa: BLE001 - device_info differs between MLX builds
        return None


def probe_read_bandwidth(size_mb: int = 256, repeats: int = 5, threads: int | None = None) -> float:
    """Measured read bandwidth in GB/s: ``threads`` threads (default: every core) each OR-reduce a slice of a
    ``size_mb`` buffer, as decode streams its weights (NumPy releases the GIL in reductions); best of N."""
    import threading

    import numpy as np

    threads = threads or cpu_cores()
    n = size_mb * (1 << 20) // 8
    buf = np.ones(n, dtype=np.uint64)  # written once, so every page is resident before timing
    bounds = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def part(lo: int, hi: int) -> None:
        np.bitwise_or.reduce(buf[lo:hi])

    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms the threads and the TLB
        workers = [threading.Thread(target=part, args=b) for b in bounds]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def _cache_file() -> Path:
    from ..sources.gguf_import import cache_root

    return cache_root() / "bench" / "bandwidth.json"


def machine_key(label: str, cores: int, memory: int) -> str:
    return f"{label}|{cores}|{memory // (1 << 20)}MiB|v{PROBE_VERSION}"


def probe_device_bandwidth(size_mb: int = 512, repeats: int = 5) -> float:
    """Measured copy bandwidth of MLX's default device in GB/s (for GPUs: their own memory, not the host's):
    ``x * 1`` reads and writes every byte once; synchronised, best of N."""
    import mlx.core as mx

    x = mx.ones((size_mb * (1 << 20) // 4,), dtype=mx.float32)
    mx.eval(x)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass allocates the output
        mx.synchronize()
        t = time.perf_counter()
        y = x * 1
        mx.eval(y)
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
        del y
    return 2 * x.nbytes / best / 1e9


_PROBES = {
    "cpu": (probe_read_bandwidth, "NumPy read of 256 MiB on {cores} threads, best of 5"),
    "gpu": (probe_device_bandwidth, "MLX copy of 512 MiB on the GPU, best of 5"),
}


def load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_loaded(load: float | None, cores: int) -> bool:
    """Whether other work would slow a probe: more than one busy thread (this process) plus a quarter of the
    cores, on the 1-minute load average."""
    return load is not None and load > 1 + LOADED_PER_CORE * cores


def measured_bandwidth(label: str, cores: int, memory: int, *, device: str = "cpu", refresh: bool = False,
                       load: float | None = None) -> tuple[float, str, bool]:
    """(GB/s, source, cached) for ``device`` ("cpu" or "gpu"): the cached probe, or a new probe when there is
    none or ``refresh``. A probe taken while the machine is loaded (``load``: default the current 1-minute load
    average) is used for this run only, never cached; the cache keeps the highest unloaded measurement."""
    path, key = _cache_file(), machine_key(label, cores, memory) + ("" if device == "cpu" else f"|{device}")
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    cached = cached if isinstance(cached, dict) else {}
    entry = cached.get(key) if isinstance(cached.get(key), dict) else None
    if entry and not refresh:
        return float(entry["gbps"]), f"measured probe, cached {entry['when']} ({entry['method']})", True
    load = load_average() if load is None else load
    probe, method = _PROBES[device]
    gbps, method = probe(), method.format(cores=cores)
    if machine_loaded(load, cores):
        return gbps, (f"measured probe now ({method}); not cached: the machine was loaded "
                      f"(load average {load} on {cores} cores), so this may be low"), False
    best = max(gbps, float(entry["gbps"])) if entry else gbps
    if best == gbps:
        cached[key] = {"gbps": gbps, "when": time.strftime("%Y-%m-%d"), "method": method, "load_avg_1m": load}
        try:
            atomic_write_text(path, json.dumps(cached, indent=1))
        except OSError:
            pass  # an unwritable cache only means probing again next time
    return best, f"measured probe ({method}), load average {load}", True


def remeasure_if_exceeded(hw: dict, achieved_gbps: float) -> bool:
    """When a run read faster than a probed peak, the probe was wrong (taken on a busy machine): probe again and
    raise ``hw``'s peak in place (the cache too, when the machine is quiet). True when the peak changed."""
    peak = hw.get("bandwidth_gbps")
    if hw.get("bandwidth_method") != "probe" or not peak or achieved_gbps <= peak:
        return False
    hw["bandwidth_method"] = "probe (re-measured)"  # once per run: a third probe would measure the same machine
    from ..engine.backend import backend

    on_gpu = backend() in ("metal", "cuda")
    label = (hw.get("gpu") or hw["chip"]) if on_gpu else hw["chip"]
    gbps, source, _ = measured_bandwidth(label, hw["cpu_cores"], hw["memory_bytes"],
                                         device="gpu" if on_gpu else "cpu", refresh=True)
    if gbps <= peak:
        return False
    hw.update(bandwidth_gbps=gbps, bandwidth_source=(
        f"{source}; re-measured because a run read {achieved_gbps:.1f} GB/s, above the earlier {peak:.1f} GB/s"))
    return True


def hardware_info(*, bandwidth_gbps: float | None = None, probe: bool = True) -> dict:
    """Everything a record says about the machine. ``bandwidth_gbps`` overrides the table/probe."""
    from ..engine.backend import backend, hardware_label

    cpu, cores, memory = cpu_label(), cpu_cores(), memory_bytes()
    chip = hardware_label() if backend() == "metal" else cpu
    info = {"chip": chip, "cpu": cpu, "gpu": gpu_label(), "cpu_cores": cores, "memory_bytes": memory,
            "bandwidth_gbps": None, "bandwidth_source": "unknown", "bandwidth_method": None}
    if bandwidth_gbps is not None:
        info.update(bandwidth_gbps=float(bandwidth_gbps), bandwidth_source="given with --bandwidth",
                    bandwidth_method="given")
        return info
    found = apple_bandwidth(chip, _apple_cpu_cores() or cores) if sys.platform == "darwin" else None
    if found is None and probe:
        # Decode streams weights from the memory of the device MLX computes on: probe that one.
        on_gpu = backend() in ("metal", "cuda")
        label = (info["gpu"] or chip) if on_gpu else chip
        device = "gpu" if on_gpu else "cpu"
        gbps, source, _ = measured_bandwidth(label, cores, memory, device=device)
        info.update(bandwidth_gbps=gbps, bandwidth_source=source, bandwidth_method="probe")
        return info
    if found:
        info.update(bandwidth_gbps=found[0], bandwidth_source=found[1], bandwidth_method="specification")
    return info


def _apple_cpu_cores() -> int | None:
    value = _sysctl("hw.physicalcpu")
    return int(value) if value and value.isdigit() else None


def os_info() -> dict:
    return {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "platform": platform.platform(), "python": platform.python_version()}
