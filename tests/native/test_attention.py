"""Native attention against mx.fast.scaled_dot_product_attention (decode and causal prefill, GQA, cache views)."""

from __future__ import annotations

import mlx.core as mx
import pytest

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
