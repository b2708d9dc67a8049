"""The integer prefill GEMMs, each in its own process (the kernel set is chosen once per process):

* int8 (x rounded to int8 per 32-element block, 4-bit weights kept as integers; vpmaddubsw on the avx2/avx2i8 sets,
  vpdpbusd on avx512vnni): opt-in with MLXINFER_PREFILL=int8 or set_int8_prefill(True). Rounding x to int8 costs
  ~0.5% of an output's scale (llama.cpp's Q8_0 grade), so it is held to two references: the exact product (loosely:
  up to 3% of the largest output for a short K next to an outlier) and an int8-aware float64 reference that rounds
  x exactly as the kernel's contract says (tightly, 1e-5): a wrong weight, scale, column or group fails the second
  by orders of magnitude. The two micro-kernels compute the same integer sums and the same float steps: their
  outputs must be equal bit for bit.
* int16 (the same GEMM with x rounded to int16: vpdpwssd on avx512vnni, vpmovzxbw'd weights and vpmaddwd on the
  avx2/avx2i8 sets): the default prefill of those sets, held to the exact product at the int16 decode kernel's
  accuracy and to its int16-aware reference. The AVX2 and VNNI int16 micro-kernels sum the same integers exactly
  but add the float steps in another order: equal to float32 rounding, not bit for bit.

Also the run-time switch (set_int8_prefill), the kernel set's name and the line for an MLXINFER_PREFILL value the
kernels do not know."""

from __future__ import annotations

import textwrap

import pytest
from isa_variants import isa_variants, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

_PARITY = textwrap.dedent(
    """
    import sys
    import numpy as np
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    print(ext.isa())

    wide = not ext.isa().endswith("+int8-prefill")  # the default prefill: int16 x

    def int8_reference(x, qn, sn, bn):
        # x ~= d * xq per 32-block, d = max|x| / 127 (int16: 32767), round half to even; q centred (q - 8) with the rest of the
        # weight (b + 8 s) applied to the exact x: the kernel's arithmetic in float64.
        x = np.asarray(x, np.float64)
        M, K = x.shape
        xb = x.reshape(M, K // 32, 32)
        amax = np.abs(xb).max(-1, keepdims=True)
        top = np.float32(32767 if wide else 127)
        d32 = (np.float32(1) * amax.astype(np.float32) / top).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = (top / amax.astype(np.float32)).astype(np.float32)
            xq = np.where(amax > 0, np.rint((xb.astype(np.float32) * inv).astype(np.float32)), 0.0)
        xr = (xq * d32).reshape(M, K)
        return xr @ (sn * (qn - 8)).T + x @ (bn + 8 * sn).T

    def unpack4(w, N, K):
        words = np.asarray(w).astype(np.uint64)
        shifts = (4 * np.arange(8)).astype(np.uint64)
        return ((words[:, :, None] >> shifts) & 0xF).reshape(N, K)

    mx.random.seed(11)
    worst_exact = worst_i8 = 0.0
    cases = 0
    for gs in (32, 64, 128):
        for sdt in (mx.float32, mx.float16, mx.bfloat16):
            for K in (gs, 3 * gs, 640, 1152):  # K % 64 == 32, several k-blocks
                for N in (5, 17, 48, 50, 97):
                    w = mx.random.normal((N, K))
                    q, s, b = mx.quantize(w, group_size=gs, bits=4)
                    s, b = s.astype(sdt), b.astype(sdt)
                    qn = unpack4(q, N, K).astype(np.float64)
                    # Weights in float64 (dequantize with float16 scales would round w to float16).
                    sn = np.repeat(np.asarray(s.astype(mx.float32), np.float64), gs, axis=1)
                    bn = np.repeat(np.asarray(b.astype(mx.float32), np.float64), gs, axis=1)
                    for M in (9, 13, 33):
                        x = mx.random.normal((M, K)) * 3.0
                        x[0, 5] = 40.0  # an outlier: only its own 32-block's d coarsens
                        x[M - 1, :32] = 0.0  # an all-zero block
                        out = ext.quantized_matmul(x, q, s, b, group_size=gs, bits=4)
                        exact = np.asarray(x, np.float64) @ (sn * qn + bn).T
                        scale = np.abs(exact).max()
                        err = np.abs(np.asarray(out, np.float64) - exact).max() / scale
                        ref = int8_reference(x, qn, sn, bn)
                        err8 = np.abs(np.asarray(out, np.float64) - ref).max() / scale
                        worst_exact, worst_i8 = max(worst_exact, err), max(worst_i8, err8)
                        cases += 1
                        if err > (3e-4 if wide else 1e-1) or err8 > 1e-5:
                            sys.exit(f"gs={gs} scales={sdt} K={K} N={N} M={M} exact={err} int8-aware={err8}")
    # 8-bit weights stay on the float path; a residual is added after the GEMM.
    q, s, b = mx.quantize(mx.random.normal((40, 256)), group_size=64, bits=8)
    x, r = mx.random.normal((20, 256)), mx.random.normal((20, 40))
    wd = mx.dequantize(q, s, b, group_size=64, bits=8)
    out = ext.quantized_matmul(x, q, s, b, group_size=64, bits=8, residual=r)
    if (mx.abs(out - (x @ wd.T + r)).max() / mx.abs(x @ wd.T).max()).item() > 1e-4:
        sys.exit("8-bit prefill")
    print(cases, worst_exact, worst_i8)
    """
)


