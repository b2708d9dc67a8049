"""Launch plans for the custom kernels: shape checks, grid/threadgroup choice, and the calls in order.

Each op takes a ``run`` callable (``build.gpu_runner`` on Metal/CUDA, the CPU emulator in tests, or a
``build.Recorder``) so one plan serves every backend. ``*_unsupported`` return a short reason when a call is
outside what the kernels cover (the provider then returns None and MLX's built-in runs), else None.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from mlxinfer.kernels.build import Launch, Runner

FLOATS = (mx.float16, mx.bfloat16, mx.float32)
MAX_M = 8  # activation rows per matmul launch (decode and short speculative batches)
MAX_L = 8  # query tokens per attention launch
MAX_D = 256
QMV_THREADS = 64  # 2 simdgroups
QMV_ROWS_PER_TG = 8  # 2 simdgroups x 4 rows
# Split-K: one threadgroup per (kv head, row chunk) is too few to fill a GPU (8 for a Llama-8B decode step), so
# longer contexts split the keys until about TARGET_THREADGROUPS run, each split seeing at least MIN_SPLIT_KEYS.
SINGLE_PASS_KEYS = 256
MIN_SPLIT_KEYS = 64
TARGET_THREADGROUPS = 128
MAX_SPLITS = 64


@functools.lru_cache(maxsize=512)
def _ints(*values: int) -> mx.array:
    # Small parameter arrays, cached so a decode step does not upload new ones per layer.
    return mx.array(values, dtype=mx.int32)


@functools.lru_cache(maxsize=512)
def _floats(*values: float) -> mx.array:
    return mx.array(values, dtype=mx.float32)


# ---- quantized matmul and fused SwiGLU ----


def qmm_unsupported(x, w, scales, biases, group_size: int, bits: int, mode: str = "affine") -> Optional[str]:
    if mode != "affine":
        return f"mode {mode}"
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        return f"{bits}-bit, group size {group_size}"
    if biases is None or x.dtype not in FLOATS or scales.dtype != x.dtype or biases.dtype != x.dtype:
        return "dtypes"
    if w.ndim != 2 or w.dtype != mx.uint32 or w.shape[1] * 32 // bits != x.shape[-1]:
        return "weight shape"
    m = math.prod(x.shape[:-1])
    if not 1 <= m <= MAX_M:
        return f"{m} rows"
    return None


def _qmv_template(dtype, group_size, bits, m):
    return [("T", dtype), ("GS", group_size), ("BITS", bits), ("M", m)]


def _qmv_grid(n: int) -> Tuple[int, int, int]:
    return (QMV_THREADS, -(-n // QMV_ROWS_PER_TG), 1)


def quantized_matmul(x, w, scales, biases, *, group_size: int, bits: int, run: Runner) -> mx.array:
    """x (..., K) · dequant(w (N, K·bits/32))ᵀ -> (..., N), like mx.quantized_matmul(transpose=True)."""
    # The kernel indexes x and y as flat (M, K) / (M, N) rows, so no reshape ops are needed around it.
    *lead, k = x.shape
    n, m = w.shape[0], math.prod(lead)
    launch = Launch(
        "qmv", [x, w, scales, biases, _ints(n, k)], _qmv_template(x.dtype, group_size, bits, m),
        _qmv_grid(n), (QMV_THREADS, 1, 1), [(*lead, n)], [x.dtype],
    )
    return run(launch)[0]


def swiglu(x, gate: Sequence[mx.array], up: Sequence[mx.array], *, group_size: int, bits: int,
           run: Runner) -> mx.array:
    """silu(x · Wgᵀ) ⊙ (x · Wuᵀ) with both (N, K) weights quantized: x (..., K) -> (..., N)."""
    *lead, k = x.shape
    n, m = gate[0].shape[0], math.prod(lead)
    launch = Launch(
        "swiglu", [x, *gate, *up, _ints(n, k)], _qmv_template(x.dtype, group_size, bits, m),
        _qmv_grid(n), (QMV_THREADS, 1, 1), [(*lead, n)], [x.dtype],
    )
    return run(launch)[0]


def swiglu_unsupported(x, gate, up, group_size: int, bits: int) -> Optional[str]:
    if gate[0].shape != up[0].shape:
        return "gate/up shapes differ"
    return qmm_unsupported(x, *gate, group_size, bits) or qmm_unsupported(x, *up, group_size, bits)


# ---- decode attention ----


def _mask_unsupported(mask, q, s: int) -> Optional[str]:
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return "array mask"
    if q.shape[2] > s:
        return "more queries than keys"
    return None


def sdpa_unsupported(q, k, v, mask) -> Optional[str]:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "rank"
    b, hq, l, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % k.shape[1]:
        return "shapes"
    if not 1 <= l <= MAX_L or d > MAX_D or q.dtype not in FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return "queries/head dim/dtype"
    return _mask_unsupported(mask, q, k.shape[2])


def quantized_sdpa_unsupported(q, kt, vt, mask, group_size: int, bits: int) -> Optional[str]:
    if q.ndim != 4 or bits not in (4, 8) or group_size not in (32, 64, 128):
        return "rank/bits/group size"
    b, hq, l, d = q.shape
    kq, ks, kb = kt
    if any(a.shape[:3] != kq.shape[:3] for a in (*kt, *vt)) or kq.shape[0] != b or hq % kq.shape[1]:
        return "shapes"
    if kq.shape[3] * 32 // bits != d or vt[0].shape[3] * 32 // bits != d or d % group_size:
        return "head dim"
    if not 1 <= l <= MAX_L or d > MAX_D or q.dtype not in FLOATS or ks.dtype != q.dtype or kb.dtype != q.dtype:
        return "queries/dtype"
    if vt[1].dtype != q.dtype or vt[2].dtype != q.dtype:
        return "dtype"
    return _mask_unsupported(mask, q, kq.shape[2])


def _causal(mask) -> bool:
    return isinstance(mask, str) and mask == "causal"


def choose_splits(s: int, groups: int) -> int:
    """Key splits for ``s`` keys when ``groups`` threadgroups (kv heads x row chunks) run per split."""
    if s <= SINGLE_PASS_KEYS:
        return 1
    return max(1, min(MAX_SPLITS, -(-s // MIN_SPLIT_KEYS), -(-TARGET_THREADGROUPS // groups)))


def _attention(kind: str, q, kv_inputs, kv_template, s: int, hkv: int, scale: float, causal: bool,
               run: Runner, nsplit: Optional[int]) -> mx.array:
    b, hq, l, d = q.shape
    rows = hq // hkv * l
    qr = min(8, 1 << (rows - 1).bit_length())  # query rows per threadgroup: 1, 2, 4 or 8
    nsplit = nsplit or choose_splits(s, b * hkv * -(-rows // qr))
    block = -(-s // nsplit)
    nsplit = -(-s // block)  # no empty trailing splits
    nsg = max(4, -(-d // 32))
    split = nsplit > 1
    out_rows = b * hq * l
    shapes = [(1,), (out_rows, nsplit, d), (out_rows, nsplit), (out_rows, nsplit)] if split else \
        [(b, hq, l, d), (1,), (1,), (1,)]
    launch = Launch(
        kind, [mx.contiguous(q), *kv_inputs, _ints(nsplit, block, int(causal), 0), _floats(float(scale))],
        [("T", q.dtype), ("D", d), ("QR", qr), ("NSG", nsg), ("SPLIT", split), *kv_template],
        (nsg * 32, b * hkv, -(-rows // qr) * nsplit), (nsg * 32, 1, 1), shapes,
        [q.dtype, mx.float32, mx.float32, mx.float32],
    )
    o, part, pm, pl = run(launch)
    if not split:
        return o
    reduce = Launch("sdpa_reduce", [part, pm, pl], [("T", q.dtype), ("D", d)], (32, out_rows, 1), (32, 1, 1),
                    [(out_rows, d)], [q.dtype])
    return run(reduce)[0].reshape(b, hq, l, d)


def sdpa(q, k, v, *, scale: float, mask, run: Runner, nsplit: Optional[int] = None) -> mx.array:
    """Decode attention, q (B, Hq, L, D), k/v (B, Hkv, S, D) read in place; mask None | "causal"."""
    return _attention("sdpa_decode", q, [k, v], [], k.shape[2], k.shape[1], scale, _causal(mask), run, nsplit)


def quantized_sdpa(q, kt, vt, *, scale: float, mask, group_size: int, bits: int, run: Runner,
                   nsplit: Optional[int] = None) -> mx.array:
    """Decode attention over QuantizedKVCache triples (packed, scales, biases), dequantized inside the kernel."""
    kq = kt[0]
    return _attention("sdpa_quant", q, [*kt, *vt], [("GS", group_size), ("BITS", bits)], kq.shape[2], kq.shape[1],
                      scale, _causal(mask), run, nsplit)
