"""Kernel micro-benchmark: custom provider vs MLX built-in at the decode shapes of 1B–8B models.

``run_microbench()`` returns ``BenchRow``s (no printing: ``scripts/kernel_bench.py`` and the CLI format them).
Works on any backend: on Metal/CUDA it times mlxinfer's kernels, on the CPU the native provider when it is built;
without a provider only the built-in column is filled.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.kernels.patch import backend, select_provider
from mlxinfer.kernels.provider import FusedMLP, QuantizedAttention

# name: (hidden, intermediate, q heads, kv heads, head dim)
MODELS = {
    "llama-3.2-1b": (2048, 8192, 32, 8, 64),
    "llama-3.2-3b": (3072, 8192, 24, 8, 128),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128),
}


@dataclass
class BenchRow:
    kernel: str  # "qmv" | "swiglu" | "sdpa" | "sdpa-q8"
    shape: str
    dtype: str
    builtin_us: Optional[float]  # None: MLX has no built-in for this shape on this backend (e.g. CUDA, q8 attention)
    custom_us: Optional[float]  # None: no provider, or the provider declined this shape
    max_abs_err: Optional[float]

    @property
    def speedup(self) -> Optional[float]:
        return None if self.custom_us is None or self.builtin_us is None else self.builtin_us / self.custom_us


def time_us(fn: Callable[[], mx.array], *, repeat: int = 10, warmup: int = 3, batch: int = 8) -> float:
    """Median microseconds per call; ``batch`` calls per evaluation so launch/sync overhead is shared."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(batch)])
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        samples.append((time.perf_counter() - t0) / batch * 1e6)
    samples.sort()
    return samples[len(samples) // 2]


def _row(kernel, shape, dtype, builtin, custom, repeat) -> BenchRow:
    try:
        want = builtin()
        mx.eval(want)
    except RuntimeError:  # MLX lacks this shape on this backend ("No implementation for problem shape")
        want = None
    got = custom() if custom is not None else None
    builtin_us = None if want is None else time_us(builtin, repeat=repeat)
    if got is None:
        return BenchRow(kernel, shape, str(dtype).split(".")[-1], builtin_us, None, None)
    err = None if want is None else mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return BenchRow(kernel, shape, str(dtype).split(".")[-1], builtin_us, time_us(custom, repeat=repeat), err)


def _quantized(n, k, dtype, gs, bits):
    return mx.quantize(mx.random.normal((n, k)).astype(dtype) * 0.02, group_size=gs, bits=bits)


def matmul_rows(provider, hidden, inter, hq, hkv, d, dtype, m, gs, bits, repeat) -> Iterable[BenchRow]:
    x = mx.random.normal((m, hidden)).astype(dtype)
    xi = mx.random.normal((m, inter)).astype(dtype)
    for name, n, inp in (("q/o", hq * d, x), ("k/v", hkv * d, x), ("gate/up", inter, x), ("down", hidden, xi)):
        w = _quantized(n, inp.shape[-1], dtype, gs, bits)
        mx.eval(w)
        builtin = lambda inp=inp, w=w: mx.quantized_matmul(inp, *w, transpose=True, group_size=gs, bits=bits)
        custom = None
        if provider is not None:
            custom = lambda inp=inp, w=w: provider.quantized_matmul(inp, *w, group_size=gs, bits=bits)
        yield _row("qmv", f"{name} M={m} {n}x{inp.shape[-1]} {bits}b/g{gs}", dtype, builtin, custom, repeat)
    gate, up = _quantized(inter, hidden, dtype, gs, bits), _quantized(inter, hidden, dtype, gs, bits)
    mx.eval(gate, up)

    def builtin_swiglu():
        g = mx.quantized_matmul(x, *gate, transpose=True, group_size=gs, bits=bits)
        return nn.silu(g) * mx.quantized_matmul(x, *up, transpose=True, group_size=gs, bits=bits)

    custom = None
    if isinstance(provider, FusedMLP):
        custom = lambda: provider.swiglu(x, gate, up, group_size=gs, bits=bits)  # noqa: E731
    yield _row("swiglu", f"M={m} 2x{inter}x{hidden} {bits}b/g{gs}", dtype, builtin_swiglu, custom, repeat)


def attention_rows(provider, hq, hkv, d, dtype, contexts, repeat) -> Iterable[BenchRow]:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    q = mx.random.normal((1, hq, 1, d)).astype(dtype)
    for s in contexts:
        cap = (s + 255) // 256 * 256
        kc, vc = (mx.random.normal((1, hkv, cap, d)).astype(dtype) for _ in range(2))
        k, v = kc[:, :, :s], vc[:, :, :s]  # strided slices, as mlx-lm's KVCache returns them
        mx.eval(kc, vc)
        scale = d ** -0.5
        builtin = lambda k=k, v=v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)
        custom = None if provider is None else (lambda k=k, v=v: provider.sdpa(q, k, v, scale=scale, mask=None))
        yield _row("sdpa", f"Hq={hq} Hkv={hkv} D={d} S={s}", dtype, builtin, custom, repeat)
        kt, vt = mx.quantize(k, group_size=64, bits=8), mx.quantize(v, group_size=64, bits=8)
        mx.eval(kt, vt)
        builtin_q = lambda kt=kt, vt=vt: quantized_scaled_dot_product_attention(
            q, kt, vt, scale=scale, mask=None, group_size=64, bits=8)
        custom_q = None
        if isinstance(provider, QuantizedAttention):
            custom_q = lambda kt=kt, vt=vt: provider.quantized_sdpa(  # noqa: E731
                q, kt, vt, scale=scale, mask=None, group_size=64, bits=8)
        yield _row("sdpa-q8", f"Hq={hq} Hkv={hkv} D={d} S={s}", dtype, builtin_q, custom_q, repeat)