def _skip_unless_avx2(native_ext, isa="avx2"):
    if isa not in isa_variants(native_ext.isa()):
        pytest.skip(f"this CPU's kernels ({native_ext.isa()}) cannot run {isa}")


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_int8_prefill_parity(native_ext, isa):
    _skip_unless_avx2(native_ext, isa)
    proc = run_under_isa(_PARITY, isa, prefill="int8", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    got, cases, exact, i8 = proc.stdout.split()
    assert got == f"{isa}+int8-prefill" and int(cases) == 3 * 3 * 4 * 5 * 3
    # The int8 rounding is visible against the exact product (the path really ran: up to ~3% of the largest
    # output for K = 32 next to a 13x outlier) and matches its own contract to float32 accuracy.
    assert 1e-3 < float(exact) < 1e-1 and float(i8) < 1e-5


@pytest.mark.parametrize("isa", ["avx2", "avx2i8", "avx512vnni"])
def test_int16_prefill_parity(native_ext, isa):
    """The default prefill of the integer sets: x rounded to int16 per 32-block; within 3e-4 of the largest exact
    output even for K = 32 next to a 13x outlier (measured 9e-5 there; int8: 2.7e-2), and to float32 accuracy of
    its int16-aware reference. The exact-product error is still above the float32 tiles' (~1e-6): the int16 GEMM,
    not the tiles, ran."""
    _skip_unless_avx2(native_ext, isa)
    proc = run_under_isa(_PARITY, isa, prefill=None, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    got, cases, exact, i16 = proc.stdout.split()
    assert got == isa and int(cases) == 3 * 3 * 4 * 5 * 3
    assert 5e-6 < float(exact) < 3e-4 and float(i16) < 1e-5


_OUTPUTS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    mx.random.seed(5)
    outs = []
    for gs in (32, 64, 128):
        for sdt in (mx.float16, mx.bfloat16, mx.float32):
            for K, N, M in ((640, 97, 33), (1152, 50, 9), (gs, 17, 13), (768, 300, 70)):
                q, s, b = mx.quantize(mx.random.normal((N, K)), group_size=gs, bits=4)
                x = mx.random.normal((M, K)) * 3
                x[0, 7] = 50.0
                out = ext.quantized_matmul(x, q, s.astype(sdt), b.astype(sdt), group_size=gs, bits=4)
                outs.append(np.asarray(out).ravel())
    np.save(sys.argv[1], np.concatenate(outs))
    print(ext.isa())
    """
)


def test_vnni_and_avx2_int8_prefill_are_equal_bit_for_bit(native_ext, tmp_path):
    """vpdpbusd (avx512vnni) and vpmaddubsw (avx2) micro-tiles sum the same integers exactly and scale them with the
    same float operations: every output equal, over groups 32/64/128, three scale dtypes, several k-blocks and M
    not a multiple of the 4-row tile."""
    _skip_unless_avx2(native_ext, "avx512vnni")
    import numpy as np

    got = {}
    for isa in ("avx2", "avx512vnni"):
        path = tmp_path / f"{isa}.npy"
        proc = run_under_isa(_OUTPUTS, isa, str(path), prefill="int8", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == f"{isa}+int8-prefill"
        got[isa] = np.load(path)
    assert got["avx2"].size > 100_000 and np.array_equal(got["avx2"], got["avx512vnni"])


@pytest.mark.parametrize("isa,prefill", [("avx2float", None), ("avx2", "float"), ("avx512vnni", "float")])
def test_float_prefill_is_unchanged(native_ext, isa, prefill):
    """The float32 tiles: avx2float's prefill, and MLXINFER_PREFILL=float anywhere: the same product to ~1e-6."""
    _skip_unless_avx2(native_ext, isa)
    code = textwrap.dedent(
        """
        import mlx.core as mx
        from mlxinfer import native
        ext = native.extension()
        mx.random.seed(2)
        q, s, b = mx.quantize(mx.random.normal((97, 640)), group_size=32, bits=4)
        x = mx.random.normal((33, 640))
        t = x @ mx.dequantize(q, s, b, group_size=32, bits=4).T
        print((mx.abs(ext.quantized_matmul(x, q, s, b, group_size=32, bits=4) - t).max() / mx.abs(t).max()).item())
        """
    )
    proc = run_under_isa(code, isa, prefill=prefill, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout) < 2e-6


_NAME = "from mlxinfer import native; print(native.extension().isa(), native.prefill_problem())"


@pytest.mark.parametrize("isa,prefill,name", [
    ("avx2", None, "avx2"), ("avx2", "int8", "avx2+int8-prefill"), ("avx2", "float", "avx2"),
    ("avx2i8", None, "avx2i8"), ("avx2i8", "int8", "avx2i8+int8-prefill"), ("avx2float", "int8", "avx2float"),
    ("avx2", "Float", "avx2"), ("avx512vnni", None, "avx512vnni"), ("avx512vnni", "int8", "avx512vnni+int8-prefill"),
    ("avx512vnni", "float", "avx512vnni"), ("avx512", "int8", "avx512"), ("avx512vnni", "int16", "avx512vnni"),
    ("avx512amx", None, "avx512amx"), ("avx512amx", "int16", "avx512vnni"), ("avx512amx", "float", "avx512vnni"),
    ("avx512amx", "int8", "avx512vnni+int8-prefill"), ("avx512vnnii8", None, "avx512vnnii8"),
    ("avx512vnnii8", "int8", "avx512vnnii8+int8-prefill"),
])
def test_the_kernel_set_name_says_int8_prefill(native_ext, isa, prefill, name):
    """Int8 prefill is opt-in (MLXINFER_PREFILL=int8) on the AVX2 integer and AVX-512 VNNI sets, never on avx2float
    or avx512 (no VNNI: its float32 tiles); the name (kernel
    report, bench provenance) carries the choice. The AMX set exists under the default prefill only: any other
    MLXINFER_PREFILL gives the VNNI set. An unknown value is ignored by the kernels and named in one line."""
    _skip_unless_avx2(native_ext, isa)
    proc = run_under_isa(_NAME, isa, prefill=prefill, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, problem = proc.stdout.strip().split(" ", 1)
    assert got == name
    if prefill == "Float":
        assert problem.startswith("MLXINFER_PREFILL='Float' is not a prefill mode") and "int8, int16 or float" in problem
    else:
        assert problem == "None"


def test_set_int8_prefill_switches_at_run_time(native_ext):
    """set_int8_prefill(True) runs the int8 GEMM in this process, False the precise path again (the default, and
    the self-check's setting); each call returns the setting it replaced."""
    if not native_ext.has_int8_prefill():
        pytest.skip(f"no int8 prefill in this kernel set ({native_ext.isa()})")
    import mlx.core as mx

    mx.random.seed(2)
    q, s, b = mx.quantize(mx.random.normal((97, 640)), group_size=32, bits=4)
    x = mx.random.normal((33, 640))
    t = x @ mx.dequantize(q, s, b, group_size=32, bits=4).T

    def err():
        out = native_ext.quantized_matmul(x, q, s, b, group_size=32, bits=4)
        return (mx.abs(out - t).max() / mx.abs(t).max()).item()

    before = native_ext.set_int8_prefill(False)
    try:
        assert before is native_ext.isa().endswith("+int8-prefill")
        assert err() < 5e-5
        assert native_ext.set_int8_prefill(True) is False
        assert 1e-3 < err() < 5e-2
        assert native_ext.set_int8_prefill(False) is True
        assert err() < 5e-5
    finally:
        native_ext.set_int8_prefill(before)


def test_report_and_cli_name_a_bad_prefill_value(native_ext, monkeypatch):
    """MLXINFER_PREFILL=Float (any value but int8|int16|float): one warning line on stderr after a load and a warning
    clause in the kernel report, both saying how to fix it; the valid values and unset give none."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from mlxinfer import native
    from mlxinfer.ui.progress import warn_native_kernels

    loaded = SimpleNamespace(backend="cpu", kernels="cpu-native")
    for value in ("int8", "int16", "float", ""):
        monkeypatch.setenv("MLXINFER_PREFILL", value)
        assert native.prefill_problem() is None and not any("warning" in n for n in native.report_notes())
    monkeypatch.delenv("MLXINFER_PREFILL")
    assert native.prefill_problem() is None
    monkeypatch.setenv("MLXINFER_PREFILL", "in8")
    line = "MLXINFER_PREFILL='in8' is not a prefill mode and is ignored (prefill keeps its default); set " \
           "MLXINFER_PREFILL=int8, int16 or float, or unset it"
    assert native.prefill_problem() == line
    assert f"warning: {line}" in native.report_notes()
    out = io.StringIO()
    console = Console(file=out, width=300)
    warn_native_kernels(loaded, "auto", console)
    warn_native_kernels(loaded, "auto", console)  # once per process
    assert out.getvalue() == f"warning: {line}\n"
    out2 = io.StringIO()
    warn_native_kernels(loaded, "builtin", Console(file=out2))  # kernels off on request: nothing to warn about
    assert out2.getvalue() == ""


_ISA_LINE = "from mlxinfer import native; print(native.extension().isa(), native.settings_problem())"


@pytest.mark.parametrize("isa,threads,said", [
    ("avx512-vnni", "2", "MLXINFER_ISA='avx512-vnni' is not a kernel set and is ignored"),
    ("neon", "2", "MLXINFER_ISA=neon is not what runs (this CPU cannot run it)"),
    (None, "abc", "MLXINFER_THREADS='abc' is not a positive whole number and is ignored"),
    (None, "0", "MLXINFER_THREADS='0' is not a positive whole number"),
])
def test_an_isa_or_thread_count_the_kernels_cannot_take_is_named(native_ext, isa, threads, said):
    """A typo in MLXINFER_ISA ran AVX2 on an AVX-512 VNNI CPU without a word; now the best set runs, as unset, and
    the warning line names the value (as for MLXINFER_PREFILL / _DECODE / _TILED); so for MLXINFER_THREADS."""
    if isa == "neon" and native_ext.isa().startswith("neon"):
        pytest.skip("an arm64 CPU runs neon")
    best = run_under_isa(_ISA_LINE, None, timeout=120).stdout.split(" ", 1)[0]
    proc = run_under_isa(_ISA_LINE, isa, threads=threads, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, problem = proc.stdout.strip().split(" ", 1)
    assert problem.startswith(said), problem
    if isa == "avx512-vnni" or threads != "2":
        assert got == best
