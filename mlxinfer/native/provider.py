"""The "cpu-native" KernelProvider over the ``_mlxinfer_cpu`` extension (see ``mlxinfer.kernels.provider``)."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import mlx.core as mx

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


class NativeCpuProvider:
    name = "cpu-native"

    def __init__(self, ext: ModuleType):
        self._ext = ext

    def quantized_matmul(self, x, w, scales, biases, *, group_size: int, bits: int,
                         mode: str = "affine") -> Optional[mx.array]:
        # The kernels cover MLX's affine 4/8-bit format; anything else goes back to the built-in.
        if (
            mode != "affine" or biases is None or bits not in (4, 8) or group_size not in (32, 64, 128)
            or w.dtype != mx.uint32 or w.ndim != 2 or x.ndim < 1
            or x.dtype not in _FLOATS or scales.dtype not in _FLOATS or biases.dtype != scales.dtype
            or x.shape[-1] != w.shape[1] * 32 // bits
        ):
            return None
        # (..., K) x (N, K)^T -> (..., N)
        return self._ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)

    def sdpa(self, q, k, v, *, scale: float, mask) -> Optional[mx.array]:
        return None
