"""The "cpu-native" KernelProvider over the ``_mlxinfer_cpu`` extension (see ``mlxinfer.kernels.provider``).

Each extension op validates its arguments when the graph is built (``std::invalid_argument`` -> ValueError,
a wrong Python type -> TypeError); a rejected call means "not mine" and the provider returns None, so that
``kernels.patch`` runs MLX's built-in instead. Checking in C++ rather than here keeps per-token Python small:
a SmolLM2 decode step makes ~300 provider calls.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import mlx.core as mx

_REJECTED = (ValueError, TypeError)


class NativeCpuProvider:
    name = "cpu-native"

    def __init__(self, ext: ModuleType):
        self._ext = ext

    def report_notes(self) -> list:
        """Clauses for the kernel report (the prefill precision, a bad MLXINFER_PREFILL)."""
        from mlxinfer import native

        return native.report_notes()

    def tiled_weights(self) -> bool:
        """The VNNI kernel sets read one-op layers' 4-bit weights and LM heads in row tiles (kernels.tiling), unless
        ``MLXINFER_TILED=0``."""
        from mlxinfer import native

        return native.tiled_requested() and bool(self._ext.tiled_weights_supported())

    def quantized_matmul(self, x, w, scales, biases, *, group_size: int, bits: int, mode: str = "affine",
                         residual: Optional[mx.array] = None, tiled: bool = False,
                         symmetric: bool = False) -> Optional[mx.array]:
        # MLX's affine 4/8-bit format, groups 32/64/128, float x/scales: (..., K) x (N, K)^T -> (..., N),
        # + residual (float32, the output's shape: a skip connection) when given; tiled: w in row tiles;
        # symmetric: biases == -2^(bits-1) * scales (the tiled decode skips them).
        if mode != "affine" or biases is None:
            return None
        try:
            return self._ext.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits,
                                              residual=residual, tiled=tiled, symmetric=symmetric)
        except _REJECTED:
            return None

    def gather_qmm(self, x, w, scales, biases, indices, *, group_size: int, bits: int,
                   mode: str = "affine") -> Optional[mx.array]:
        """A mixture of experts' projection (``mx.gather_qmm(..., rhs_indices=indices, transpose=True)``):
        float32 x (..., M, K), w (E, N, K) affine 4/8-bit, indices (...) -> (..., M, N)."""
        if mode != "affine" or biases is None:
            return None
        try:
            return self._ext.gather_qmm(x, w, scales, biases, indices, group_size=group_size, bits=bits)
        except _REJECTED:
            return None

    def swiglu(self, x, gate, up, *, group_size: int, bits: int, norm_weight=None,
               norm_eps: float = 0.0) -> Optional[mx.array]:
        """silu(x @ Wg.T) * (x @ Wu.T) in one primitive: both matvecs share one pass over x and one pool job;
        x RMS-normalised first when ``norm_weight`` is given."""
        (wg, sg, bg), (wu, su, bu) = gate, up
        if bg is None or bu is None:
            return None
        try:
            # (..., K) -> (..., N)
            return self._ext.swiglu(x, wg, sg, bg, wu, su, bu, group_size=group_size, bits=bits,
                                    norm_weight=norm_weight, norm_eps=float(norm_eps))
        except _REJECTED:
            return None

    # Optional extras beyond the KernelProvider contract: MLX's CPU build runs mx.fast.rms_norm and
    # mx.fast.rope as chains of generic ops (~50 and ~75 us per decode call on SmolLM2), 8 ms of a 28 ms token.
    def rms_norm(self, x, weight, eps: float) -> Optional[mx.array]:
        """Same as ``mx.fast.rms_norm(x, weight, eps)``; float32 with a (D,) weight only."""
        if weight is None:
            return None
        try:
            return self._ext.rms_norm(x, weight, eps=float(eps))
        except _REJECTED:
            return None

    def rope(self, x, dims: int, *, traditional: bool, base: Optional[float], scale: float, offset,
             freqs=None) -> Optional[mx.array]:
        """Same as ``mx.fast.rope``; float32 x (..., L, D), an int offset or one per batch row (an integer
        array (B,), mlx-lm's ``BatchKVCache.offset``), no custom freqs."""
        if freqs is not None or base is None:
            return None
        rows = offset if isinstance(offset, mx.array) else None
        if rows is None and not isinstance(offset, int):
            return None
        try:
            return self._ext.rope(x, dims=dims, traditional=traditional, base=float(base), scale=float(scale),
                                  offset=0 if rows is not None else offset, offsets=rows)
        except _REJECTED:
            return None

    def quantized_embedding(self, ids, w, scales, biases, *, group_size: int, bits: int,
                            mode: str = "affine", tiled: bool = False) -> Optional[mx.array]:
        """``nn.QuantizedEmbedding``'s lookup (3 gathers + dequantize in MLX, ~30 CPU ops) as one op; tiled: the
        table in row tiles."""
        if mode != "affine" or biases is None:
            return None
        try:
            # ids (...) -> (..., dim)
            return self._ext.quantized_embedding(ids, w, scales, biases, group_size=group_size, bits=bits,
                                                 tiled=tiled)
        except _REJECTED:
            return None

    def qkv_rope(self, x, q, k, v, *, group_size: int, bits: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_dims: int, traditional: bool, base: Optional[float], scale: float, offset, norm_weight=None,
                 norm_eps: float = 0.0, freqs=None):
        """The three projections, head split and RoPE as one op (11 MLX ops per decode step otherwise); ``freqs``
        as ``mx.fast.rope``'s (then ``base`` is unused); ``offset`` an int or one per batch row (an integer array
        (B,): a left-padded ``BatchKVCache``)."""
        rows = offset if isinstance(offset, mx.array) else None
        if ((base is None and freqs is None) or (rows is None and not isinstance(offset, int))
                or any(t[2] is None for t in (q, k, v))):
            return None
        try:
            # x (B, L, hidden) -> q (B, n_heads, L, head_dim), k and v (B, n_kv_heads, L, head_dim)
            return tuple(self._ext.qkv_rope(
                x, list(q), list(k), list(v), group_size=group_size, bits=bits, n_heads=n_heads,
                n_kv_heads=n_kv_heads, head_dim=head_dim, rope_dims=rope_dims, traditional=traditional,
                base=float(base if base is not None else 0.0), scale=float(scale),
                offset=0 if rows is not None else offset, norm_weight=norm_weight, norm_eps=float(norm_eps),
                freqs=freqs, offsets=rows,
            ))
        except _REJECTED:
            return None

    def sdpa(self, q, k, v, *, scale: float, mask, heads_last: bool = False,
             kv_len: int = -1, start: Optional[mx.array] = None) -> Optional[mx.array]:
        """float32 attention with no mask or a causal one (array masks go to the built-in). q (B, n_heads, L, D),
        k/v (B, n_kv_heads, S, D) -> (B, n_heads, L, D), or (B, L, n_heads * D) with ``heads_last``; with
        ``kv_len`` >= 0 only the first kv_len of the S keys count (k/v may be whole KV-cache buffers); with
        ``start`` (B,) integer, batch row b sees no key before start[b] (a left-padded batch: with "causal" that
        is ``BatchKVCache.make_mask``'s mask)."""
        if mask is not None and not (isinstance(mask, str) and mask == "causal"):
            return None
        try:
            return self._ext.sdpa(q, k, v, scale=float(scale), causal=mask is not None and q.shape[2] > 1,
                                  heads_last=heads_last, kv_len=kv_len, start=start)
        except _REJECTED:
            return None

    def decoder_layer_plan(self, names, config: dict):
        """The plan for ``decoder_layer`` (made once per layer): ``names`` are the weights' slot names in the order
        the arrays will come, ``config`` the layer's numbers (both from ``kernels.spec.LayerSpec``); None when
        the op does not take such a layer."""
        try:
            return self._ext.decoder_layer_plan(list(names), {k: float(v) for k, v in config.items()})
        except _REJECTED:
            return None

    def decoder_layer(self, x, arrays: list, k_buf, v_buf, *, offset: int, causal: bool, plan, write: int = -1,
                      first: int = 0, starts=None, q_scale=None) -> Optional[tuple]:
        """A decoder layer (x (B, L, hidden) float32 -> same) as one op, writing this step's keys and values into
        ``k_buf``/``v_buf`` IN PLACE at buffer index ``write`` (-1: ``offset``, the position RoPE uses) and
        attending to the keys [first, write + L): only for buffers from ``kv_reserve`` that nothing else reads at
        or past ``write`` (``kernels.fused_block`` keeps that promise). ``arrays``: in the order of the plan's
        names. ``starts`` (B,) integer, ``first`` 0: a left-padded batch (row b attends from key starts[b], its
        RoPE positions offset - starts[b] + l). ``q_scale`` (L or B*L float32, plans with ``q_row_scale`` only):
        each query row's factor. Returns (y, k_buf', v_buf'): the buffers after the write, the same memory (what
        the cache must hold so that evaluating it runs the op), or None."""
        try:
            return tuple(self._ext.decoder_layer(x, arrays, k_buf, v_buf, offset, causal, plan, write, first, starts,
                                                 q_scale))
        except _REJECTED:
            return None

    def kv_reserve(self, shape, src=None, valid: int = 0, dtype=mx.float32) -> mx.array:
        """A fresh KV buffer ``shape`` (B, heads, capacity, dim) of ``dtype`` (float32 or float16), zeros, with
        ``src``'s first ``valid`` positions copied in: the only kind of buffer ``decoder_block`` may write into."""
        if dtype not in (mx.float32, mx.float16):
            raise ValueError(f"KV buffers are float32 or float16, not {dtype}")
        return self._ext.kv_reserve(list(shape), src, valid=valid, half=dtype == mx.float16)

    def array_id(self, a) -> int:
        """The identity of ``a``'s MLX array descriptor (``a[i] = v`` keeps the Python object, changes this)."""
        return self._ext.array_id(a)

    def array_handle(self, a) -> mx.array:
        """A new Python object on ``a``'s descriptor: holding it keeps that identity from being reused."""
        return self._ext.array_handle(a)

    def kv_append(self, k_buf, v_buf, k, v, offset: int):
        """mlx-lm ``KVCache.update_and_fetch`` when the buffers have room: k/v (B, H, L, D) written at
        ``offset`` of the (B, H, capacity, D) buffers (float32 or float16) in one op (in place when nothing else
        holds them). Returns the new (k_buf, v_buf) or None."""
        try:
            return tuple(self._ext.kv_append(k_buf, v_buf, k, v, offset=offset))
        except _REJECTED:
            return None
