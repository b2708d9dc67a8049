"""The fused attention-input op (q/k/v projections, head split, RoPE) against MLX's own composition."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytestmark = [pytest.mark.slow,  # needs the compiled extension (built by the fixture when missing)
              # Float parity with MLX: prefill at float32 (the AVX2 int8 prefill GEMM off, as the load-time
              # self-check runs); tests/kernels/test_spec_layers.py holds the int8 default to its tolerance.
              pytest.mark.usefixtures("float_prefill")]


def _reference(x, ws, n_heads, n_kv_heads, head_dim, dims, traditional, base, scale, offset, group_size, bits):
    B, L, _ = x.shape
    outs = []
    for (w, s, b), heads, roped in ((ws[0], n_heads, True), (ws[1], n_kv_heads, True), (ws[2], n_kv_heads, False)):
        y = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
        y = y.reshape(B, L, heads, head_dim).transpose(0, 2, 1, 3)
        if roped and dims:
            y = mx.fast.rope(y, dims, traditional=traditional, base=base, scale=scale, offset=offset)
        outs.append(y)
    return outs


# (B, L, hidden, n_heads, n_kv_heads, head_dim, rope dims, traditional, offset, group_size, bits)
CASES = [
    (1, 1, 576, 9, 3, 64, 64, False, 37, 32, 4),  # SmolLM2 decode
    (1, 1, 256, 8, 2, 32, 32, True, 1000, 64, 8),  # traditional RoPE, 8-bit
    (2, 5, 256, 4, 2, 64, 32, False, 3, 64, 4),  # batch, several positions, partial rotary
    (1, 20, 128, 4, 4, 32, 32, False, 0, 128, 4),  # prefill-sized (the tiled path), no GQA
]


@pytest.mark.parametrize("case", CASES)
def test_matches_mlx(native_ext, case):
    B, L, hidden, hq, hkv, D, dims, trad, offset, gs, bits = case
    mx.random.seed(sum(case))
    ws = [mx.quantize(mx.random.normal((n * D, hidden)) * 0.2, group_size=gs, bits=bits) for n in (hq, hkv, hkv)]
    x = mx.random.normal((B, L, hidden))
    got = native_ext.qkv_rope(x, list(ws[0]), list(ws[1]), list(ws[2]), group_size=gs, bits=bits, n_heads=hq,
                              n_kv_heads=hkv, head_dim=D, rope_dims=dims, traditional=trad, base=10000.0, scale=1.0,
                              offset=offset)
    ref = _reference(x, ws, hq, hkv, D, dims, trad, 10000.0, 1.0, offset, gs, bits)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == mx.float32
        err = mx.abs(g - r).max().item()
        assert err <= 1e-4 * mx.abs(r).max().item(), err



@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
def test_half_scales_give_the_float32_result(native_ext, case, scale_dtype):
    """Scales/biases kept as stored (what the CPU loader does with a float16/bfloat16 model) give exactly the
    result of their float32 copies, decode and prefill (the batched decode path runs this op too)."""
    B, L, hidden, hq, hkv, D, dims, trad, offset, gs, bits = case
    mx.random.seed(sum(case))
    half = [[w, s.astype(scale_dtype), b.astype(scale_dtype)] for w, s, b in
            (mx.quantize(mx.random.normal((n * D, hidden)) * 0.2, group_size=gs, bits=bits) for n in (hq, hkv, hkv))]
    wide = [[w, s.astype(mx.float32), b.astype(mx.float32)] for w, s, b in half]
    x = mx.random.normal((B, L, hidden))
    kw = dict(group_size=gs, bits=bits, n_heads=hq, n_kv_heads=hkv, head_dim=D, rope_dims=dims, traditional=trad,
              base=10000.0, scale=1.0, offset=offset)
    for g, w in zip(native_ext.qkv_rope(x, *half, **kw), native_ext.qkv_rope(x, *wide, **kw)):
        assert g.dtype == mx.float32 and mx.array_equal(g, w).item()

def test_rejects_bad_arguments(native_ext):
    ws = [mx.quantize(mx.random.normal((n * 32, 64)), group_size=32, bits=4) for n in (2, 1, 1)]
    x = mx.random.normal((1, 1, 64))
    kw = dict(group_size=32, bits=4, n_heads=2, n_kv_heads=1, head_dim=32, rope_dims=32, traditional=False,
              base=10000.0, scale=1.0, offset=0)
    with pytest.raises(ValueError, match="heads"):
        native_ext.qkv_rope(x, list(ws[0]), list(ws[1]), list(ws[2]), **{**kw, "n_heads": 3})
    with pytest.raises(ValueError, match="rope"):
        native_ext.qkv_rope(x, list(ws[0]), list(ws[1]), list(ws[2]), **{**kw, "rope_dims": 33})
    with pytest.raises(ValueError, match="float32"):
        native_ext.qkv_rope(x.astype(mx.float16), list(ws[0]), list(ws[1]), list(ws[2]), **kw)


def test_rms_norm_folded_in(native_ext):
    """norm_weight/norm_eps: x is RMS-normalised inside the op (the block's input_layernorm)."""
    mx.random.seed(9)
    ws = [mx.quantize(mx.random.normal((n * 64, 256)) * 0.2, group_size=64, bits=4) for n in (4, 2, 2)]
    x, w = mx.random.normal((1, 3, 256)) * 3.0, mx.random.normal((256,))
    kw = dict(group_size=64, bits=4, n_heads=4, n_kv_heads=2, head_dim=64, rope_dims=64, traditional=False,
              base=10000.0, scale=1.0, offset=2)
    got = native_ext.qkv_rope(x, list(ws[0]), list(ws[1]), list(ws[2]), norm_weight=w, norm_eps=1e-5, **kw)
    ref = native_ext.qkv_rope(mx.fast.rms_norm(x, w, 1e-5), list(ws[0]), list(ws[1]), list(ws[2]), **kw)
    for g, r in zip(got, ref):
        assert mx.abs(g - r).max().item() <= 1e-5 * mx.abs(r).max().item()
    g, u = (mx.quantize(mx.random.normal((96, 256)) * 0.1, group_size=64, bits=4) for _ in range(2))
    got = native_ext.swiglu(x, *g, *u, group_size=64, bits=4, norm_weight=w, norm_eps=1e-5)
    ref = native_ext.swiglu(mx.fast.rms_norm(x, w, 1e-5), *g, *u, group_size=64, bits=4)
    assert mx.abs(got - ref).max().item() <= 1e-5 * mx.abs(ref).max().item()
    with pytest.raises(ValueError, match="norm"):
        native_ext.swiglu(x, *g, *u, group_size=64, bits=4, norm_weight=w[:10], norm_eps=1e-5)


def test_rope_periods_as_llama3(native_ext):
    """freqs (Llama-3 scaled RoPE periods, as mx.fast.rope's freqs) instead of base."""
    mx.random.seed(12)
    ws = [mx.quantize(mx.random.normal((n * 64, 128)) * 0.2, group_size=64, bits=4) for n in (2, 1, 1)]
    x = mx.random.normal((1, 2, 128))
    freqs = 10000.0 ** (mx.arange(0, 64, 2) / 64) * mx.linspace(1.0, 8.0, 32)
    q, k, _ = native_ext.qkv_rope(x, list(ws[0]), list(ws[1]), list(ws[2]), group_size=64, bits=4, n_heads=2,
                                  n_kv_heads=1, head_dim=64, rope_dims=64, traditional=False, base=0.0, scale=1.0,
                                  offset=700, freqs=freqs)
    for got, (w, s_, b), h in ((q, ws[0], 2), (k, ws[1], 1)):
        y = mx.quantized_matmul(x, w, s_, b, group_size=64, bits=4).reshape(1, 2, h, 64).transpose(0, 2, 1, 3)
        ref = mx.fast.rope(y, 64, traditional=False, base=None, scale=1.0, offset=700, freqs=freqs)
        assert mx.abs(got - ref).max().item() <= 1e-4 * mx.abs(ref).max().item()
