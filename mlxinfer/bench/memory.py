"""Will a benchmark fit in memory? KV-cache bytes per token from the model config, times the tokens every case
holds at once, plus the weights, against the memory available now: refused before anything is allocated
(``bench -b 100000`` used to be ended by the OOM killer, minutes in)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import InvalidParameter
from .workload import Case

KV_STEP = 256      # mlx-lm's KVCache grows in steps of this many tokens
OVERHEAD = 1.10    # activations, logits and allocator slack on top of weights + cache


def available_memory() -> tuple[int, str] | None:
    """(bytes, where from) that a new allocation can use now, or None when the system does not say. Linux:
    MemAvailable, or the cgroup's limit minus its usage when that is lower; macOS: the unified memory size."""
    if sys.platform == "darwin":
        from .hardware import _sysctl

        value = _sysctl("hw.memsize")
        if value and value.isdigit():
            return int(value), "hw.memsize"
    found: tuple[int, str] | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024, "MemAvailable"
                    break
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_room()
    if cgroup is not None and (found is None or cgroup < found[0]):
        found = cgroup, "the cgroup's memory.max"
    if found is None:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else \
                os.sysconf("SC_PHYS_PAGES")
            found = pages * os.sysconf("SC_PAGE_SIZE"), "sysconf"
        except (ValueError, OSError, AttributeError):
            return None
    return found


def _cgroup_room() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def _text_config(config: dict) -> dict:
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int | None:
    """K and V of every layer for one token of one sequence; None when the config does not say enough."""
    c = _text_config(config)
    layers = c.get("num_hidden_layers") or c.get("n_layer") or c.get("num_layers")
    heads = c.get("num_attention_heads") or c.get("n_head")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c.get("hidden_size") // heads if c.get("hidden_size") and heads else None)
    values = (layers, kv_heads, head_dim)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def weight_bytes(path: Path, config: dict, on_cpu: bool) -> int:
    """Bytes the weights take once loaded: the safetensors files, doubled for 16-bit unquantized weights on the
    CPU backend (they are cast to float32 there, see engine.backend.activation_dtype)."""
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    sixteen_bit = str(_text_config(config).get("torch_dtype") or "").lower() in ("float16", "bfloat16")
    return size * 2 if on_cpu and sixteen_bit and not config.get("quantization") else size


def case_tokens(case: Case) -> int:
    """Tokens of KV cache a case holds at its peak (every sequence of a batch, rounded up to mlx-lm's step)."""
    per_sequence = -(-case.context_needed() // KV_STEP) * KV_STEP
    return per_sequence * case.batch


def gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_memory(name: str, path: Path, config: dict, cases: list[Case], *, on_cpu: bool,
                 available: tuple[int, str] | None = None) -> int | None:
    """Refuse (one line, with the estimate) when the most demanding case cannot fit in the memory available;
    returns the estimated peak in bytes (None when the config gives no KV-cache size)."""
    c = _text_config(config)
    dtype_bytes = 4 if on_cpu or str(c.get("torch_dtype") or "").lower() == "float32" else 2
    per_token = kv_bytes_per_token(config, dtype_bytes)
    if per_token is None or not cases:
        return None
    worst = max(cases, key=case_tokens)
    kv = per_token * case_tokens(worst)
    weights = weight_bytes(path, config, on_cpu)
    need = int((kv + weights) * OVERHEAD)
    available = available if available is not None else available_memory()
    if available is not None and need > available[0]:
        raise InvalidParameter(
            f"{worst.label} on {name} needs ~{gb(kv)} of KV cache + {gb(weights)} of weights, "
            f"{gb(available[0])} available",
            hint="lower -b, -p, -n or -d",
        )
    return need
