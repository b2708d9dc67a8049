"""The int8 decode kernels (MLXINFER_ISA=avx2i8: x rounded to int8 per weight group, vpmaddubsw on the 4-bit
nibbles; MLXINFER_ISA=avx512vnnii8: the same rounding, vpdpbusd on 128-element blocks), each in its own process
(the kernel set is chosen once per process).

Two references: an int8-aware one (the same rounding of x done in numpy, products summed in float64) that the
kernel must match to float32 accumulation error, so a wrong nibble, lane or scale fails at once; and the exact
float64 product x @ dequantized(w).T, to which int8 x adds llama.cpp-grade error (Gaussian x: ~0.5% rms of a
dot; the largest error over all cases, relative to the largest sum |x| |w|, measured 0.62%)."""

from __future__ import annotations

import os
import textwrap

import pytest
from isa_variants import isa_variants, kernel_set_name, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

_PARITY = textwrap.dedent(
    """
    import sys
    import numpy as np
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    print(ext.isa())
    mx.random.seed(11)
    int8_bits = (4, 8) if ext.isa().startswith("avx512vnnii8") else (4,)  # avx2i8: 8-bit weights keep int16 x

    def unpack(q, bits):
        words = np.array(q).astype(np.uint64)
        e = 32 // bits
        shifts = (np.arange(e, dtype=np.uint64) * bits)[None, None, :]
        return ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1).astype(np.float64)

    def int8_reference(x, q, s, b, gs, bits=4):
        # The kernel's rounding: d = max|x| / 127 per group (float32), xq = rint(x * (127 / max|x|)) in float32.
        xf = np.array(x.astype(mx.float32))
        M, K = xf.shape
        xg = xf.reshape(M, K // gs, gs)
        amax = np.abs(xg).max(-1, keepdims=True).astype(np.float32)
        safe = np.where(amax > 0, amax, np.float32(1))
        xq = np.where(amax > 0, np.rint(xg * (np.float32(127) / safe)), 0).astype(np.float64)
        d = (amax / np.float32(127)).astype(np.float64)
        qi = unpack(q, bits).reshape(q.shape[0], K // gs, gs)
        sd = np.array(s.astype(mx.float32)).astype(np.float64)
        bd = np.array(b.astype(mx.float32)).astype(np.float64)
        # The centring term off * (sum x - d * sum xq) per group is exact: only x's rounding against q - off
        # remains (off = 8 for 4-bit, 128 for 8-bit weights).
        xs = xg.astype(np.float64).sum(-1)
        corr = (8 if bits == 4 else 128) * (xs - d[..., 0] * xq.sum(-1))
        dots = np.einsum("mgk,ngk->mng", xq, qi) * d[:, None, :, 0] + corr[:, None, :]
        return (dots * sd[None]).sum(-1) + xs @ bd.T

    worst_exact = worst_int8 = 0.0
    cases = 0
    for bits, gs in [(bits, gs) for bits in int8_bits for gs in (32, 64, 128)]:
        # K % 64 == 32 only exists for 32-groups; 576 is SmolLM2's width.
        for K in sorted({gs, 3 * gs, 5 * gs, 576 if 576 % gs == 0 else 7 * gs, 1056 if gs == 32 else 9 * gs}):
            for N in (1, 5, 77, 130):
                for sdt in (mx.float32, mx.float16, mx.bfloat16):
                    w = mx.random.normal((N, K))
                    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
                    s, b = s.astype(sdt), b.astype(sdt)
                    wd = mx.dequantize(q, s, b, group_size=gs, bits=bits).astype(mx.float32)
                    wd = np.array(wd).astype(np.float64)
                    for M in range(1, 9):
                        x = mx.random.normal((M, K)) * 3.0
                        if M == 3 and K > gs:
                            x[:, :gs] = 0.0  # an all-zero group
                        out = np.array(ext.quantized_matmul(x, q, s, b, group_size=gs, bits=bits).astype(mx.float32))
                        xd = np.array(x).astype(np.float64)
                        truth = xd @ wd.T
                        # Relative to sum |x| |w| (a lone short dot may cancel to near zero).
                        scale = (np.abs(xd) @ np.abs(wd).T).max()
                        e8 = np.abs(out - int8_reference(x, q, s, b, gs, bits)).max() / scale
                        ex = np.abs(out - truth).max() / scale
                        worst_int8, worst_exact = max(worst_int8, e8), max(worst_exact, ex)
                        cases += 1
                        if e8 > 2e-6 or ex > 1.2e-2:
                            sys.exit(f"bits={bits} gs={gs} K={K} N={N} M={M} scales={sdt} int8-ref err={e8} "
                                     f"exact err={ex}")
    # float16 / bfloat16 x and output; on avx2i8 8-bit weights (the int16 x kernel) next to 4-bit ones in one run.
    q, s, b = mx.quantize(mx.random.normal((40, 320)), group_size=32, bits=4)
    for xdt in (mx.float16, mx.bfloat16):
        x = mx.random.normal((4, 320)).astype(xdt)
        out = np.array(ext.quantized_matmul(x, q, s, b, group_size=32, bits=4).astype(mx.float32))
        ref = int8_reference(x, q, s, b, 32)
        if np.abs(out - ref).max() / np.abs(ref).max() > 1e-2:
            sys.exit(f"x {xdt} mismatch")
    for gs in (32, 64, 128) if 8 not in int8_bits else ():
        q, s, b = mx.quantize(mx.random.normal((33, 384)), group_size=gs, bits=8)
        for M in (1, 5, 8):
            x = mx.random.normal((M, 384))
            out = np.array(ext.quantized_matmul(x, q, s, b, group_size=gs, bits=8))
            truth = np.array(x @ mx.dequantize(q, s, b, group_size=gs, bits=8).T)
            if np.abs(out - truth).max() / np.abs(truth).max() > 1e-4:
                sys.exit(f"8-bit gs={gs} M={M} mismatch")
    # set_int8_decode(False) (the load-time self-check's setting): the int16 x kernel, avx2's 1e-4.
    q, s, b = mx.quantize(mx.random.normal((70, 576)), group_size=32, bits=4)
    x = mx.random.normal((3, 576))
    truth = x @ mx.dequantize(q, s, b, group_size=32, bits=4).T
    ext.set_int8_decode(False)
    off = (mx.abs(ext.quantized_matmul(x, q, s, b, group_size=32, bits=4) - truth).max() / mx.abs(truth).max()).item()
    ext.set_int8_decode(True)
    on = (mx.abs(ext.quantized_matmul(x, q, s, b, group_size=32, bits=4) - truth).max() / mx.abs(truth).max()).item()
    if not (off < 1e-4 < on):
        sys.exit(f"set_int8_decode: off {off}, on {on}")
    print(cases, worst_int8, worst_exact)
    """
)


