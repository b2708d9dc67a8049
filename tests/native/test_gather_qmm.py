"""``gather_qmm`` (a mixture of experts' projections, mlx-lm's ``QuantizedSwitchLinear``) against
``mx.gather_qmm(..., rhs_indices=, transpose=True)``: the call shapes mlx-lm's ``SwitchGLU`` makes (a decode step's
gate/up with one x row for all chosen experts, its down with one row per expert, the sorted path of a long prompt),
4/8 bits, groups 32/64/128, float32 and float16 scales; and what it refuses.

Tolerance: the decode rows go through the int16-activation matvec (~2e-5 of the output's scale, as
test_quantized_matmul); 1e-4 of the largest output. A wrong expert or row order gives errors of order 1."""

from __future__ import annotations

import textwrap

import mlx.core as mx
import pytest

from isa_variants import INT8_DECODE_SETS, isa_variants, kernel_set_name, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

E, N, K, TOP = 6, 40, 256, 2


def _cases():
    return [
        ("gate/up decode", mx.random.normal((2, 3, 1, 1, K)), mx.random.randint(0, E, (2, 3, TOP))),
        ("down", mx.random.normal((2, 3, TOP, 1, K)), mx.random.randint(0, E, (2, 3, TOP))),
        ("sorted prompt", mx.random.normal((20, 1, 1, K)), mx.sort(mx.random.randint(0, E, (20,)))),
        ("12 rows, one expert", mx.random.normal((1, 1, 12, K)), mx.random.randint(0, E, (1, 1))),
    ]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("sdt", [mx.float32, mx.float16])
def test_matches_mlx_gather_qmm(native_ext, bits, gs, sdt):
    from mlxinfer.native import int8_prefill_active

    # Experts given more than 8 rows run the prefill GEMM: under MLXINFER_PREFILL=int8 (opt-in, not CI's setting)
    # its 4-bit x is rounded to int8, ~0.5% of an output (tests/native/test_quantized_matmul.py's INT8_TOL).
    tol = 2e-2 if bits == 4 and int8_prefill_active(native_ext) else 1e-4
    mx.random.seed(bits * 1000 + gs)
    wq, s, b = mx.quantize(mx.random.normal((E, N, K)), group_size=gs, bits=bits)
    s, b = s.astype(sdt), b.astype(sdt)
    for what, x, idx in _cases():
        idx = idx.astype(mx.uint32)
        want = mx.gather_qmm(x, wq, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits)
        got = native_ext.gather_qmm(x, wq, s, b, idx, group_size=gs, bits=bits)
        assert got.shape == want.shape, what
        err = (mx.abs(got - want.astype(mx.float32)).max() / mx.abs(want).max()).item()
        assert err < tol, (what, err)


def test_every_expert_is_its_own(native_ext):
    """Experts that differ only by a constant give outputs that differ by it: the rows went to their expert."""
    mx.random.seed(1)
    base = mx.random.normal((1, N, K))
    w = mx.concatenate([base + 0.5 * e for e in range(E)])  # expert e = base + e/2 everywhere
    wq, s, b = mx.quantize(w, group_size=64, bits=8)
    x = mx.ones((1, 1, 1, 1, K))
    idx = mx.array([[[3, 0]]], dtype=mx.uint32)
    got = native_ext.gather_qmm(x, wq, s, b, idx, group_size=64, bits=8)  # (1, 1, 2, 1, N)
    diff = (got[0, 0, 0, 0] - got[0, 0, 1, 0]).astype(mx.float32)
    assert mx.allclose(diff, mx.full(diff.shape, 1.5 * K), rtol=1e-3).item()


def test_refuses_what_it_does_not_take(native_ext):
    wq, s, b = mx.quantize(mx.random.normal((E, N, K)), group_size=64, bits=4)
    idx = mx.zeros((1, 1, TOP), dtype=mx.uint32)
    x = mx.random.normal((1, 1, 1, 1, K))
    with pytest.raises(ValueError, match="float32"):
        native_ext.gather_qmm(x.astype(mx.float16), wq, s, b, idx, group_size=64, bits=4)
    with pytest.raises(ValueError, match="last dim"):
        native_ext.gather_qmm(mx.random.normal((1, 1, 1, 1, K + 64)), wq, s, b, idx, group_size=64, bits=4)
    with pytest.raises(ValueError, match="3-D"):
        native_ext.gather_qmm(x, wq[0], s[0], b[0], idx, group_size=64, bits=4)
    with pytest.raises(ValueError, match="integers"):
        native_ext.gather_qmm(x, wq, s, b, idx.astype(mx.float32), group_size=64, bits=4)
    with pytest.raises(ValueError, match="broadcast"):
        native_ext.gather_qmm(mx.random.normal((3, 1, K)), wq, s, b, mx.zeros((2,), mx.uint32), group_size=64, bits=4)
    with pytest.raises(Exception, match="out of range"):
        mx.eval(native_ext.gather_qmm(x, wq, s, b, idx + E, group_size=64, bits=4))


_DOWN_ROWS = textwrap.dedent(
    """
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    mx.random.seed(5)
    E, N, K = 20, 72, 512
    worst = 0.0
    # Two tokens, top 8 each: 15 experts read one row of their own, expert 3 reads two.
    idx = mx.array([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 3]], dtype=mx.uint32)
    for bits in (4, 8):
        for gs in (32, 64, 128):
            wq, s, b = mx.quantize(mx.random.normal((E, N, K)), group_size=gs, bits=bits)
            x = mx.random.normal((2, 8, 1, K))  # (tokens, top_k, 1, K): mlx-lm's SwitchGLU down projection
            want = mx.gather_qmm(x, wq, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits)
            got = ext.gather_qmm(x, wq, s, b, idx, group_size=gs, bits=bits)
            worst = max(worst, (mx.abs(got - want).max() / mx.abs(want).max()).item())
    print(ext.isa(), worst)
    """
)


@pytest.mark.parametrize("isa", ["generic", "avx2float", "avx2i8", "avx2", "avx512", "avx512vnnii8", "avx512vnni",
                                 "avx512amx", "neon"])
def test_down_projection_rows_on_every_kernel_set(native_ext, isa):
    """The down projection: each (token, expert) pair has its own x row and one expert is read by two tokens; every
    decode kernel set's x layout (float32, int16, int8) must pair the right row with the right expert."""
    if isa not in isa_variants(native_ext.isa()):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) cannot run {isa}")
    proc = run_under_isa(_DOWN_ROWS, isa)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got_isa, worst = proc.stdout.split()
    assert got_isa == kernel_set_name(isa)
    # int8 x (avx2i8's and avx512vnnii8's 4-bit decode) is ~0.5% off; the other layouts ~1e-5. A wrong row is off
    # by order 1.
    assert float(worst) < (2e-2 if isa in INT8_DECODE_SETS else 1e-4), worst
