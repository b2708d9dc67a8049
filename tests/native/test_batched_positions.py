"""The native ops with per-batch-row positions that a left-padded mlx-lm ``BatchKVCache`` needs: attention with
a per-row first key (``start``), RoPE / q-k-v projections with one offset per row, and the KV append into float16
buffers. Each is held to MLX's built-in with the mask / offsets mlx-lm builds."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

pytestmark = pytest.mark.slow  # needs the compiled extension


@pytest.mark.parametrize(
    "pads,Hq,Hkv,L,S,D,kv_dtype",
    [
        ([0, 3, 7, 1], 4, 2, 1, 20, 64, mx.float32),    # decode step of 4 left-padded rows
        ([5, 0], 9, 3, 1, 77, 64, mx.float16),          # float16 KV cache (what the one-op layers keep)
        ([2, 0, 4], 4, 1, 6, 6, 32, mx.float32),        # prefill of a left-padded batch: padded queries see nothing
        ([1, 6, 0], 4, 2, 5, 12, 32, mx.float32),       # a chunk over a cache: row 1's first queries are padding
        ([0, 300, 17], 9, 3, 1, 700, 64, mx.float16),   # long decode: split-K, a whole split before a row's start
        ([40, 0], 2, 1, 3, 64, 16, mx.float32),         # a chunk after a cached prefix
    ],
)
def test_sdpa_start_matches_batch_mask(native_ext, pads, Hq, Hkv, L, S, D, kv_dtype):
    B = len(pads)
    mx.random.seed(S + L)
    q = mx.random.normal((B, Hq, L, D))
    k = mx.random.normal((B, Hkv, S + 9, D)).astype(kv_dtype)  # whole buffers; the first S keys count
    v = mx.random.normal((B, Hkv, S + 9, D)).astype(kv_dtype)
    start = mx.array(pads)
    mask = create_causal_mask(L, offset=S - L, left_padding=start)  # BatchKVCache.make_mask before the update
    ref = mx.fast.scaled_dot_product_attention(q, k[:, :, :S].astype(mx.float32), v[:, :, :S].astype(mx.float32),
                                               scale=D**-0.5, mask=mask)
    out = native_ext.sdpa(q, k, v, scale=D**-0.5, causal=L > 1, kv_len=S, start=start)
    # Query rows before a row's start see no key: MLX then averages every value, the kernel gives zeros; both are
    # padding that nothing reads.
    real = [(b, i) for b in range(B) for i in range(L) if S - L + i >= pads[b]]
    for b, i in real:
        got, want = out[b, :, i], ref[b, :, i]
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), (b, i, mx.abs(got - want).max().item())
    heads_last = native_ext.sdpa(q, k, v, scale=D**-0.5, causal=L > 1, kv_len=S, start=start, heads_last=True)
    assert mx.array_equal(heads_last, out.transpose(0, 2, 1, 3).reshape(B, L, -1)).item()


def test_sdpa_start_rejects_a_wrong_shape(native_ext):
    q, k = mx.zeros((2, 2, 1, 8)), mx.zeros((2, 2, 4, 8))
    with pytest.raises(ValueError, match="start"):
        native_ext.sdpa(q, k, k, scale=1.0, start=mx.array([0, 1, 2]))
    with pytest.raises(ValueError, match="start"):
        native_ext.sdpa(q, k, k, scale=1.0, start=mx.array([0.0, 1.0]))


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_per_row_offsets(native_ext, traditional):
    mx.random.seed(1)
    x = mx.random.normal((3, 4, 2, 32))
    offsets = mx.array([-2, 0, 513])  # a padding row goes negative, as BatchKVCache.offset does
    want = mx.fast.rope(x, 24, traditional=traditional, base=10000.0, scale=1.0, offset=offsets)
    got = native_ext.rope(x, dims=24, traditional=traditional, base=10000.0, scale=1.0, offset=0, offsets=offsets)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), mx.abs(got - want).max().item()


def test_qkv_rope_per_row_offsets_match_one_row_at_a_time(native_ext):
    mx.random.seed(2)
    hidden, hq, hkv, d = 64, 4, 2, 16
    x = mx.random.normal((3, 2, hidden))
    ws = [mx.quantize(mx.random.normal((h * d, hidden)) / 8, group_size=32, bits=4) for h in (hq, hkv, hkv)]
    kw = dict(group_size=32, bits=4, n_heads=hq, n_kv_heads=hkv, head_dim=d, rope_dims=d, traditional=False,
              base=10000.0, scale=1.0)
    offsets = [7, -1, 30]
    q, k, v = native_ext.qkv_rope(x, *[list(w) for w in ws], offset=0, offsets=mx.array(offsets), **kw)
    for b, off in enumerate(offsets):
        qb, kb, vb = native_ext.qkv_rope(x[b:b + 1], *[list(w) for w in ws], offset=off, **kw)
        for got, want in ((q, qb), (k, kb), (v, vb)):
            assert mx.allclose(got[b:b + 1], want, atol=1e-5, rtol=1e-5).item()


def test_kv_append_converts_into_float16_buffers(native_ext):
    mx.random.seed(3)
    kb = mx.random.normal((2, 3, 16, 8)).astype(mx.float16)
    vb = mx.random.normal((2, 3, 16, 8)).astype(mx.float16)
    k, v = mx.random.normal((2, 3, 1, 8)), mx.random.normal((2, 3, 1, 8))
    ref_k, ref_v = mx.array(kb), mx.array(vb)
    ref_k[..., 9:10, :] = k
    ref_v[..., 9:10, :] = v
    out_k, out_v = native_ext.kv_append(kb, vb, k, v, offset=9)
    assert out_k.dtype == mx.float16
    assert mx.array_equal(out_k, ref_k).item() and mx.array_equal(out_v, ref_v).item()
