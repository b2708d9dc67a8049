"""The Metal and CUDA kernel providers: mlxinfer's kernel bodies run through ``mx.fast.metal_kernel`` or
``mx.fast.cuda_kernel`` (same bodies; ``compat_cuda.h`` maps Metal's vocabulary to CUDA, a warp being a 32-lane
simdgroup). Each method checks the call against what the kernels cover and returns None otherwise, so the
caller falls back to MLX's built-in."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from mlxinfer.kernels import ops, reference
from mlxinfer.kernels.build import Runner, get_kernel, gpu_runner

_NAMES = {"metal": "metal-custom", "cuda": "cuda-custom"}


class GpuKernels:
    """KernelProvider (plus the optional ``quantized_sdpa`` and ``swiglu``) for "metal" or "cuda"."""

    def __init__(self, backend: str, run: Optional[Runner] = None, name: Optional[str] = None):
        self.backend = backend
        self.name = name or _NAMES[backend]
        self._run = run or gpu_runner(backend)  # tests pass the CPU emulator here

    def quantized_matmul(self, x, w, scales, biases, *, group_size: int, bits: int,
                         mode: str = "affine") -> Optional[mx.array]:
        if ops.qmm_unsupported(x, w, scales, biases, group_size, bits, mode):
            return None
        return ops.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits, run=self._run)

    def swiglu(self, x, gate, up, *, group_size: int, bits: int) -> Optional[mx.array]:
        if ops.swiglu_unsupported(x, gate, up, group_size, bits):
            return None
        return ops.swiglu(x, gate, up, group_size=group_size, bits=bits, run=self._run)

    def sdpa(self, q, k, v, *, scale: float, mask) -> Optional[mx.array]:
        if ops.sdpa_unsupported(q, k, v, mask):
            return None
        return ops.sdpa(q, k, v, scale=scale, mask=mask, run=self._run)

    def quantized_sdpa(self, q, k, v, *, scale: float, mask, group_size: int, bits: int) -> Optional[mx.array]:
        if ops.quantized_sdpa_unsupported(q, k, v, mask, group_size, bits):
            return None
        return ops.quantized_sdpa(q, k, v, scale=scale, mask=mask, group_size=group_size, bits=bits, run=self._run)


def _available(backend: str) -> bool:
    return mx.metal.is_available() if backend == "metal" else mx.cuda.is_available()


def self_test(run: Runner, dtype=mx.float16) -> Optional[str]:
    """Run every kernel once on small shapes against its float32 twin: None if all agree, else what failed.

    Kernel source compiles lazily on first use, so this is where a compile error (or a wrong result on an untested
    GPU) shows up — at provider creation, where "auto" can still fall back to MLX — instead of mid-generation."""
    keys = iter(mx.random.split(mx.random.key(7), 8))

    def rand(*shape):
        return mx.random.normal(shape, key=next(keys)).astype(dtype)

    x, w1, w2 = rand(2, 128), rand(24, 128), rand(24, 128)
    g, u = (mx.quantize(w, group_size=64, bits=4) for w in (w1, w2))
    q, k, v = rand(1, 4, 1, 64), rand(1, 2, 300, 64), rand(1, 2, 300, 64)
    kq, vq = (mx.quantize(t, group_size=64, bits=8) for t in (k, v))
    checks = {
        "qmv": (lambda: ops.quantized_matmul(x, *g, group_size=64, bits=4, run=run),
                lambda: reference.quantized_matmul(x, *g, group_size=64, bits=4)),
        "swiglu": (lambda: ops.swiglu(x, g, u, group_size=64, bits=4, run=run),
                   lambda: reference.swiglu(x, g, u, group_size=64, bits=4)),
        "sdpa": (lambda: ops.sdpa(q, k, v, scale=0.125, mask=None, run=run, nsplit=1),
                 lambda: reference.sdpa(q, k, v, scale=0.125, mask=None)),
        "sdpa split-K": (lambda: ops.sdpa(q, k, v, scale=0.125, mask=None, run=run, nsplit=3),
                         lambda: reference.sdpa(q, k, v, scale=0.125, mask=None)),
        "quantized sdpa": (
            lambda: ops.quantized_sdpa(q, kq, vq, scale=0.125, mask=None, group_size=64, bits=8, run=run),
            lambda: reference.quantized_sdpa(q, kq, vq, scale=0.125, mask=None, group_size=64, bits=8)),
    }
    failures = []
    for name, (kernel, twin) in checks.items():
        try:
            got, want = kernel().astype(mx.float32), twin().astype(mx.float32)
            err = mx.abs(got - want).max().item() / max(1.0, mx.abs(want).max().item())
        except Exception as exc:  # noqa: BLE001 - a Metal/NVRTC compile error surfaces as a RuntimeError here
            failures.append(f"{name}: {str(exc).splitlines()[0][:200]}")
            continue
        if not err < 1e-2:  # also catches NaN
            failures.append(f"{name}: wrong result (error {err:.3g})")
    return "; ".join(failures) or None


@functools.lru_cache(maxsize=None)
def _probe(backend: str):
    """(provider or None, one-line status). Builds and self-tests the kernels once per process."""
    if backend not in _NAMES:
        return None, f"no custom kernels for the {backend} backend"
    if not _available(backend):
        return None, f"{backend} is not available in this MLX build"
    try:
        for name in ("qmv", "swiglu", "sdpa_decode", "sdpa_quant", "sdpa_reduce"):
            get_kernel(name, backend)
    except (OSError, RuntimeError, ValueError) as exc:  # a broken install: missing .metal files
        return None, f"{backend} kernels could not be built: {exc}"
    failure = self_test(gpu_runner(backend))
    if failure is not None:
        return None, f"{_NAMES[backend]} kernels failed their self-test ({failure})"
    return GpuKernels(backend), f"{_NAMES[backend]} kernels ready (self-test passed)"


def provider(backend: str) -> Optional[GpuKernels]:
    return _probe(backend)[0]


def status(backend: str) -> str:
    return _probe(backend)[1]
