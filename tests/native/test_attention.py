"""Native attention against mx.fast.scaled_dot_product_attention (decode and causal prefill, GQA, cache views)."""

from __future__ import annotations

import textwrap

import mlx.core as mx
import pytest
from isa_variants import isa_variants, run_under_isa

pytestmark = pytest.mark.slow  # needs the compiled extension


@pytest.mark.parametrize(
    "B,Hq,Hkv,L,S,D,causal",
    [
        (1, 9, 3, 1, 1, 64, False),     # first decode step
        (1, 9, 3, 1, 77, 64, False),    # decode over a cache, GQA 3:1
        (2, 4, 4, 5, 40, 32, True),     # a short chunk after a cached prefix
        (1, 9, 3, 70, 70, 64, True),    # prefill
        (1, 8, 2, 3, 100, 72, False),   # head dim not a multiple of 16
        (1, 2, 1, 17, 50, 16, True),
        (1, 9, 3, 1, 2048, 64, False),  # long decode: keys split over the threads, partials combined
        (1, 9, 3, 4, 600, 64, True),    # multi-token decode chunk: each row sees a different key count
        (2, 8, 2, 2, 700, 128, True),
        (1, 9, 3, 300, 300, 64, True),  # prefill over several query blocks
        (1, 2, 1, 300, 300, 32, True),  # few units: prefill splits keys too, early blocks see none of a split
        (1, 9, 3, 129, 129, 64, False),
        (1, 16, 1, 3, 257, 64, True),   # a 16-head group
        (1, 3, 3, 130, 200, 7, True),   # head dim below one vector
        (1, 4, 1, 1, 513, 100, False),
    ],
)
def test_matches_mlx(native_ext, B, Hq, Hkv, L, S, D, causal):
    mx.random.seed(S)
    q = mx.random.normal((B, Hq, L, D))
    # k/v as mlx-lm's KVCache hands them over: a slice of a larger preallocated buffer.
    k = mx.random.normal((B, Hkv, S + 7, D))[:, :, :S]
    v = mx.random.normal((B, Hkv, S + 7, D))[:, :, :S]
    mask = "causal" if causal else None
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    out = native_ext.sdpa(q, k, v, scale=D**-0.5, causal=causal)
    assert out.shape == ref.shape
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5), mx.abs(out - ref).max().item()


@pytest.mark.parametrize("L,S,D,causal", [(1, 77, 64, False), (1, 2048, 64, False), (5, 300, 72, True),
                                           (40, 40, 64, True), (1, 30, 7, False)])
def test_float16_kv(native_ext, L, S, D, causal):
    """A float16 KV cache (what the one-op layers keep): K/V widened as loaded, the same result as MLX's float32
    attention over those float16 values (test_every_isa_variant_and_thread_count runs it on each ISA body)."""
    mx.random.seed(L + S)
    q = mx.random.normal((1, 9, L, D))
    k = mx.random.normal((1, 3, S + 5, D)).astype(mx.float16)[:, :, :S]
    v = mx.random.normal((1, 3, S + 5, D)).astype(mx.float16)[:, :, :S]
    mask = "causal" if causal else None
    ref = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float32), v.astype(mx.float32), scale=D**-0.5,
                                               mask=mask)
    out = native_ext.sdpa(q, k, v, scale=D**-0.5, causal=causal)
    assert out.dtype == mx.float32
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5), mx.abs(out - ref).max().item()
    with pytest.raises(ValueError, match="float16"):
        native_ext.sdpa(q, k, v.astype(mx.float32), scale=0.1)


