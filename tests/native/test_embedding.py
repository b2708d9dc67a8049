"""The native quantized embedding lookup against nn.QuantizedEmbedding (mx.dequantize of gathered rows)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64)])
def test_matches_quantized_embedding(native_ext, bits, group_size):
    mx.random.seed(bits + group_size)
    emb = nn.QuantizedEmbedding(300, 256, group_size=group_size, bits=bits)
    for ids in (mx.array([[5]]), mx.array([[0, 299, 7, 7]]), mx.array([3, 1, 4], dtype=mx.uint32),
                mx.array([[1, 2], [3, 4]], dtype=mx.int64)):
        ref = emb(ids)
        out = native_ext.quantized_embedding(ids, emb["weight"], emb["scales"], emb["biases"],
                                             group_size=group_size, bits=bits)
        assert out.shape == ref.shape and out.dtype == mx.float32
        assert mx.array_equal(out, ref).item()  # same float32 s * q + b, no accumulation


def test_out_of_range_ids_give_zero_rows_and_bad_args_raise(native_ext):
    emb = nn.QuantizedEmbedding(10, 64, group_size=32, bits=4)
    out = native_ext.quantized_embedding(mx.array([-1, 10, 2]), emb["weight"], emb["scales"], emb["biases"],
                                         group_size=32, bits=4)
    assert mx.array_equal(out[:2], mx.zeros((2, 64))).item() and mx.array_equal(out[2], emb(mx.array([2]))[0]).item()
    with pytest.raises(ValueError, match="ids"):
        native_ext.quantized_embedding(mx.array([1.0]), emb["weight"], emb["scales"], emb["biases"],
                                       group_size=32, bits=4)
    with pytest.raises(ValueError, match="share a float dtype"):
        native_ext.quantized_embedding(mx.array([1]), emb["weight"], emb["scales"].astype(mx.float16),
                                       emb["biases"], group_size=32, bits=4)


@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
def test_half_scales_give_float32_rows(native_ext, scale_dtype):
    """Scales/biases as stored (float16/bfloat16, as the CPU loader keeps them): the rows are float32 and equal
    the float32 lookup of the same (exactly widened) scales."""
    emb = nn.QuantizedEmbedding(300, 256, group_size=64, bits=4)
    s, b = emb["scales"].astype(scale_dtype), emb["biases"].astype(scale_dtype)
    ids = mx.array([[0, 299, 7, 7]])
    out = native_ext.quantized_embedding(ids, emb["weight"], s, b, group_size=64, bits=4)
    emb.scales, emb.biases = s.astype(mx.float32), b.astype(mx.float32)
    assert out.dtype == mx.float32 and mx.array_equal(out, emb(ids)).item()
