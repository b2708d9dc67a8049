"""The AVX2 decode kernels (MLXINFER_ISA=avx2: x rounded to int16 per group, vpmaddwd; avx2float: float32 FMAs)
against exact products, each in its own process (the kernel set is chosen once per process)."""

from __future__ import annotations

import textwrap

import pytest
from isa_variants import isa_variants, kernel_set_name, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

# For every M of the decode path, bits, group size, a few K (odd multiples of the group, K % 64 == 32) and N
# (4-row blocks plus 1 or 2 rows; N >= 5 so that the largest output is not a cancellation-sized one), with a
# residual: the error against x @ dequantized(w).T + r, relative to the output's largest value, stays within
# the 1e-4 the VNNI path is held to (test_quantized_matmul.assert_close).
_PARITY = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    print(ext.isa())
    mx.random.seed(7)
    worst = 0.0
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for K in sorted({gs, 3 * gs, 5 * gs, 576 if 576 % gs == 0 else 3 * gs}):
                for N in (5, 77, 130):
                    w = mx.random.normal((N, K))
                    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
                    wd = mx.dequantize(q, s, b, group_size=gs, bits=bits)
                    for M in range(1, 9):
                        x = mx.random.normal((M, K)) * 3.0
                        r = mx.random.normal((M, N))
                        out = ext.quantized_matmul(x, q, s, b, group_size=gs, bits=bits, residual=r)
                        truth = x @ wd.T
                        err = (mx.abs(out - (truth + r)).max() / mx.abs(truth).max()).item()
                        worst = max(worst, err)
                        if err > 1e-4:
                            sys.exit(f"bits={bits} gs={gs} K={K} N={N} M={M} err={err}")
    # float16 / bfloat16 scales and inputs go through the same kernels.
    for sdt in (mx.float16, mx.bfloat16):
        q, s, b = mx.quantize(mx.random.normal((40, 320)), group_size=32, bits=4)
        s, b = s.astype(sdt), b.astype(sdt)
        wd = mx.dequantize(q, s, b, group_size=32, bits=4)
        for M in (1, 4, 8):
            x = mx.random.normal((M, 320))
            out = ext.quantized_matmul(x.astype(sdt), q, s, b, group_size=32, bits=4).astype(mx.float32)
            truth = x.astype(sdt).astype(mx.float32) @ wd.astype(mx.float32).T
            err = (mx.abs(out - truth).max() / mx.abs(truth).max()).item()
            if err > 1e-2:
                sys.exit(f"scales {sdt} M={M} err={err}")
    print(worst)
    """
)


def _avx2_variants(native_ext):
    return [isa for isa in ("avx2float", "avx2") if isa in isa_variants(native_ext.isa())]


@pytest.mark.parametrize("isa", ["avx2", "avx2float"])
def test_decode_parity(native_ext, isa):
    if isa not in _avx2_variants(native_ext):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) cannot run {isa}")
    proc = run_under_isa(_PARITY, isa)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    got_isa, worst = proc.stdout.split()
    assert got_isa == kernel_set_name(isa)
    # The int16 path rounds x (~1e-5 of the output's scale); the float32 one is near exact. Both are nonzero
    # (a kernel that returned the bias term alone would fail above).
    assert float(worst) < (1e-4 if isa == "avx2" else 2e-5)


def test_avx2_is_the_int16_path(native_ext):
    """On an AVX2-only CPU the default set is the int16 decode kernel (measured faster: docs/cpu-kernels.md)."""
    if native_ext.isa().split("+")[0] not in ("avx2", "avx2float"):
        pytest.skip(f"not an AVX2-only CPU ({native_ext.isa()})")
    code = "from mlxinfer import native; print(native.extension().isa())"
    proc = run_under_isa(code, None, threads=None, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == [kernel_set_name("avx2")], proc.stderr
