"""The kernel-provider contract shared by the Metal/CUDA kernels and the native CPU kernels, as small Protocols.

A provider offers faster versions of the operations that dominate decoding. Every method may return ``None`` to
say "this shape/dtype is not mine": the kernel layers then run the MLX built-in, so a provider only needs to
cover the cases it is good at.

``KernelProvider`` (``quantized_matmul`` and ``sdpa``) is required; each other Protocol below is one optional
capability, used only when the provider has all of its methods with the keyword arguments named in
``_KEYWORDS``. :func:`capabilities` checks that once, when kernels are applied (``kernels.patch``); the layers
then call what they were given without probing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Tuple, runtime_checkable

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


@runtime_checkable
class QuantizedAttention(Protocol):
    def quantized_sdpa(
        self, q: mx.array, k: QuantTriple, v: QuantTriple, *, scale: float, mask: Mask, group_size: int, bits: int,
    ) -> Optional[mx.array]:
        """Same meaning as mlx-lm's ``quantized_scaled_dot_product_attention``: q (B, n_heads, L, D); k/v are
        ``QuantizedKVCache`` triples (B, n_kv_heads, S, D*bits/32) uint32 + (B, n_kv_heads, S, D/group) scales
        and biases. Return None when not supported."""
        ...


@runtime_checkable
class FusedMLP(Protocol):
    def swiglu(
        self, x: mx.array, gate: QuantTriple, up: QuantTriple, *, group_size: int, bits: int,
    ) -> Optional[mx.array]:
        """``silu(x @ Wg.T) * (x @ Wu.T)`` with both weights quantized (N, K): x (..., K) -> (..., N).
        Return None when not supported."""
        ...


@runtime_checkable
class NormKernel(Protocol):
    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> Optional[mx.array]:
        """Same as ``mx.fast.rms_norm(x, weight, eps)``. Return None when not supported."""
        ...


@runtime_checkable
class RopeKernel(Protocol):
    def rope(
        self, x: mx.array, dims: int, *, traditional: bool, base: Optional[float], scale: float, offset: int,
    ) -> Optional[mx.array]:
        """Same as ``mx.fast.rope(x, dims, traditional=..., base=..., scale=..., offset=...)`` for x
        (..., L, D). Return None when not supported."""
        ...


@runtime_checkable
class EmbeddingKernel(Protocol):
    def quantized_embedding(
        self, ids: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], *, group_size: int,
        bits: int, mode: str = "affine",
    ) -> Optional[mx.array]:
        """Same as ``nn.QuantizedEmbedding.__call__``: ``mx.dequantize`` of the rows ``ids`` picks, ids (...) ->
        (..., dim). Return None when not supported."""
        ...


@runtime_checkable
class ExpertKernel(Protocol):
    def gather_qmm(
        self, x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], indices: mx.array, *,
        group_size: int, bits: int, mode: str = "affine",
    ) -> Optional[mx.array]:
        """Same meaning as ``mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True, ...)``: w a
        stack of quantized experts (E, N, K), x (..., M, K) and indices (...) broadcast over their batch dims ->
        (..., M, N), each batch element through its expert (mlx-lm's ``QuantizedSwitchLinear``). Return None when
        not supported."""
        ...


@runtime_checkable
class FusedAttention(Protocol):
    """The attention input side as one op, plus what the fused attention and blocks need around it:
    ``quantized_matmul(..., residual=r)`` (+ r, a skip connection), ``sdpa(..., heads_last=True, kv_len=n)``
    (returns (B, L, n_heads * D) over the first n keys, all when -1) and ``swiglu(..., norm_weight=, norm_eps=)``
    (x RMS-normalised first)."""

    def qkv_rope(
        self, x: mx.array, q: QuantTriple, k: QuantTriple, v: QuantTriple, *, group_size: int, bits: int,
        n_heads: int, n_kv_heads: int, head_dim: int, rope_dims: int, traditional: bool, base: Optional[float],
        scale: float, offset: int, freqs: Optional[mx.array] = None,
    ) -> Optional[Tuple[mx.array, mx.array, mx.array]]:
        """``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` (quantized, no bias) for x (B, L, hidden), reshaped to
        (B, heads, L, head_dim) and ``mx.fast.rope``'d (q and k) at ``offset``; x RMS-normalised first with
        ``norm_weight=``/``norm_eps=``. Returns (q, k, v) or None."""
        ...


@runtime_checkable
class KVAppend(Protocol):
    def kv_append(self, k_buf: mx.array, v_buf: mx.array, k: mx.array, v: mx.array,
                  offset: int) -> Optional[Tuple[mx.array, mx.array]]:
        """mlx-lm's ``KVCache.update_and_fetch`` into buffers with room: the new (k_buf, v_buf) or None."""
        ...


@runtime_checkable
class DecoderBlockKernel(Protocol):
    """A whole decoder layer (described by ``kernels.spec.LayerSpec``) as one op writing the KV cache in place
    (contract in ``kernels.kv_cache`` and ``kernels.fused_block``); weights by name."""

    def decoder_layer_plan(self, names: Sequence[str], config: dict) -> Any: ...

    def decoder_layer(self, x: mx.array, arrays: list, k_buf: mx.array, v_buf: mx.array, *, offset: int,
                      causal: bool, plan: Any, write: int = -1, first: int = 0,
                      starts: Optional[mx.array] = None, q_scale: Optional[mx.array] = None) -> Optional[tuple]: ...

    def kv_reserve(self, shape: Sequence[int], src: Optional[mx.array] = None, valid: int = 0,
                   dtype: mx.Dtype = mx.float32) -> mx.array: ...

    def array_id(self, a: mx.array) -> int: ...

    def array_handle(self, a: mx.array) -> mx.array: ...


@runtime_checkable
class BatchedPositions(Protocol):
    """Batched decode over mlx-lm's left-padded ``BatchKVCache`` (``kernels.kv_cache.NativeBatchKVCache``):
    ``sdpa(..., start=s)`` (batch row b sees no key before s[b]), ``rope``/``qkv_rope`` taking an integer array
    ``offset`` (one position per batch row), ``kv_append`` into float16 or float32 buffers at the shared index
    and ``kv_reserve`` to grow them."""

    def kv_append(self, k_buf: mx.array, v_buf: mx.array, k: mx.array, v: mx.array,
                  offset: int) -> Optional[Tuple[mx.array, mx.array]]: ...

    def kv_reserve(self, shape: Sequence[int], src: Optional[mx.array] = None, valid: int = 0,
                   dtype: mx.Dtype = mx.float32) -> mx.array: ...


@runtime_checkable
class TiledWeights(Protocol):
    """``decoder_layer`` plans with ``"tiled": 1`` in their config read the layer's 4-bit linears in row tiles
    (``kernels.tiling``), which this CPU decodes faster; so do ``quantized_matmul(..., tiled=True)`` and
    ``quantized_embedding(..., tiled=True)`` (the LM head). ``"symmetric": 1`` in such a config and
    ``quantized_matmul(..., symmetric=True)`` promise biases == -2^(bits-1) * scales (``tiling.symmetric``): the
    kernels may then skip reading the biases."""

    def tiled_weights(self) -> bool:
        """Whether tiled plans run here now (the kernel set reads tiles, and the user did not turn them off)."""
        ...


@runtime_checkable
class ReportNotes(Protocol):
    def report_notes(self) -> list:
        """Clauses the kernel report adds (e.g. the CPU's prefill precision)."""
        ...


# Keyword arguments a capability needs beyond its own methods' names (method -> keywords).
_KEYWORDS = {
    FusedAttention: {"quantized_matmul": ("residual",), "sdpa": ("heads_last", "kv_len"),
                     "qkv_rope": ("norm_weight", "norm_eps"), "swiglu": ("norm_weight", "norm_eps")},
    DecoderBlockKernel: {"decoder_layer": ("offset", "causal", "plan")},
    BatchedPositions: {"sdpa": ("start",)},
    TiledWeights: {"quantized_matmul": ("tiled", "symmetric"), "quantized_embedding": ("tiled",)},
}


@dataclass(frozen=True)
class Capabilities:
    """What a provider offers beyond ``KernelProvider``, checked once (see :func:`capabilities`)."""

    quantized_sdpa: bool = False
    swiglu: bool = False
    rms_norm: bool = False
    rope: bool = False
    embedding: bool = False
    experts: bool = False          # ExpertKernel: a mixture of experts' quantized projections (gather_qmm)
    fused_attention: bool = False  # needs swiglu too: its blocks fold norms and skip connections into both
    kv_append: bool = False
    decoder_block: bool = False    # needs fused_attention: the blocks fall back to it per call
    batched: bool = False          # BatchedPositions: a BatchKVCache step without built-in RoPE/KV/attention
    batched_block: bool = False    # decoder_block taking starts=: a BatchKVCache step as one op per layer
    notes: bool = False            # ReportNotes: clauses for the kernel report
    tiled: bool = False            # TiledWeights (with decoder_block), and it answers yes: one-op layers get tiles


def capabilities(provider: Any) -> Capabilities:
    """The optional Protocols ``provider`` satisfies (methods present, with the keywords they need); raises
    TypeError when it is not a ``KernelProvider`` at all."""
    if not isinstance(provider, KernelProvider):
        raise TypeError(
            f"{type(provider).__name__} lacks the kernel provider methods (name, quantized_matmul, sdpa)")
    has = lambda proto: isinstance(provider, proto) and all(  # noqa: E731
        _accepts(getattr(provider, method), words) for method, words in _KEYWORDS.get(proto, {}).items())
    swiglu = has(FusedMLP)
    fused = swiglu and has(FusedAttention)
    block = fused and has(DecoderBlockKernel)
    batched = has(BatchedPositions)
    return Capabilities(
        quantized_sdpa=has(QuantizedAttention), swiglu=swiglu, rms_norm=has(NormKernel), rope=has(RopeKernel),
        embedding=has(EmbeddingKernel), experts=has(ExpertKernel), fused_attention=fused, kv_append=has(KVAppend),
        decoder_block=block, batched=batched,
        # A left-padded batch through the one-op layer: decoder_layer(..., starts=), each row's first key.
        batched_block=block and batched and _accepts(provider.decoder_layer, ("starts",)),
        notes=has(ReportNotes),
        tiled=block and has(TiledWeights) and bool(provider.tiled_weights()),
    )


def _accepts(fn: Any, words: Sequence[str]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: trust its name
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(w in params for w in words)


def describe(provider: Optional[KernelProvider]) -> str:
    """One word for logs and reports: the provider's name, or "builtin" when there is none."""
    return provider.name if provider is not None else "builtin"