def run_microbench(models: Iterable[str] = tuple(MODELS), *, dtype=None, rows=(1, 4), contexts=(512, 4096, 16384),
                   group_size: int = 64, bits: int = 4, repeat: int = 10,
                   progress: Callable[[BenchRow], None] = lambda row: None) -> List[BenchRow]:
    """Time every kernel at each model's decode shapes; ``progress`` is called after each row."""
    provider, _ = select_provider()
    if dtype is None:  # the loader's policy: float32 activations on the CPU, float16 on GPUs
        dtype = mx.float32 if backend() == "cpu" else mx.float16
    mx.random.seed(0)
    out: List[BenchRow] = []
    for name in models:
        hidden, inter, hq, hkv, d = MODELS[name]
        gens = [matmul_rows(provider, hidden, inter, hq, hkv, d, dtype, m, group_size, bits, repeat) for m in rows]
        gens.append(attention_rows(provider, hq, hkv, d, dtype, contexts, repeat))
        for row in itertools.chain(*gens):
            row.shape = f"{name}: {row.shape}"
            out.append(row)
            progress(row)
    return out


def provider_name() -> str:
    provider, why = select_provider()
    return provider.name if provider is not None else f"builtin ({why})"


def markdown(rows: List[BenchRow]) -> str:
    lines = ["| kernel | shape | dtype | built-in µs | custom µs | speedup | max abs err |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        builtin = "—" if r.builtin_us is None else f"{r.builtin_us:.1f}"
        custom = "—" if r.custom_us is None else f"{r.custom_us:.1f}"
        speed = "—" if r.speedup is None else f"{r.speedup:.2f}×"
        err = "—" if r.max_abs_err is None else f"{r.max_abs_err:.2g}"
        lines.append(f"| {r.kernel} | {r.shape} | {r.dtype} | {builtin} | {custom} | {speed} | {err} |")
    return "\n".join(lines)


@dataclass
class ParityResult:
    kernels: str  # the provider that ran in the custom pass
    builtin_tokens: List[int]
    custom_tokens: List[int]
    max_logprob_diff: float

    @property
    def equal(self) -> bool:
        return self.builtin_tokens == self.custom_tokens


def model_parity(model: Optional[str] = None, *, prompt: str = "The capital of France is", max_tokens: int = 8,
                 emulate: Optional[str] = None) -> ParityResult:
    """Greedy-decode ``model`` (default: the bundled one) with MLX's built-ins, then with the custom kernels, and
    compare. ``emulate="metal"|"cuda"`` runs the kernels on the CPU emulator instead (slow: for CI-less checks)."""
    from mlx_lm.generate import generate_step

    from mlxinfer.engine.loader import load
    from mlxinfer.kernels import patch

    loaded = load(model, kernels="builtin")
    ids = mx.array(loaded.tokenizer.encode(prompt))

    def decode():
        steps = list(generate_step(ids, loaded.model, max_tokens=max_tokens))
        return [int(t) for t, _ in steps], [lp.astype(mx.float32) for _, lp in steps]

    want, want_lp = decode()
    provider = None
    if emulate is not None:
        from mlxinfer.kernels.emulator import Emulator
        from mlxinfer.kernels.gpu import GpuKernels

        provider = GpuKernels("metal", run=Emulator(emulate), name=f"{emulate}-emulated")
    original = patch.select_provider
    if provider is not None:
        patch.select_provider = lambda name=None: (provider, "emulated on the CPU")
    try:
        report = patch.apply_kernels(loaded.model, "custom")
        got, got_lp = decode()
    finally:
        patch.select_provider = original
        patch.apply_kernels(loaded.model, "builtin")
    diff = max((mx.abs(a - b).max().item() for a, b in zip(want_lp, got_lp)), default=0.0)
    return ParityResult(report.name, want, got, diff)
