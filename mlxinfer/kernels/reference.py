"""Pure-MLX twins of the custom kernels: the same math, in float32, written for clarity instead of speed.

Tests hold each kernel (on the CPU emulator, on CUDA, on Metal) equal to its twin, and the twin equal to MLX's
built-ins, so a disagreement points at either the kernel or at a misunderstanding of MLX's format.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

F32 = mx.float32


def dequantize(w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """(N, K·bits/32) uint32 + (N, K/group_size) scales/biases -> (N, K) float32."""
    return mx.dequantize(w, scales.astype(F32), biases.astype(F32), group_size=group_size, bits=bits)


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """qmv.metal: x (..., K) · Wᵀ accumulated in float32, rounded once to x's dtype."""
    wf = dequantize(w, scales, biases, group_size=group_size, bits=bits)  # (N, K)
    return (x.astype(F32) @ wf.T).astype(x.dtype)


def swiglu(x, gate, up, *, group_size: int, bits: int) -> mx.array:
    """swiglu.metal: silu(x · Wgᵀ) ⊙ (x · Wuᵀ), both products kept in float32 until the end."""
    xf = x.astype(F32)
    g = xf @ dequantize(*gate, group_size=group_size, bits=bits).T
    u = xf @ dequantize(*up, group_size=group_size, bits=bits).T
    return (nn.silu(g) * u).astype(x.dtype)


def sdpa(q, k, v, *, scale: float, mask) -> mx.array:
    """sdpa_decode.metal: q (B, Hq, L, D), k/v (B, Hkv, S, D); GQA by repeating kv heads; "causal" places the
    L queries at the end of the S keys (query t sees keys <= S - L + t)."""
    b, hq, l, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    rep = hq // hkv
    kf = mx.repeat(k.astype(F32), rep, axis=1)  # (B, Hq, S, D)
    vf = mx.repeat(v.astype(F32), rep, axis=1)
    scores = (q.astype(F32) * scale) @ kf.swapaxes(-1, -2)  # (B, Hq, L, S)
    if isinstance(mask, str) and mask == "causal":
        visible = mx.arange(s)[None, :] <= (s - l + mx.arange(l))[:, None]  # (L, S)
        scores = mx.where(visible, scores, -mx.inf)
    elif mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask.astype(F32)
    return (mx.softmax(scores, axis=-1) @ vf).astype(q.dtype)


def quantized_sdpa(q, kt, vt, *, scale: float, mask, group_size: int, bits: int) -> mx.array:
    """sdpa_quant.metal: attention over QuantizedKVCache triples, dequantized to float32 first."""
    k = mx.dequantize(kt[0], kt[1].astype(F32), kt[2].astype(F32), group_size=group_size, bits=bits)
    v = mx.dequantize(vt[0], vt[1].astype(F32), vt[2].astype(F32), group_size=group_size, bits=bits)
    return sdpa(q, k, v, scale=scale, mask=mask)
