"""Decode matvecs split into pool tasks: a large one (an LM head's shape) goes in many tasks of bounded size
(quantized.cpp, kTaskBytes), and how the rows are split must never change a row's result. Each ISA variant the
CPU runs, in its own process (the kernel set is chosen once per process)."""

from __future__ import annotations

import textwrap

import pytest
from isa_variants import isa_variants, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

# N not a multiple of 8 or 4 (a short last task and single-row tail), 576 = 18 groups of 32 (a group count that
# is not a multiple of 8: the scale buffers' zero pad), float16 scales as GGUF imports have. One pool thread,
# then two: bitwise the same output. Against x @ dequantized(w).T: within the variant's rounding of x.
_SPLIT = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    isa = ext.isa().split("+")[0]
    mx.random.seed(3)
    for bits, N, K in ((8, 6147, 576), (4, 9001, 576), (4, 1029, 1536)):
        w = mx.random.normal((N, K)) * mx.random.uniform(0.1, 4.0, (N, 1))
        q, s, b = mx.quantize(w, group_size=32, bits=bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        wd = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
        for M in (1, 3):
            x = mx.random.normal((M, K)) * 2.0
            outs = []
            for threads in (1, 2):
                ext.set_num_threads(threads)
                outs.append(ext.quantized_matmul(x, q, s, b, group_size=32, bits=bits))
                mx.eval(outs[-1])
            if not mx.array_equal(outs[0], outs[1]).item():
                sys.exit(f"{isa} bits={bits} N={N} M={M}: 1 and 2 threads differ")
            truth = x @ wd.T
            err = (mx.abs(outs[1] - truth).max() / mx.abs(truth).max()).item()
            # int8 x: avx2i8 for 4-bit weights, avx512vnnii8 for 4- and 8-bit ones
            tol = 2e-2 if isa == "avx512vnnii8" or (isa == "avx2i8" and bits == 4) else 1e-4
            if err > tol:
                sys.exit(f"{isa} bits={bits} N={N} M={M}: err {err} > {tol}")
    print("ok", isa)
    """
)


def test_split_does_not_change_rows(native_ext):
    for isa in isa_variants(native_ext.isa()):
        proc = run_under_isa(_SPLIT, isa, threads=None)
        assert proc.returncode == 0, f"{isa}: {proc.stdout}{proc.stderr}"
        assert proc.stdout.strip().startswith("ok"), proc.stdout
