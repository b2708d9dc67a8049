"""The Metal and CUDA kernel providers: mlxinfer's kernel bodies run through ``mx.fast.metal_kernel`` or
``mx.fast.cuda_kernel`` (same bodies; ``compat_cuda.h`` maps Metal's vocabulary to CUDA, a warp being a 32-lane
simdgroup). Each method checks the call against what the kernels cover and returns None otherwise, so the
caller falls back to MLX's built-in."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from mlxinfer.kernels import ops
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


@functools.lru_cache(maxsize=None)
def _probe(backend: str):
    """(provider or None, one-line status). Builds the kernel objects once per process."""
    if backend not in _NAMES:
        return None, f"no custom kernels for the {backend} backend"
    if not _available(backend):
        return None, f"{backend} is not available in this MLX build"
    try:
        for name in ("qmv", "swiglu", "sdpa_decode", "sdpa_quant", "sdpa_reduce"):
            get_kernel(name, backend)
    except (OSError, RuntimeError, ValueError) as exc:  # a broken install: missing .metal files
        return None, f"{backend} kernels could not be built: {exc}"
    return GpuKernels(backend), f"{_NAMES[backend]} kernels ready"


def provider(backend: str) -> Optional[GpuKernels]:
    return _probe(backend)[0]


def status(backend: str) -> str:
    return _probe(backend)[1]
