"""Quantized weights in row tiles: the layout the native decode matvecs read fastest on AVX-512 VNNI CPUs.

Why: a decode matvec over MLX's row-major weights reduces each output row on its own (a per-row setup, a float
scaling per group, a horizontal sum); with 16 rows side by side, one int32 lane per row, those become one vector
op for 16 rows. Same bytes, same shapes: tile t of ``w`` (N, K/8) uint32 holds, word by word, the 16 rows' words
(bytes 1 and 2 of each swapped), and scales/biases (N, K/group) the 16 rows' values of each group side by side
(``cpu_kernels/src/qmm_vnni_tiled.cpp`` documents it). llama.cpp repacks Q4_0 for its AVX-512 kernels the same way.

Only MLXINFER's native ops read tiles (``decoder_layer`` with a ``"tiled"`` plan, ``quantized_matmul(tiled=True)``);
every MLX op would read them as garbage. So a layer is tiled only once it runs as one ``decoder_layer`` op, after
its load-time self-check, and :func:`untile_block` puts it back before anything else reads its weights
(``kernels.fused_block`` on a call the op does not take, ``kernels.patch`` when the kernels come off).
"""

from __future__ import annotations

from typing import Iterable, Optional

import mlx.core as mx

ROWS = 16  # rows per tile (kTileRows)


def _swap_middle_bytes(w: mx.array) -> mx.array:
    # Self-inverse: bytes 1 and 2 of each uint32 trade places.
    return (w & 0xFF0000FF) | ((w & 0x0000FF00) << 8) | ((w >> 8) & 0x0000FF00)


def tile(w: mx.array, scales: mx.array, biases: mx.array) -> tuple:
    """(w, scales, biases) of a quantized (N, K) weight in row tiles; N a multiple of 16."""
    n = w.shape[0]
    assert n % ROWS == 0 and w.dtype == mx.uint32, "tile: a uint32 (N, words) weight with N a multiple of 16"

    def t(a):  # (N, c) -> (N/16, c, 16) -> (N, c)
        return a.reshape(n // ROWS, ROWS, -1).transpose(0, 2, 1).reshape(n, -1)

    return t(_swap_middle_bytes(w)), t(scales), t(biases)


def untile(w: mx.array, scales: mx.array, biases: mx.array) -> tuple:
    """The inverse of :func:`tile`: MLX's row-major layout again."""
    n = w.shape[0]

    def u(a):  # (N, c) -> (N/16, c, 16) -> (N/16, 16, c) -> (N, c)
        return a.reshape(n // ROWS, -1, ROWS).transpose(0, 2, 1).reshape(n, -1)

    return _swap_middle_bytes(u(w)), u(scales), u(biases)


def tileable(linear, bits: tuple = (4,)) -> bool:
    """An affine quantized layer of ``bits`` (scales and biases per group) whose output rows fill whole tiles. The
    one-op layers take 4-bit tiles (their prefill GEMM reads those); a head 4- or 8-bit ones (its prefill is one
    row, and 8-bit tiles run 8 x rows at a time)."""
    return (getattr(linear, "bits", None) in bits and getattr(linear, "mode", "affine") == "affine"
            and "biases" in linear and linear["weight"].shape[0] % ROWS == 0)


def symmetric(linears: Iterable) -> bool:
    """Whether every one of ``linears`` has biases == -2^(bits-1) * scales exactly: a symmetric format (GGUF's Q4_0
    and Q8_0 import so: w = d * (q - 8)). The tiled decode kernels then read no biases (``symmetric=True``):
    1/9 less traffic at group 32 with float16 scales. Checked on the arrays, so nothing is assumed from a file type;
    the product is exact unless it overflows, which makes the comparison fail (and the flag off)."""
    if any("biases" not in lin for lin in linears):
        return False
    checks = [mx.array_equal(lin["biases"], lin["scales"] * -(2 ** (lin.bits - 1))) for lin in linears]
    mx.eval(checks)
    return bool(checks) and all(c.item() for c in checks)


def _swap(linears: Iterable, fn) -> None:
    arrays = []
    for lin in linears:
        w, s, b = fn(lin["weight"], lin["scales"], lin["biases"])
        lin["weight"], lin["scales"], lin["biases"] = w, s, b
        arrays += [w, s, b]
    # Made now, and the old arrays freed: the swap costs no memory past one layer's weights.
    mx.eval(arrays)


def tile_block(block, linears: list, is_symmetric: bool = False) -> None:
    """Puts ``linears`` (the block's QuantizedLinears, or ``[block]`` for a head) in row tiles and marks them: the
    block holds them (``_tiled``), each names the block (``_tiled_by``), so a call on either can undo it.
    ``is_symmetric``: what :func:`symmetric` said of them (the caller asks it once, before choosing a plan)."""
    _swap(linears, tile)
    # In __dict__ itself: nn.Module would keep a tuple of modules as a child (a second path to the linears).
    block.__dict__["_tiled"] = tuple(linears)
    block.__dict__["_tiled_symmetric"] = is_symmetric
    for lin in linears:
        lin.__dict__["_tiled_by"] = block


def untile_block(block) -> bool:
    """Puts a tiled block's linears back in MLX's layout; False when it was not tiled."""
    linears = block.__dict__.pop("_tiled", None)
    block.__dict__.pop("_tiled_symmetric", None)
    if linears is None:
        return False
    _swap(linears, untile)
    for lin in linears:
        lin.__dict__.pop("_tiled_by", None)
    return True


def tiles_of(module) -> Optional[object]:
    """The block whose tiling holds ``module``'s weights (``module`` itself for a tiled head), or None."""
    return module.__dict__.get("_tiled_by")


def is_tiled(block) -> bool:
    return block.__dict__.get("_tiled") is not None


def is_symmetric(block) -> bool:
    """A tiled block (or head) whose weights :func:`symmetric` approved: its kernels may skip the biases."""
    return block.__dict__.get("_tiled_symmetric", False)
