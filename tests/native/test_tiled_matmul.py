"""Row-tiled weights (mlxinfer.kernels.tiling; cpu_kernels/src/qmm_vnni_tiled.cpp): the tiled decode matvecs (4- and
8-bit; int16 x on avx512vnni, int8 x on avx512vnnii8), the integer prefill GEMMs' tiled repack (4-bit) and the tiled
embedding lookup give the row-major kernels' results, in a process per kernel set (the set is chosen once per
process).

The row-major kernels are the reference here (their own tests hold them to exact float64 products): decode sums
the same integer products in another order (~1e-6 of an output's scale), prefill unpacks the same panels (equal)."""

from __future__ import annotations

import textwrap

import mlx.core as mx
import pytest
from isa_variants import isa_variants, run_under_isa

from mlxinfer.kernels import tiling

_PARITY = textwrap.dedent(
    """
    import mlx.core as mx
    from mlxinfer import native
    from mlxinfer.kernels import tiling
    ext = native.extension()
    assert ext.tiled_weights_supported(), ext.isa()
    mx.random.seed(5)
    worst_decode = worst_prefill = 0.0
    cases = 0
    worst_8bit = 0.0  # 8-bit past 8 x rows
    worst_symmetric = 0.0  # symmetric=True decode, its biases NaN: never read
    for bits in (4, 8):
        for gs, K, N, dt in [(32, 576, 192, mx.float16), (32, 96, 32, mx.float16), (64, 1536, 64, mx.bfloat16),
                             (64, 640, 48, mx.float16), (128, 512, 80, mx.float32), (128, 1152, 16, mx.bfloat16)]:
            wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.1, group_size=gs, bits=bits)
            s, b = s.astype(dt), b.astype(dt)
            tw, ts, tb = tiling.tile(wq, s, b)
            for M in (1, 2, 3, 4, 5, 8, 9, 17, 40):
                x = mx.random.normal((M, K))
                rows = ext.quantized_matmul(x, wq, s, b, group_size=gs, bits=bits)
                tiled = ext.quantized_matmul(x, tw, ts, tb, group_size=gs, bits=bits, tiled=True)
                err = (mx.abs(tiled - rows).max() / mx.abs(rows).max()).item()
                if bits == 8 and M > 8:  # 8-bit tiles: the matvec 8 x rows at a time; the rows: their GEMM
                    worst_8bit = max(worst_8bit, err)
                elif M <= 8:
                    worst_decode = max(worst_decode, err)
                else:  # 4-bit past 8 x rows: the GEMM's tiled repack
                    worst_prefill = max(worst_prefill, err)
                cases += 1
                if M <= 8:  # the same weights with b = -2^(bits-1) * s (a Q4_0 / Q8_0 import's form)
                    sb = s * -(2 ** (bits - 1))
                    want = ext.quantized_matmul(x, wq, s, sb, group_size=gs, bits=bits)
                    got = ext.quantized_matmul(x, tw, ts, mx.full(ts.shape, float("nan"), dt), group_size=gs,
                                               bits=bits, tiled=True, symmetric=True)
                    worst_symmetric = max(worst_symmetric, (mx.abs(got - want).max() / mx.abs(want).max()).item())
            ids = mx.array([0, 1, N // 2, N - 1, N, -1])  # the last two out of range: zero rows
            look = ext.quantized_embedding(ids, tw, ts, tb, group_size=gs, bits=bits, tiled=True)
            assert mx.array_equal(look, ext.quantized_embedding(ids, wq, s, b, group_size=gs, bits=bits)).item()
    print(ext.isa(), cases, worst_decode, worst_prefill, worst_8bit, worst_symmetric)
    """
)


def _tiled_sets(native_ext) -> list:
    sets = [s for s in ("avx512vnni", "avx512vnnii8") if s in isa_variants(native_ext.isa())]
    if not sets:
        pytest.skip(f"no AVX-512 VNNI here ({native_ext.isa()}): no kernel set reads tiles")
    return sets


@pytest.mark.slow
@pytest.mark.parametrize("prefill", [None, "int8"])
def test_tiled_kernels_match_row_major(native_ext, prefill):
    for isa in _tiled_sets(native_ext):
        proc = run_under_isa(_PARITY, isa, prefill=prefill)
        assert proc.returncode == 0, proc.stderr[-2000:]
        name, cases, worst_decode, worst_prefill, worst_8bit, worst_symmetric = proc.stdout.split()
        assert name.startswith(isa) and int(cases) == 108
        assert float(worst_decode) < 2e-5, (isa, prefill, worst_decode)
        assert float(worst_prefill) == 0.0, (isa, prefill, worst_prefill)
        # Past 8 rows the reference is the float32 or int16 GEMM (x rounded otherwise): int8 x differs by ~0.5%.
        assert float(worst_8bit) < (2e-2 if isa.endswith("i8") else 2e-4), (isa, prefill, worst_8bit)
        # Symmetric tiles fold the bias into x's correction: the same sums, the biases (NaN here) unread.
        assert float(worst_symmetric) < 2e-5, (isa, prefill, worst_symmetric)


def test_tile_round_trip_and_layout():
    wq, s, b = mx.quantize(mx.random.normal((32, 64)), group_size=32, bits=4)
    tw, ts, tb = tiling.tile(wq, s, b)
    assert tw.shape == wq.shape and ts.shape == s.shape and tw.dtype == mx.uint32
    assert all(mx.array_equal(a, c).item() for a, c in zip(tiling.untile(tw, ts, tb), (wq, s, b)))
    # Tile 1, word 3, row 5 is row 21's word 3 with its bytes 1 and 2 swapped; scales side by side per group.
    word = wq[21, 3].item()
    swapped = (word & 0xFF0000FF) | ((word & 0xFF00) << 8) | ((word >> 8) & 0xFF00)
    assert tw.reshape(2, 8, 16)[1, 3, 5].item() == swapped
    assert ts.reshape(2, 2, 16)[1, 1, 5].item() == s[21, 1].item()


def test_bad_tiled_calls_are_refused(native_ext):
    wq, s, b = mx.quantize(mx.random.normal((24, 64)), group_size=32, bits=4)  # 24 rows: not whole tiles
    x = mx.random.normal((1, 64))
    with pytest.raises(ValueError, match="tiled"):
        native_ext.quantized_matmul(x, wq, s, b, group_size=32, bits=4, tiled=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        native_ext.quantized_embedding(mx.array([1]), wq, s, b, group_size=32, bits=4, tiled=True)


def test_symmetric_weights_are_recognised_from_their_arrays():
    class Linear(dict):
        def __init__(self, scales, biases, bits):
            super().__init__(scales=scales, biases=biases)
            self.bits = bits

    s = mx.random.uniform(1e-3, 1e-2, (32, 4)).astype(mx.float16)
    assert tiling.symmetric([Linear(s, s * -8, 4), Linear(s, s * -128, 8)])
    assert not tiling.symmetric([Linear(s, s * -8, 4), Linear(s, s * -8, 8)])  # one of them: 8-bit, not -128 s
    _, qs, qb = mx.quantize(mx.random.normal((32, 128)), group_size=32, bits=4)  # MLX's own: min-max (asymmetric)
    assert not tiling.symmetric([Linear(qs, qb, 4)])
    assert not tiling.symmetric([])
