"""GGUF quantized blocks -> MLX affine quantization (packed uint32 weights, float16 scales and biases, group 32).

- Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: bit for bit. ``scale = d`` and ``bias = m`` (Q4_1/Q5_1) or ``-8·d`` / ``-128·d``
  / ``-16·d`` (Q4_0 / Q8_0, stored unsigned / Q5_0); MLX's ``scale·q + bias`` in float32 then equals ggml's value.
- Q4_K, Q5_K: each 32-weight sub-block is ``d·sc·q - dmin·m``: same q, and only the products ``d·sc`` and
  ``dmin·m`` are rounded to float16. (Our own decoding: ``mx.load``'s Q4_K values were measured wrong.)
MLX packs b-bit values as a little-endian bit stream per row (4-bit: element 2i in the low nibble of byte i).
"""

from __future__ import annotations

import numpy as np

_EXACT = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # the common types, with a faster dedicated repack
REPACK_BITS = {**_EXACT, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}  # ggml type -> MLX bits


def repack(kind: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw GGUF blocks of a (rows, n) tensor -> (packed uint32 (rows, n·bits/32), scales, biases (rows, n/32))."""
    return (_repack_exact if kind in _EXACT else _repack_other)(kind, raw, rows)


def _compact_nibbles(x: np.ndarray) -> np.ndarray:
    """uint64 holding 8 bytes < 16 -> uint32 whose nibble i is byte i (MLX's 4-bit element order)."""
    x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return ((x | (x >> np.uint64(16))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _repack_exact(kind: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks (rows, n_blocks * block_bytes) -> MLX (packed uint32, scales f16, biases f16)."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(-1, block_bytes)  # (rows * n_blocks, block_bytes)
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).reshape(rows, -1)  # (rows, n_blocks)
    if kind == "Q8_0":
        # int8 -> uint8 by flipping the sign bit (q + 128); 4 bytes per uint32, element 0 lowest
        packed = (np.ascontiguousarray(blocks[:, 2:]) ^ np.uint8(0x80)).view(np.uint32).reshape(rows, -1)
        return packed, d, (d.astype(np.float32) * -128).astype(np.float16)
    # GGUF: qs byte j holds element j (low nibble) and j+16 (high nibble); MLX: uint32 k holds 8k..8k+7.
    qs = np.ascontiguousarray(blocks[:, block_bytes - 16:]).view(np.uint64)  # (rows * n_blocks, 2)
    lo = qs & np.uint64(0x0F0F0F0F0F0F0F0F)
    hi = (qs >> np.uint64(4)) & np.uint64(0x0F0F0F0F0F0F0F0F)
    packed = np.concatenate([_compact_nibbles(lo), _compact_nibbles(hi)], axis=1).reshape(rows, -1)
    if kind == "Q4_1":
        return packed, d, np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).reshape(rows, -1)
    return packed, d, (d.astype(np.float32) * -8).astype(np.float16)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n) uint8 values < 2**bits -> MLX's packing: a little-endian bit stream per row, as uint32 words."""
    rows = q.shape[0]
    if bits == 4:  # element 2i in the low nibble of byte i
        return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(rows, -1).view(np.uint32)
    if bits == 5:  # 8 values -> 5 bytes; uint8 shifts drop the bits that belong to the next byte
        v = [q.reshape(-1, 8)[:, j] for j in range(8)]
        out = np.stack([v[0] | (v[1] << 5), (v[1] >> 3) | (v[2] << 2) | (v[3] << 7), (v[3] >> 1) | (v[4] << 4),
                        (v[4] >> 4) | (v[5] << 1) | (v[6] << 6), (v[6] >> 2) | (v[7] << 3)], axis=1)
        return out.astype(np.uint8).reshape(rows, -1).view(np.uint32)
    stream = np.zeros(q.size // 8, np.uint64)  # any width: 8 values = `bits` bytes of a uint64
    for j in range(8):
        stream |= q.reshape(-1, 8)[:, j].astype(np.uint64) << np.uint64(j * bits)
    return np.ascontiguousarray(stream.view(np.uint8).reshape(-1, 8)[:, :bits]).reshape(rows, -1).view(np.uint32)


def _k_scales(blocks: np.ndarray, d_at: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per-32 scale d·sc and offset dmin·m, (n, 8) float32 each."""
    d = np.ascontiguousarray(blocks[:, d_at:d_at + 2]).view(np.float16).astype(np.float32)  # (n, 1)
    dmin = np.ascontiguousarray(blocks[:, d_at + 2:d_at + 4]).view(np.float16).astype(np.float32)
    lo, mid, hi = (blocks[:, d_at + 4:d_at + 16].reshape(-1, 3, 4)[:, k] for k in range(3))  # ggml get_scale_min_k4
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=1).astype(np.float32)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=1).astype(np.float32)
    return d * sc, dmin * mn


def _repack_other(kind: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0, Q5_1 (bit-exact) and Q4_K, Q5_K (affine per 32 weights: only scale and bias rounded to float16)
    -> MLX (packed uint32, scales f16, biases f16), group size 32."""
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4  # d [, m], 4 bytes of high bits, 16 bytes of nibbles
        blocks = raw.reshape(-1, at + 20)
        d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16)  # (n, 1)
        qh = np.unpackbits(blocks[:, at:at + 4], axis=1, bitorder="little")  # (n, 32): bit i = 5th bit of i
        qs = blocks[:, at + 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (qh << 4)  # (n, 32)
        bias = (d.astype(np.float32) * -16).astype(np.float16) if kind == "Q5_0" else \
            np.ascontiguousarray(blocks[:, 2:4]).view(np.float16)
        return _pack_bits(q.reshape(rows, -1), 5), d.reshape(rows, -1), bias.reshape(rows, -1)
    k5 = kind == "Q5_K"
    blocks = raw.reshape(-1, 176 if k5 else 144)  # d, dmin, 12 scale bytes, [32 high-bit bytes,] 128 nibble bytes
    scale, offset = _k_scales(blocks, 0)
    qs = blocks[:, 48 if k5 else 16:].reshape(-1, 4, 1, 32)  # chunk c: low nibbles = sub-block 2c, high = 2c+1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    if k5:  # bit j of high-bit byte k is the 5th bit of element k of sub-block j
        q |= np.unpackbits(blocks[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8).transpose(0, 2, 1) << 4
    packed = _pack_bits(q.reshape(rows, -1), 5 if k5 else 4)
    return packed, scale.astype(np.float16).reshape(rows, -1), (-offset).astype(np.float16).reshape(rows, -1)
