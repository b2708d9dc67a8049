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

    @staticmethod
    def _supported(x, w, scales, biases, group_size, bits, mode) -> bool:
        # The kernels cover MLX's affine 4/8-bit format; anything else goes back to the built-in.
        return not (
            mode != "affine" or biases is None or bits not in (4, 8) or group_size not in (32, 64, 128)
            or w.dtype != mx.uint32 or w.ndim != 2 or x.ndim < 1
            or x.dtype not in _FLOATS or scales.dtype not in _FLOATS or biases.dtype != scales.dtype
            or x.shape[-1] != w.shape[1] * 32 // bits or scales.shape != (w.shape[0], x.shape[-1] // group_size)
        )

    def quantized_matmul(self, x, w, scales, biases, *, group_size: int, bits: int,
                         mode: str = "affine") -> Optional[mx.array]:
        if not self._supported(x, w, scales, biases, group_size, bits, mode):
            return None
        # (..., K) x (N, K)^T -> (..., N)
        return self._ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)

    def swiglu(self, x, gate, up, *, group_size: int, bits: int) -> Optional[mx.array]:
        """silu(x @ Wg.T) * (x @ Wu.T) in one primitive: both matvecs share one pass over x and one pool job."""
        (wg, sg, bg), (wu, su, bu) = gate, up
        if not all(
            self._supported(x, w, s, b, group_size, bits, "affine") for w, s, b in ((wg, sg, bg), (wu, su, bu))
        ) or wg.shape != wu.shape or sg.dtype != su.dtype:
            return None
        # (..., K) -> (..., N)
        return self._ext.swiglu(x, wg, sg, bg, wu, su, bu, group_size=group_size, bits=bits)

    # Optional extras beyond the KernelProvider contract: MLX's CPU build runs mx.fast.rms_norm and
    # mx.fast.rope as chains of generic ops (~50 and ~75 us per decode call on SmolLM2), 8 ms of a 28 ms token.
    def rms_norm(self, x, weight, eps: float) -> Optional[mx.array]:
        """Same as ``mx.fast.rms_norm(x, weight, eps)``; float32 with a (D,) weight only."""
        if x.dtype != mx.float32 or weight is None or weight.dtype != mx.float32 or weight.shape != (x.shape[-1],):
            return None
        return self._ext.rms_norm(x, weight, eps=float(eps))

    def rope(self, x, dims: int, *, traditional: bool, base: Optional[float], scale: float, offset,
             freqs=None) -> Optional[mx.array]:
        """Same as ``mx.fast.rope``; float32 x (..., L, D), an int offset, no custom freqs."""
        if (
            freqs is not None or base is None or not isinstance(offset, int) or x.dtype != mx.float32
            or x.ndim < 2 or dims % 2 or dims > x.shape[-1]
        ):
            return None
        return self._ext.rope(x, dims=dims, traditional=traditional, base=float(base), scale=float(scale),
                              offset=offset)

    def quantized_embedding(self, ids, w, scales, biases, *, group_size: int, bits: int,
                            mode: str = "affine") -> Optional[mx.array]:
        """``nn.QuantizedEmbedding``'s lookup (3 gathers + dequantize in MLX, ~30 CPU ops) as one op."""
        if (
            mode != "affine" or biases is None or bits not in (4, 8) or group_size not in (32, 64, 128)
            or scales.dtype != mx.float32 or biases.dtype != mx.float32 or w.dtype != mx.uint32 or w.ndim != 2
            or ids.dtype not in (mx.int32, mx.uint32, mx.int64, mx.uint64)
        ):
            return None
        # ids (...) -> (..., dim)
        return self._ext.quantized_embedding(ids, w, scales, biases, group_size=group_size, bits=bits)

    def qkv_rope(self, x, q, k, v, *, group_size: int, bits: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_dims: int, traditional: bool, base: Optional[float], scale: float, offset):
        """The three projections, head split and RoPE as one op (11 MLX ops per decode step otherwise)."""
        if (
            x.ndim != 3 or x.dtype != mx.float32 or base is None or not isinstance(offset, int)
            or rope_dims % 2 or rope_dims > head_dim
            or not all(self._supported(x, w, s, b, group_size, bits, "affine") and s.dtype == mx.float32
                       for w, s, b in (q, k, v))
            or q[0].shape[0] != n_heads * head_dim or k[0].shape[0] != n_kv_heads * head_dim
            or v[0].shape[0] != n_kv_heads * head_dim
        ):
            return None
        # x (B, L, hidden) -> q (B, n_heads, L, head_dim), k and v (B, n_kv_heads, L, head_dim)
        out = self._ext.qkv_rope(
            x, list(q), list(k), list(v), group_size=group_size, bits=bits, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, rope_dims=rope_dims, traditional=traditional, base=float(base), scale=float(scale),
            offset=offset,
        )
        return tuple(out)

    def sdpa(self, q, k, v, *, scale: float, mask) -> Optional[mx.array]:
        # float32 (the CPU dtype policy) with no mask or a causal one; array masks go to the built-in.
        if mask is not None and not (isinstance(mask, str) and mask == "causal"):
            return None
        if not all(a.ndim == 4 and a.dtype == mx.float32 for a in (q, k, v)):
            return None
        if k.shape != v.shape or q.shape[1] % k.shape[1] or q.shape[-1] > 1024 or q.shape[2] > k.shape[2]:
            return None
        # q (B, n_heads, L, D), k/v (B, n_kv_heads, S, D) -> (B, n_heads, L, D)
        return self._ext.sdpa(q, k, v, scale=float(scale), causal=mask is not None and q.shape[2] > 1)
