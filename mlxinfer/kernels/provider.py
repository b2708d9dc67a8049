"""The kernel-provider contract shared by the Metal/CUDA kernels and the native CPU kernels.

A provider offers faster versions of the two operations that dominate decoding. Every method may return
``None`` to say "this shape/dtype is not mine": ``kernels.patch`` then calls the MLX built-in instead, so a
provider only needs to cover the cases it is good at.

Required methods: ``quantized_matmul`` and ``sdpa``. Optional methods (looked up with ``getattr``, so CPU
providers may leave them out): ``quantized_sdpa`` (attention over mlx-lm's ``QuantizedKVCache``),
``swiglu`` (the fused ``silu(x·Wg) * (x·Wu)`` decode step), ``rms_norm``, ``rope``, ``quantized_embedding``
(the embedding lookup), ``qkv_rope`` (an attention block's projections, head split and RoPE as one op) and
``decoder_block`` with ``block_config``/``kv_reserve``/``array_id``/``array_handle`` (a whole llama layer as one
op that writes the KV cache in place; its contract is in ``kernels.fused_block``).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple, runtime_checkable

import mlx.core as mx

Mask = Any  # None | "causal" | mx.array (bool or additive), as in mx.fast.scaled_dot_product_attention
QuantTriple = Tuple[mx.array, mx.array, mx.array]  # (packed uint32, scales, biases), mlx-lm's layout


@runtime_checkable
class KernelProvider(Protocol):
    name: str  # "metal-custom" | "cuda-custom" | "cpu-native"

    def quantized_matmul(
        self, x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], *,
        group_size: int, bits: int, mode: str = "affine",
    ) -> Optional[mx.array]:
        """Same meaning as ``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)``: x (..., K) times
        the quantized (N, K) weight -> (..., N). Return None when this shape/dtype is not supported."""
        ...

    def sdpa(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Mask) -> Optional[mx.array]:
        """Same meaning as ``mx.fast.scaled_dot_product_attention``: q (B, n_heads, L, D), k/v
        (B, n_kv_heads, S, D), mask None | "causal" | array. Return None when not supported."""
        ...


class OptionalKernels(Protocol):
    """Methods a provider may add; ``kernels.patch`` uses them only when present."""

    def quantized_sdpa(
        self, q: mx.array, k: QuantTriple, v: QuantTriple, *, scale: float, mask: Mask, group_size: int, bits: int,
    ) -> Optional[mx.array]:
        """Same meaning as mlx-lm's ``quantized_scaled_dot_product_attention``: q (B, n_heads, L, D); k/v are
        ``QuantizedKVCache`` triples (B, n_kv_heads, S, D*bits/32) uint32 + (B, n_kv_heads, S, D/group) scales
        and biases. Return None when not supported."""
        ...

    def swiglu(
        self, x: mx.array, gate: QuantTriple, up: QuantTriple, *, group_size: int, bits: int,
    ) -> Optional[mx.array]:
        """``silu(x @ Wg.T) * (x @ Wu.T)`` with both weights quantized (N, K): x (..., K) -> (..., N).
        Return None when not supported."""
        ...

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> Optional[mx.array]:
        """Same as ``mx.fast.rms_norm(x, weight, eps)``. Return None when not supported."""
        ...

    def rope(
        self, x: mx.array, dims: int, *, traditional: bool, base: Optional[float], scale: float, offset: int,
    ) -> Optional[mx.array]:
        """Same as ``mx.fast.rope(x, dims, traditional=..., base=..., scale=..., offset=...)`` for x
        (..., L, D). Return None when not supported."""
        ...

    def quantized_embedding(
        self, ids: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], *, group_size: int,
        bits: int, mode: str = "affine",
    ) -> Optional[mx.array]:
        """Same as ``nn.QuantizedEmbedding.__call__``: ``mx.dequantize`` of the rows ``ids`` picks, ids (...) ->
        (..., dim). Return None when not supported."""
        ...

    def qkv_rope(
        self, x: mx.array, q: QuantTriple, k: QuantTriple, v: QuantTriple, *, group_size: int, bits: int,
        n_heads: int, n_kv_heads: int, head_dim: int, rope_dims: int, traditional: bool, base: Optional[float],
        scale: float, offset: int, freqs: Optional[mx.array] = None,
    ) -> Optional[Tuple[mx.array, mx.array, mx.array]]:
        """mlx-lm's attention input side: ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` (quantized, no bias) for x
        (B, L, hidden), reshaped to (B, heads, L, head_dim) and ``mx.fast.rope``'d (q and k) at ``offset``.
        Returns (q, k, v) or None when not supported. It may be asked to RMS-normalise x first
        (``norm_weight=``, ``norm_eps=``; ``swiglu`` takes the same two), and a provider with ``qkv_rope`` also
        takes ``quantized_matmul(..., residual=r)`` (+ r, a skip connection),
        ``sdpa(..., heads_last=True, kv_len=n)``, which returns (B, L, n_heads * D) over the first n (all when -1)
        keys (or None to decline), and ``kv_append(k_buf, v_buf, k, v, offset)`` (mlx-lm's KVCache update)."""
        ...


def describe(provider: Optional[KernelProvider]) -> str:
    """One word for logs and reports: the provider's name, or "builtin" when there is none."""
    return provider.name if provider is not None else "builtin"