def test_peaked_scores(native_ext):
    """Large scores: most probabilities underflow to 0 (exp of very negative and -inf inputs). Scores this large
    lose digits in float32 either way, so both kernels are held to a float64 reference."""
    np = pytest.importorskip("numpy")
    mx.random.seed(7)
    L, S = 3, 900
    q = 40.0 * mx.random.normal((1, 9, L, 64))
    k = mx.random.normal((1, 3, S, 64))
    v = mx.random.normal((1, 3, S, 64))
    out = native_ext.sdpa(q, k, v, scale=0.125, causal=True)
    qn, kn, vn = (np.array(a).astype(np.float64) for a in (q, k, v))
    s = qn @ np.repeat(kn, 3, axis=1).transpose(0, 1, 3, 2) * 0.125
    s[..., np.arange(S)[None, :] > np.arange(L)[:, None] + S - L] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ np.repeat(vn, 3, axis=1)
    assert (p < 1e-38).mean() > 0.5  # the case this test is about
    mlx_err = np.abs(np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")) - ref).max()
    assert np.abs(np.array(out) - ref).max() <= max(1e-5, mlx_err)


_ISA_SCRIPT = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    from mlxinfer import native
    ext = native.extension()
    print(ext.isa(), ext.num_threads())
    mx.random.seed(5)
    for B, Hq, Hkv, L, S, D, causal in [(1, 9, 3, 1, 1500, 64, False), (1, 9, 3, 8, 1100, 64, True),
                                        (1, 6, 2, 200, 260, 48, True), (1, 2, 1, 1, 70, 72, False)]:
        q = mx.random.normal((B, Hq, L, D))
        for dt in (mx.float32, mx.float16):  # float16: a float16 KV cache, widened per ISA as it is loaded
            k = mx.random.normal((B, Hkv, S + 3, D)).astype(dt)[:, :, :S]
            v = mx.random.normal((B, Hkv, S + 3, D)).astype(dt)[:, :, :S]
            mask = "causal" if causal else None
            ref = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float32), v.astype(mx.float32),
                                                       scale=D**-0.5, mask=mask)
            out = ext.sdpa(q, k, v, scale=D**-0.5, causal=causal)
            if not mx.allclose(out, ref, atol=1e-5, rtol=1e-5).item():
                sys.exit(f"{(B, Hq, Hkv, L, S, D, causal, dt)} err={mx.abs(out - ref).max().item()}")
    """
)


def test_every_isa_variant_and_thread_count(native_ext):
    """Each attention body this CPU can run (generic, avx2, avx512 — the VNNI set uses avx512's — or neon) on 1
    and 3 threads gives MLX's answer."""
    for isa in isa_variants(native_ext.isa()):
        for threads in ("1", "3"):
            proc = run_under_isa(_ISA_SCRIPT, isa, threads=threads, timeout=120)
            assert proc.returncode == 0, proc.stderr + proc.stdout
            got_isa, got_threads = proc.stdout.split()[:2]
            assert (got_isa.split("+")[0], got_threads) == (isa, threads)  # "+int8-prefill" under MLXINFER_PREFILL


def test_transposed_query(native_ext):
    q = mx.random.normal((1, 6, 4, 32)).transpose(0, 2, 1, 3)  # (B, L, H, D) -> (B, H, L, D) view
    k = mx.random.normal((1, 2, 9, 32))
    ref = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.2, mask="causal")
    assert mx.allclose(native_ext.sdpa(q, k, k, scale=0.2, causal=True), ref, atol=1e-5)


def test_provider_declines_what_it_does_not_cover(native_ext):
    from mlxinfer import native

    p = native.provider()
    q, k = mx.zeros((1, 4, 2, 32)), mx.zeros((1, 2, 8, 32))
    assert p.sdpa(q, k, k, scale=1.0, mask=mx.zeros((2, 8))) is None           # array mask
    assert p.sdpa(q.astype(mx.float16), k, k, scale=1.0, mask=None) is None    # not float32
    assert p.sdpa(q, k, k, scale=1.0, mask="causal") is not None
    w, s, b = mx.quantize(mx.zeros((32, 64)), group_size=32, bits=4)
    x = mx.zeros((1, 64))
    assert p.quantized_matmul(x, w, s, b, group_size=32, bits=4) is not None
    assert p.quantized_matmul(x, w, s, None, group_size=32, bits=4) is None
    assert p.quantized_matmul(x, w, s, b, group_size=32, bits=4, mode="mxfp4") is None
    w3, s3, b3 = mx.quantize(mx.zeros((32, 64)), group_size=32, bits=3)
    assert p.quantized_matmul(x, w3, s3, b3, group_size=32, bits=3) is None


def test_rms_norm_and_rope_match_mlx(native_ext):
    from mlxinfer import native

    p = native.provider()
    x, w = mx.random.normal((2, 3, 576)), mx.random.normal((576,))
    assert mx.allclose(p.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5), atol=1e-5)
    for traditional in (True, False):
        for dims, L, offset in [(64, 1, 0), (64, 1, 137), (32, 7, 5), (64, 40, 0)]:
            x = mx.random.normal((1, 9, L, 64))
            ref = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=offset)
            out = p.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=offset)
            assert mx.allclose(out, ref, atol=2e-5), (traditional, dims, L, offset)
    assert p.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=mx.array(3)) is None  # array offset
    assert p.rms_norm(x.astype(mx.float16), mx.ones((64,), mx.float16), 1e-5) is None


@pytest.mark.parametrize("L,S,causal", [(1, 40, False), (1, 3000, False), (7, 7, True), (100, 300, True)])
def test_heads_last_layout(native_ext, L, S, causal):
    """heads_last writes (B, L, heads * D): the o_proj input without a transpose copy."""
    mx.random.seed(L + S)
    q, k, v = mx.random.normal((2, 6, L, 32)), mx.random.normal((2, 2, S, 32)), mx.random.normal((2, 2, S, 32))
    ref = native_ext.sdpa(q, k, v, scale=0.2, causal=causal)
    out = native_ext.sdpa(q, k, v, scale=0.2, causal=causal, heads_last=True)
    assert out.shape == (2, L, 6 * 32) and mx.array_equal(out, ref.transpose(0, 2, 1, 3).reshape(2, L, -1)).item()
