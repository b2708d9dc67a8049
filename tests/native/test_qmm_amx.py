"""The AMX-BF16 prefill (cpu_kernels/src/qmm_amx.cpp), in a process forced to the ``avx512amx`` set: skipped on CPUs
without AMX-BF16 (or where Linux does not grant the tile state), which then never pick it.

x is split into two bf16 parts (hi + lo keep ~16 significant bits) and the weights enter as q - off, exact in
bf16, with the scale and bias applied in float32 per group. The kernel is held to the exact product of the
quantized weights (float64) at 1e-5 of the largest output, float32's grade: the int16 GEMM it replaces is ~2e-5
there, a wrong weight, scale, column, group or row gives errors of order 1. Shapes cover the 16-row blocks (M = 9:
one partial block; 16, 17, 33, 100), column tiles cut short (N not a multiple of 16, tasks of 48 columns), K of one
chunk per group and several k-blocks, 4- and 8-bit weights, groups of 32/64/128, float32/16/bf16 scales and x, a
batch dim, and the residual."""

from __future__ import annotations

import textwrap

import pytest
from isa_variants import AMX_SET, isa_variants, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

_CASES = textwrap.dedent(
    """
    import numpy as np
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    print(ext.isa())
    mx.random.seed(0)
    worst, cases = 0.0, 0
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for (M, K, N) in [(9, 384, 50), (16, 128, 16), (17, 1152, 97), (33, 640, 301), (100, 2304, 48)]:
                if K % gs:
                    continue
                for dt in (mx.float32, mx.float16, mx.bfloat16):
                    w = mx.random.normal((N, K))
                    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
                    s, b = s.astype(dt), b.astype(dt)
                    batch = (2,) if M == 9 else ()
                    x = (mx.random.normal((*batch, M, K)) * 3).astype(dt)
                    # The exact product of these quantized weights: scales as stored, float64 throughout.
                    wd = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
                    truth = np.asarray(x.astype(mx.float32), np.float64) @ np.asarray(wd, np.float64).T
                    res = mx.random.normal((*batch, M, N)) if M == 33 and dt == mx.float32 else None
                    out = ext.quantized_matmul(x, q, s, b, group_size=gs, bits=bits, residual=res)
                    if res is not None:
                        truth = truth + np.asarray(res, np.float64)
                    out = np.asarray(out.astype(mx.float32), np.float64)
                    # float16/bf16 outputs round once at the end: measure against their own precision too
                    tol = 1e-5 if dt == mx.float32 else (1e-3 if dt == mx.float16 else 8e-3)
                    err = np.abs(out - truth).max() / np.abs(truth).max()
                    assert out.shape == truth.shape and err < tol, (bits, gs, M, K, N, dt, err)
                    if dt == mx.float32:
                        worst = max(worst, err)
                    cases += 1
    print(cases, worst)
    """
)




def _skip_unless_amx(native_ext):
    if AMX_SET not in isa_variants(native_ext.isa()):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) have no AMX-BF16 prefill")


def test_amx_prefill_matches_the_exact_product(native_ext):
    _skip_unless_amx(native_ext)
    proc = run_under_isa(_CASES, AMX_SET, prefill=None)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    name, cases, worst = proc.stdout.split()
    assert name == AMX_SET and int(cases) > 60
    assert float(worst) < 1e-5


_PRECISION = textwrap.dedent(
    """
    import numpy as np
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    mx.random.seed(1)
    q, s, b = mx.quantize(mx.random.normal((256, 2048)), group_size=64, bits=4)
    x = mx.random.normal((64, 2048))
    x[:, 7] = 40.0  # an outlier column, as real activations have: int16 per block loses the small ones' bits
    wd = mx.dequantize(q, s, b, group_size=64, bits=4)
    truth = np.asarray(x, np.float64) @ np.asarray(wd, np.float64).T
    out = np.asarray(ext.quantized_matmul(x, q, s, b, group_size=64, bits=4), np.float64)
    print(ext.isa(), np.abs(out - truth).max() / np.abs(truth).max())
    """
)


def test_amx_prefill_is_more_precise_than_the_int16_gemm(native_ext):
    """The same product with AMX (default) and with MLXINFER_PREFILL=int16 (the VNNI set's integer GEMM): AMX's
    error is several times smaller, so the default did not trade accuracy for its speed."""
    _skip_unless_amx(native_ext)
    errs = {}
    for prefill in (None, "int16"):
        proc = run_under_isa(_PRECISION, AMX_SET, prefill=prefill, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        name, err = proc.stdout.split()
        errs[name] = float(err)
    assert set(errs) == {AMX_SET, "avx512vnni"}
    assert errs[AMX_SET] < 2e-6 and errs[AMX_SET] * 3 < errs["avx512vnni"], errs
