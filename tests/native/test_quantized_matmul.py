"""The native quantized matmul against mx.quantized_matmul, in MLX's exact affine format.

Where the kernel set has the int8 prefill GEMM (the AVX2 default; the name ends in "+int8-prefill"), every 4-bit
prefill case (M > 8) runs twice in-process: with it off (``set_int8_prefill(False)``, the float32 tiles held to
float parity, as the load-time self-check runs them) and on, held to ``INT8_TOL`` of the largest output: x rounded
to int8 per 32-block (llama.cpp's Q8_0 grade) gave a largest error of 0.45-0.67% of the largest output over these
Gaussian cases (AVX2); 2e-2 is three times that, and a wrong weight, scale or group gives errors of order 1
(test_qmm_avx2i8gemm.py holds the kernel to an int8-aware reference at 1e-5)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from isa_variants import isa_variants, kernel_set_name, run_under_isa

from mlxinfer.native import int8_activations

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

# (M, K, N): decode (M <= 8) and prefill (M > 8) paths, K an odd multiple of 128, N odd or not a tile multiple.
SHAPES = [(1, 384, 129), (3, 128, 77), (8, 640, 64), (9, 384, 50), (33, 1152, 97), (64, 256, 301)]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
INT8_TOL = 2e-2


def _int8_prefill_modes(ext, M, bits) -> list:
    """The settings of set_int8_prefill to check an M-row product under: both where the int8 GEMM would run (the
    precise path, int16 or float32, and int8)."""
    has = getattr(ext, "has_int8_prefill", lambda: False)()
    return [False, True] if has and bits == 4 and M > 8 else [None]


def assert_close(out, ref, rel=1e-4):
    """Within ``rel`` of the largest |ref|. The AVX-512 VNNI decode kernel rounds x to int16 per weight group,
    which costs ~1e-5 of the output's scale (see cpu_kernels/src/qmm_vnni.cpp): a fixed atol does not fit
    outputs of any magnitude."""
    assert out.shape == ref.shape
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err <= rel * max(mx.abs(ref.astype(mx.float32)).max().item(), 1e-6), (err, rel)


def _check(ext, M, K, N, bits, group_size, dtype, scale_dtype=mx.float32, batch=()):
    w = mx.random.normal((N, K))
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    x = mx.random.normal((*batch, M, K)).astype(dtype)
    ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group_size, bits=bits)
    # Exact answer for these quantized weights; MLX itself accumulates half-precision inputs in lower
    # precision, so the native result must be within tol of the truth or no worse than MLX's.
    wd = mx.dequantize(q, s, b, group_size=group_size, bits=bits).astype(mx.float32)
    truth = x.astype(mx.float32) @ wd.T
    mlx_err = mx.abs(ref.astype(mx.float32) - truth).max().item()
    scale = mx.abs(truth).max().item()
    for int8 in _int8_prefill_modes(ext, M, bits):
        with int8_activations(prefill=int8, ext=ext):
            out = ext.quantized_matmul(x, q, s, b, group_size=group_size, bits=bits)
            mx.eval(out)  # lazy: the kernel reads the setting when it runs
        assert out.shape == ref.shape and out.dtype == ref.dtype
        tol = INT8_TOL if int8 else {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1e-2}[ref.dtype]
        err = mx.abs(out.astype(mx.float32) - truth).max().item()
        assert err <= max(tol * scale, 1.5 * mlx_err), (M, K, N, bits, group_size, dtype, int8, err, mlx_err, scale)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_mlx(native_ext, bits, group_size, dtype):
    mx.random.seed(bits * 1000 + group_size)
    for M, K, N in SHAPES:
        _check(native_ext, M, K, N, bits, group_size, DTYPES[dtype])


@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
def test_low_precision_scales(native_ext, scale_dtype):
    mx.random.seed(1)
    for M in (1, 5, 20):
        _check(native_ext, M, 256, 96, 4, 64, mx.float32, scale_dtype=scale_dtype)
        _check(native_ext, M, 256, 96, 8, 32, scale_dtype, scale_dtype=scale_dtype)
    for gs in (32, 128):  # prefill over several 512-wide k blocks (each converts only its own groups' scales)
        _check(native_ext, 20, 1280, 40, 4, gs, mx.float32, scale_dtype=scale_dtype)


def test_decode_tails_zeros_and_outliers(native_ext):
    """Decode shapes the int16 (VNNI) path treats specially: K % 64 == 32 with 32-groups (a half block), an
    all-zero x group, and one huge activation (only its own group's int16 scale coarsens)."""
    mx.random.seed(5)
    for bits in (4, 8):
        for K in (96, 160, 32):
            for M in (1, 2, 7):
                _check(native_ext, M, K, 33, bits, 32, mx.float32)
        w = mx.random.normal((40, 256))
        q, s, b = mx.quantize(w, group_size=64, bits=bits)
        x = mx.random.normal((1, 256))
        x[0, :64] = 0.0
        x[0, 100] = 1e4
        wd = mx.dequantize(q, s, b, group_size=64, bits=bits)
        out = native_ext.quantized_matmul(x, q, s, b, group_size=64, bits=bits)
        assert_close(out, x @ wd.T)
        # Without the outlier's group the rest still matches to the usual precision.
        x2 = x.astype(mx.float32)
        x2[0, 64:128] = 0.0
        assert_close(native_ext.quantized_matmul(x2, q, s, b, group_size=64, bits=bits), x2 @ wd.T)


def test_batched_and_strided_inputs(native_ext):
    mx.random.seed(2)
    _check(native_ext, 2, 256, 40, 4, 64, mx.float32, batch=(3,))  # (3, 2, K): M = 6 rows
    _check(native_ext, 16, 256, 40, 4, 64, mx.float32, batch=(2,))  # (2, 16, K): prefill
    q, s, b = mx.quantize(mx.random.normal((48, 128)), group_size=32, bits=4)
    xt = mx.random.normal((128, 3)).T  # a transposed, non-contiguous view
    ref = mx.quantized_matmul(xt, q, s, b, group_size=32, bits=4)
    assert_close(native_ext.quantized_matmul(xt, q, s, b, group_size=32, bits=4), ref)


def test_rejects_bad_arguments(native_ext):
    q, s, b = mx.quantize(mx.random.normal((32, 128)), group_size=64, bits=4)
    with pytest.raises(ValueError, match="bits"):
        native_ext.quantized_matmul(mx.zeros((1, 128)), q, s, b, group_size=64, bits=3)
    with pytest.raises(ValueError, match="last dim"):
        native_ext.quantized_matmul(mx.zeros((1, 64)), q, s, b, group_size=64, bits=4)


def test_inside_compiled_function(native_ext):
    q, s, b = mx.quantize(mx.random.normal((64, 256)), group_size=64, bits=4)
    f = mx.compile(lambda x: native_ext.quantized_matmul(x, q, s, b, group_size=64, bits=4) * 2.0)
    x = mx.random.normal((1, 256))
    assert_close(f(x), 2.0 * mx.quantized_matmul(x, q, s, b, group_size=64, bits=4))


_ISA_SCRIPT = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    print(ext.isa(), ext.num_threads())
    mx.random.seed(3)
    for bits in (4, 8):
        for M in (1, 4, 8, 13, 40):
            q, s, b = mx.quantize(mx.random.normal((100, 384)), group_size=128, bits=bits)
            x = mx.random.normal((M, 384))
            ref = mx.quantized_matmul(x, q, s, b, group_size=128, bits=bits)
            out = ext.quantized_matmul(x, q, s, b, group_size=128, bits=bits)
            err = mx.abs(out - ref).max().item()
            # avx2i8's and avx512vnnii8's decode and the int8 prefill (4-bit, M > 8) round x to int8 (llama.cpp-grade,
            # ~0.5% of the output's scale; test_qmm_int8_decode.py and test_qmm_avx2i8gemm.py hold them to int8-aware
            # references).
            set_name = ext.isa()
            int8 = set_name.split("+")[0].endswith("i8") or (bits == 4 and M > 8 and set_name.endswith("+int8-prefill"))
            if err > (2e-2 if int8 else 1e-4) * mx.abs(ref).max().item():
                sys.exit(f"bits={bits} M={M} err={err}")
    """
)


def _run_isa_script(isa, threads):
    proc = run_under_isa(_ISA_SCRIPT, isa, threads=threads, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc.stdout.split()


def test_every_isa_variant_and_thread_count(native_ext):
    """Runtime dispatch: each kernel variant this CPU can run gives MLX's answer, on 1 and 3 threads."""
    isas = isa_variants(native_ext.isa())
    for i, isa in enumerate(isas):
        threads = "1" if i % 2 == 0 else "3"
        got_isa, got_threads = _run_isa_script(isa, threads)
        assert (got_isa, got_threads) == (kernel_set_name(isa), threads)


def test_set_num_threads(native_ext):
    from mlxinfer import native

    before = native_ext.num_threads()
    try:
        native.set_num_threads(1)
        assert native_ext.num_threads() == 1 and "1 threads" in native.status()
        q, s, b = mx.quantize(mx.random.normal((200, 256)), group_size=32, bits=4)
        x = mx.random.normal((1, 256))
        one = native_ext.quantized_matmul(x, q, s, b, group_size=32, bits=4)
        native.set_num_threads(4)
        assert mx.array_equal(one, native_ext.quantized_matmul(x, q, s, b, group_size=32, bits=4))
    finally:
        native.set_num_threads(before)


def test_rapid_resizes_do_not_hang():
    """A pool resized right after it starts (workers not yet running) must not leave a worker waiting."""
    code = (
        "import mlx.core as mx\nfrom mlxinfer import native\ne = native.extension()\n"
        "for n in (3, 1, 4, 2, 5, 2) * 20: e.set_num_threads(n)\nprint(e.num_threads())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["2"], proc.stderr


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_swiglu_matches_mlx(native_ext, bits, group_size):
    import mlx.nn as nn

    mx.random.seed(4)
    g = mx.quantize(mx.random.normal((97, 256)) * 0.1, group_size=group_size, bits=bits)
    u = mx.quantize(mx.random.normal((97, 256)) * 0.1, group_size=group_size, bits=bits)
    for M in (1, 5, 20):
        x = mx.random.normal((1, M, 256))
        ref = nn.silu(mx.quantized_matmul(x, *g, group_size=group_size, bits=bits)) * mx.quantized_matmul(
            x, *u, group_size=group_size, bits=bits
        )
        for int8 in _int8_prefill_modes(native_ext, M, bits):
            with int8_activations(prefill=int8, ext=native_ext):
                out = native_ext.swiglu(x, *g, *u, group_size=group_size, bits=bits)
                mx.eval(out)
            assert_close(out, ref, INT8_TOL if int8 else 1e-4)


def test_provider_declines_what_the_kernels_do_not_cover(native_ext):
    """The provider returns None (-> MLX built-in) when the extension rejects the arguments."""
    from mlxinfer import native

    p = native.provider()
    q3, s3, b3 = mx.quantize(mx.random.normal((64, 128)), group_size=64, bits=3)
    assert p.quantized_matmul(mx.ones((1, 128)), q3, s3, b3, group_size=64, bits=3) is None
    q, s, b = mx.quantize(mx.random.normal((64, 128)), group_size=64, bits=4)
    assert p.quantized_matmul(mx.ones((1, 128)), q, s, b, group_size=64, bits=4, mode="mxfp4") is None
    assert p.quantized_matmul(mx.ones((1, 64)), q, s, b, group_size=64, bits=4) is None  # K mismatch
    assert p.quantized_matmul(mx.ones((1, 128)), q, s, b, group_size=64, bits=4) is not None
    qkv = (q, s, b)
    kw = dict(group_size=64, bits=4, n_heads=2, n_kv_heads=2, head_dim=32, rope_dims=32, traditional=False,
              base=10000.0, scale=1.0)
    assert p.qkv_rope(mx.ones((1, 1, 128)), qkv, qkv, qkv, offset=0, **kw) is not None
    assert p.qkv_rope(mx.ones((1, 1, 128), dtype=mx.float16), qkv, qkv, qkv, offset=0, **kw) is None
    assert p.qkv_rope(mx.ones((1, 1, 128)), qkv, qkv, qkv, offset=mx.array(3), **kw) is None
    x = mx.ones((1, 2, 4, 32))
    assert p.sdpa(x, x, x, scale=1.0, mask=mx.ones((4, 4), dtype=mx.bool_)) is None
    assert p.sdpa(x.astype(mx.float16), x, x, scale=1.0, mask=None) is None
    assert p.rope(x, 32, traditional=False, base=10000.0, scale=1.0, offset=0, freqs=mx.ones((16,))) is None
    assert p.rms_norm(x, mx.ones((31,)), 1e-5) is None


def test_residual_input(native_ext):
    """out = x @ w.T + residual in one op (a transformer block's skip connection); mismatches are rejected."""
    from mlxinfer import native

    q, s, b = mx.quantize(mx.random.normal((96, 256)), group_size=64, bits=4)
    for M in (1, 3, 17):
        x, r = mx.random.normal((1, M, 256)), mx.random.normal((1, M, 96))
        got = native_ext.quantized_matmul(x, q, s, b, group_size=64, bits=4, residual=r)
        assert mx.array_equal(got, native_ext.quantized_matmul(x, q, s, b, group_size=64, bits=4) + r).item()
    with pytest.raises(ValueError, match="residual"):
        native_ext.quantized_matmul(x, q, s, b, group_size=64, bits=4, residual=r[:, :1])
    assert native.provider().quantized_matmul(x, q, s, b, group_size=64, bits=4, residual=r[..., :5]) is None