@pytest.mark.parametrize("isa", ["avx2i8", "avx512vnnii8"])
def test_int8_decode_parity(native_ext, isa):
    if isa not in isa_variants(native_ext.isa()):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) cannot run {isa}")
    proc = run_under_isa(_PARITY, isa, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    got_isa, cases, worst_int8, worst_exact = proc.stdout.split()
    assert got_isa == kernel_set_name(isa) and int(cases) > 1000
    # int8 x is not exact: a kernel that matched the float product to int16 precision would not be this one.
    assert 1e-4 < float(worst_exact) < 1.2e-2 and float(worst_int8) < 2e-6


_REPORT = textwrap.dedent(
    """
    import mlxinfer
    from mlxinfer import native
    ext = native.extension()
    on = native.int8_decode_active()
    ext.set_int8_decode(False)
    off = native.int8_decode_active()
    ext.set_int8_decode(True)
    loaded = mlxinfer.load("smollm2")
    print(on, off, native.int8_decode_active(), f"decode at int8 ({ext.isa().split('+')[0]}:" in loaded.kernels_detail)
    """
)


@pytest.mark.parametrize("isa", ["avx2i8", "avx2", "avx512vnnii8", "avx512vnni"])
def test_the_kernel_report_says_when_decode_ran_at_int8(native_ext, smollm2_dir, isa):
    """MLXINFER_ISA=avx2i8 or avx512vnnii8 rounds decode's x to int8: the kernel report (chat header, bench
    provenance) says so, and the state is read without changing it; their int16 sets say nothing."""
    if isa not in isa_variants(native_ext.isa()):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) cannot run {isa}")
    proc = run_under_isa(_REPORT, isa, threads=None, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = "True False True True" if isa.endswith("i8") else "False False False False"
    assert proc.stdout.split() == want.split(), proc.stdout


_SETTING = "from mlxinfer import native; print(native.extension().isa(), '|', native.decode_problem())"


@pytest.mark.parametrize("value,forced", [("int8", None), ("int16", None), ("Int8", None), ("int8", "avx2")])
def test_mlxinfer_decode_int8_picks_the_cpus_int8_set(native_ext, value, forced):
    """MLXINFER_DECODE=int8 (the user's switch, unlike MLXINFER_ISA's forced variants) gives the CPU's int8 decode
    set: avx512vnnii8 with VNNI, else avx2i8. int16 is the default; any other value, or int8 where MLXINFER_ISA
    forces a set without int8 decode, changes nothing and is named in one line."""
    variants = isa_variants(native_ext.isa())
    int8_set = next((s for s in ("avx512vnnii8", "avx2i8") if s in variants), None)
    if int8_set is None or (forced and forced not in variants):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) have no int8 decode set")
    env = {**os.environ, "MLXINFER_DECODE": value}
    env.pop("MLXINFER_PREFILL", None)
    proc = run_under_isa(_SETTING, forced, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, problem = [part.strip() for part in proc.stdout.split("|")]
    best = native_ext.isa().split("+")[0]  # this process' set (the child has no MLXINFER_PREFILL: AMX if any)
    if value == "int8" and forced is None:
        assert (got, problem) == (int8_set, "None")
    elif value == "int16":
        assert got in (best, "avx512amx") and problem == "None"
    elif value == "Int8":
        assert problem.startswith("MLXINFER_DECODE='Int8' is not a decode mode and is ignored")
    else:
        assert got == forced and problem.startswith("MLXINFER_DECODE=int8 has no effect: the kernel set avx2 ")
