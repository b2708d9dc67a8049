"""KV-cache append (in place when possible) and attention over the valid prefix of whole cache buffers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [pytest.mark.slow,  # needs the compiled extension (built by the fixture when missing)
              # Float parity with MLX: prefill at float32 (the AVX2 int8 prefill GEMM off, as the load-time
              # self-check runs); tests/kernels/test_spec_layers.py holds the int8 default to its tolerance.
              pytest.mark.usefixtures("float_prefill")]


def _ptr(a):
    return np.asarray(a).__array_interface__["data"][0]


def test_append_matches_slice_update_and_reuses_the_buffer(native_ext):
    mx.random.seed(0)
    kb, vb = mx.random.normal((2, 3, 16, 8)), mx.random.normal((2, 3, 16, 8))
    k, v = mx.random.normal((2, 3, 4, 8)), mx.random.normal((2, 3, 4, 8))
    mx.eval(kb, vb, k, v)
    ref_k, ref_v = mx.array(kb), mx.array(vb)
    ref_k[..., 5:9, :] = k
    ref_v[..., 5:9, :] = v
    mx.eval(ref_k, ref_v)
    before = _ptr(kb)
    kb, vb = native_ext.kv_append(kb, vb, k, v, offset=5)  # the old buffers are not referenced any more
    mx.eval(kb, vb)
    assert mx.array_equal(kb, ref_k).item() and mx.array_equal(vb, ref_v).item()
    assert _ptr(kb) == before  # written in place


def test_append_copies_when_the_buffer_is_shared_or_strided(native_ext):
    kb = mx.zeros((1, 2, 8, 4))
    k = mx.ones((1, 2, 1, 4))
    mx.eval(kb, k)
    out_k, _ = native_ext.kv_append(kb, kb, k, k, offset=3)
    mx.eval(out_k)
    assert mx.array_equal(kb, mx.zeros((1, 2, 8, 4))).item()  # the original is untouched
    assert out_k[0, 0, 3].tolist() == [1, 1, 1, 1] and out_k.sum().item() == 8
    big = mx.zeros((1, 2, 12, 4))
    view = big[:, :, 2:10, :]  # a strided view as the cache buffer
    out_k, _ = native_ext.kv_append(view, view, k, k, offset=7)
    assert out_k.shape == (1, 2, 8, 4) and out_k[0, 1, 7].tolist() == [1, 1, 1, 1] and out_k.sum().item() == 8
    with pytest.raises(ValueError, match="room"):
        native_ext.kv_append(kb, kb, k, k, offset=8)


def _strided_views():
    """(name, view): the strided layouts a KV buffer or update reaches the native ops in."""
    mx.random.seed(3)
    base = mx.random.normal((3, 2, 11, 8)).astype(mx.float16)
    wide = mx.random.normal((3, 2, 8, 11)).astype(mx.float16)
    row = mx.random.normal((1, 2, 9, 8)).astype(mx.float16)
    mx.eval(base, wide, row)
    return [
        ("length-sliced", base[:, :, 2:, :]),               # BatchKVCache.filter dropping leading padding
        ("rows-and-length", base[::2, :, 1:10, :]),         # a gather-free row pick plus a slice
        ("last-dim-strided", wide.swapaxes(2, 3)[:, :, :9, :]),  # no contiguous run at all
        ("broadcast-rows", mx.broadcast_to(row, (3, 2, 9, 8))),  # stride 0 in the batch dim
    ]


@pytest.mark.parametrize("case", range(4))
def test_strided_buffers_and_sources_copy_exactly(native_ext, case):
    """Strided inputs are copied to row-major before the kernels read them; the copy moves contiguous runs at
    once (it was one call per element: ~0.4 s a decode step for a server batch after a row left)."""
    name, view = _strided_views()[case]
    want = np.asarray(view.astype(mx.float32))
    B, H, S, D = view.shape
    k = mx.ones((B, H, 1, D), dtype=mx.float16)
    out_k, _ = native_ext.kv_append(view, view, k, k, offset=S - 1)
    got = np.asarray(out_k.astype(mx.float32))
    assert np.array_equal(got[:, :, :S - 1], want[:, :, :S - 1]), name
    assert (got[:, :, S - 1] == 1).all(), name
    fresh = native_ext.kv_reserve([B, H, S + 4, D], view, valid=S, half=True)
    got = np.asarray(fresh.astype(mx.float32))
    assert np.array_equal(got[:, :, :S], want) and not got[:, :, S:].any(), name


@pytest.mark.parametrize("L,kv_len", [(1, 37), (5, 20), (1, 300)])
def test_sdpa_kv_len_reads_only_the_valid_prefix(native_ext, L, kv_len):
    mx.random.seed(L + kv_len)
    q = mx.random.normal((1, 6, L, 16))
    kb, vb = mx.random.normal((1, 2, 512, 16)), mx.random.normal((1, 2, 512, 16))
    causal = L > 1
    ref = native_ext.sdpa(q, kb[:, :, :kv_len], vb[:, :, :kv_len], scale=0.25, causal=causal)
    out = native_ext.sdpa(q, kb, vb, scale=0.25, causal=causal, kv_len=kv_len)
    assert mx.allclose(out, ref, atol=1e-6).item()
    with pytest.raises(ValueError, match="kv_len"):
        native_ext.sdpa(q, kb, vb, scale=0.25, kv_len=513)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_model_decode_across_cache_growth_matches_builtin(native_ext, rope_scaling):
    """A tiny llama (plain and Llama-3 scaled RoPE) decoding past the KV buffer's 256-step growth: the fused path
    (native append, attention over whole buffers, folded norms) gives the built-in logits at every step."""
    import mlx.nn as nn
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from mlxinfer.kernels.patch import apply_kernels

    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300, tie_word_embeddings=True,
        rope_scaling=rope_scaling, max_position_embeddings=1024,
    ))
    nn.quantize(model, group_size=32, bits=4)
    prompt = mx.array([list(range(250))]) % 300
    logits = {}
    for mode in ("builtin", "custom"):
        report = apply_kernels(model, mode)
        assert mode == "builtin" or ("2 fused q/k/v" in report.detail and "2 blocks with fused skip" in report.detail)
        cache, steps = make_prompt_cache(model), []
        steps.append(model(prompt, cache=cache)[:, -1])
        for t in range(12):  # 250 + 12 crosses 256
            steps.append(model(mx.array([[t + 7]]), cache=cache)[:, -1])
        mx.eval(steps)
        logits[mode] = steps
        assert cache[0].offset == 262
    apply_kernels(model, "builtin")
    assert type(model.model.layers[0]) is llama.TransformerBlock and type(model.model.layers[0].mlp) is llama.MLP
    for a, b in zip(logits["builtin"], logits["custom"]):
        assert mx.abs(a - b).max().item() <= 1e-3 * mx.abs(a).max().item()
