"""The whole-layer op (``decoder_block``) and the in-place KV-cache promise ``kernels.fused_block`` keeps for it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)


def _reference(x, ws, n1, n2, k_old, v_old, c, freqs, causal, extras):
    """The layer in MLX ops: returns (y, keys, values) with keys/values the whole valid cache."""
    gs, bits, hq, hkv, D, dims, trad, base, rscale, ascale, e1, e2, qkv_bias, qk_norm, qk_eps = c
    B, L, _ = x.shape
    mm = lambda a, t: mx.quantized_matmul(a, *t, transpose=True, group_size=gs, bits=bits)  # noqa: E731
    rope = lambda a: mx.fast.rope(a, dims, traditional=trad, base=None if freqs is not None else base,  # noqa: E731
                                  scale=rscale, offset=k_old.shape[2], freqs=freqs)
    heads = lambda a, n: a.reshape(B, L, n, D).transpose(0, 2, 1, 3)  # noqa: E731
    xn = mx.fast.rms_norm(x, n1, e1)
    q, k, v = mm(xn, ws[0]), mm(xn, ws[1]), mm(xn, ws[2])
    if qkv_bias:  # Qwen2
        q, k, v = q + extras[0], k + extras[1], v + extras[2]
    q, k, v = heads(q, hq), heads(k, hkv), heads(v, hkv)
    if qk_norm:  # Qwen3: per head, before RoPE
        q, k = mx.fast.rms_norm(q, extras[-2], qk_eps), mx.fast.rms_norm(k, extras[-1], qk_eps)
    q, k = rope(q), rope(k)
    keys, values = mx.concatenate([k_old, k], axis=2), mx.concatenate([v_old, v], axis=2)
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=ascale, mask="causal" if causal else None)
    h = x + mm(o.transpose(0, 2, 1, 3).reshape(B, L, -1), ws[3])
    hn = mx.fast.rms_norm(h, n2, e2)
    return h + mm(nn.silu(mm(hn, ws[4])) * mm(hn, ws[5]), ws[6]), keys, values


# (B, L, hidden, intermediate, n_heads, n_kv_heads, head_dim, rope dims, traditional, offset, group, bits, llama3,
#  q/k/v bias, q/k norm, float16 KV cache)
CASES = [
    (1, 1, 576, 1536, 9, 3, 64, 64, False, 37, 32, 4, False, False, False, False),  # SmolLM2 decode
    (1, 1, 576, 1536, 9, 3, 64, 64, False, 37, 32, 4, False, False, False, True),  # ... with a float16 cache
    (2, 5, 256, 384, 4, 2, 64, 32, False, 3, 64, 4, False, False, False, False),  # batch, prefill chunk, partial
    (2, 5, 256, 384, 4, 2, 64, 32, False, 3, 64, 4, False, False, False, True),  # rotary (and float16)
    (1, 1, 256, 512, 8, 2, 32, 32, True, 200, 64, 8, False, False, False, True),  # traditional, 8-bit, split-K
    (1, 3, 128, 256, 4, 4, 32, 32, False, 0, 128, 4, True, False, False, False),  # first chunk, no GQA, Llama-3
    (1, 2, 256, 384, 4, 2, 64, 64, False, 9, 64, 4, False, True, False, False),  # Qwen2: q/k/v biases
    (2, 1, 256, 384, 4, 2, 64, 64, False, 9, 64, 4, False, False, True, True),  # Qwen3: per-head q/k RMSNorms
]


@pytest.mark.parametrize("case", CASES)
def test_matches_mlx_and_writes_the_cache_in_place(native_ext, case):
    B, L, E, I, hq, hkv, D, dims, trad, offset, gs, bits, llama3, qkv_bias, qk_norm, half = case
    mx.random.seed(sum(case))
    shapes = [(hq * D, E), (hkv * D, E), (hkv * D, E), (E, hq * D), (I, E), (I, E), (E, I)]
    ws = [mx.quantize(mx.random.normal(s) * 0.1, group_size=gs, bits=bits) for s in shapes]
    n1, n2 = 1 + 0.1 * mx.random.normal((E,)), 1 + 0.1 * mx.random.normal((E,))
    x = mx.random.normal((B, L, E))
    freqs = mx.power(10000.0, mx.arange(0, dims, 2) / dims) * (1 + mx.arange(dims // 2) / dims) if llama3 else None
    k_old, v_old = mx.random.normal((B, hkv, offset, D)), mx.random.normal((B, hkv, offset, D))
    cap = offset + L + 7
    k_buf = native_ext.kv_reserve([B, hkv, cap, D], k_old if offset else None, valid=offset, half=half)
    v_buf = native_ext.kv_reserve([B, hkv, cap, D], v_old if offset else None, valid=offset, half=half)
    if half:  # the reference sees what the cache holds
        k_old, v_old = k_old.astype(mx.float16).astype(mx.float32), v_old.astype(mx.float16).astype(mx.float32)
    mx.eval(k_buf, v_buf)
    c = (gs, bits, hq, hkv, D, dims, trad, 10000.0, 1.0, D**-0.5, 1e-5, 1e-5, qkv_bias, qk_norm, 1e-6)
    extras = [mx.random.normal((n * D,)) for n in (hq, hkv, hkv)] if qkv_bias else []
    extras += [1 + 0.2 * mx.random.normal((D,)) for _ in range(2)] if qk_norm else []
    weights = [a for t in ws for a in t] + [n1, n2] + extras
    y, k2, v2 = native_ext.decoder_block(x, weights, k_buf, v_buf, offset, L > 1, c, freqs)
    ref_y, ref_k, ref_v = _reference(x, ws, n1, n2, k_old, v_old, c, freqs, L > 1, extras)
    mx.eval(y, k2, v2)
    assert y.shape == x.shape and k2.shape == (B, hkv, cap, D) and y.dtype == mx.float32
    assert k2.dtype == (mx.float16 if half else mx.float32)
    tol = 2e-3 if half else 2e-4  # float16 keeps 11 significant bits
    assert mx.abs(y - ref_y).max().item() <= tol * mx.abs(ref_y).max().item()
    for got, ref in ((k2, ref_k), (v2, ref_v)):
        assert mx.abs(got[:, :, : offset + L] - ref).max().item() <= tol * mx.abs(ref).max().item()
        assert mx.all(got[:, :, offset + L:] == 0).item()  # kv_reserve's zeros past the new positions
    # In place: the input buffers hold the new positions too (the outputs are their memory).
    assert mx.array_equal(k_buf, k2).item() and mx.array_equal(v_buf, v2).item()


def test_rejects_bad_arguments(native_ext):
    ws = [mx.quantize(mx.random.normal(s), group_size=32, bits=4) for s in
          [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)]]
    weights = [a for t in ws for a in t] + [mx.ones((64,)), mx.ones((64,))]
    kb = native_ext.kv_reserve([1, 1, 8, 32])
    c = (32, 4, 2, 1, 32, 32, False, 10000.0, 1.0, 0.18, 1e-5, 1e-5, False, False, 0.0)
    x = mx.random.normal((1, 1, 64))
    native_ext.decoder_block(x, weights, kb, kb, 0, False, c)  # accepted
    with pytest.raises(ValueError, match="room"):
        native_ext.decoder_block(x, weights, kb, kb, 8, False, c)
    with pytest.raises(ValueError, match="projection 3"):
        native_ext.decoder_block(x, weights[:9] + weights[12:15] + weights[9:12] + weights[15:], kb, kb, 0, False, c)
    with pytest.raises(ValueError, match="float32"):
        native_ext.decoder_block(x.astype(mx.float16), weights, kb, kb, 0, False, c)
    with pytest.raises(ValueError, match="KV buffers"):
        native_ext.decoder_block(x, weights, native_ext.kv_reserve([1, 2, 8, 32]), kb, 0, False, c)
    with pytest.raises(ValueError, match="row-major"):  # a strided view is not a buffer the op may write
        big = native_ext.kv_reserve([1, 1, 8, 64])
        kv = big[..., :32], big[..., 32:]
        mx.eval(kv)
        native_ext.decoder_block(x, weights, *kv, 0, False, c)
    with pytest.raises(ValueError, match="biases"):  # the config says biases follow: none given
        native_ext.decoder_block(x, weights, kb, kb, 0, False, c[:12] + (True, False, 0.0))
    with pytest.raises(ValueError, match="valid"):
        native_ext.kv_reserve([1, 1, 8, 32], mx.zeros((1, 1, 4, 32)), valid=5)


def _tiny(arch: str = "llama"):
    """A 2-layer random 4-bit model of mlx-lm's ``arch`` (llama, qwen2: q/k/v biases, qwen3: q/k norms)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    common = dict(model_type=arch, hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300, tie_word_embeddings=True)
    extra = {"qwen3": dict(head_dim=32, max_position_embeddings=1024, rope_theta=10000.0)}.get(arch, {})
    mx.random.seed(5)
    model = module.Model(module.ModelArgs(**common, **extra))
    if arch == "qwen2":  # random biases (mlx-lm initialises them to zero), so that they matter
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(layer.self_attn, name)
                lin.bias = mx.random.normal(lin.bias.shape) * 0.5
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _both(scenario, arch: str = "llama"):
    """scenario(model, cache) on a tiny model with MLX's built-ins, then with the native kernels: both results."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxinfer.kernels import fused_block
    from mlxinfer.kernels.patch import apply_kernels

    model, results = _tiny(arch), []
    try:
        for mode in ("builtin", "custom"):
            report = apply_kernels(model, mode)
            assert mode == "builtin" or "2 decoder layers as one op" in report.detail, report.detail
            cache = make_prompt_cache(model)
            results.append(scenario(model, cache))
            mx.eval(results[-1])
            if mode == "custom":  # the op ran: no layer fell back to the per-op path
                assert all(fused_block.is_one_op(layer) for layer in model.model.layers)
    finally:
        apply_kernels(model, "builtin")
    return results


def _run(model, cache, tokens):
    return model(mx.array([tokens]), cache=cache)[:, -1]


def _close(a, b):
    return all(mx.abs(x - y).max().item() <= 1e-3 * mx.abs(x).max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("arch,kv", [("llama", "float16"), ("llama", "float32"), ("qwen2", "float16"),
                                     ("qwen3", "float16")])
def test_model_logits_match_builtin(native_ext, arch, kv, monkeypatch):
    """Prefill, then decode steps: the one-op layers give the built-in logits (Qwen2 biases, Qwen3 q/k norms),
    with the default float16 KV cache and with MLXINFER_KV_DTYPE=float32."""
    monkeypatch.setenv("MLXINFER_KV_DTYPE", kv)

    def scenario(model, cache):
        outs = [_run(model, cache, list(range(30)))]
        outs += [_run(model, cache, [40 + t]) for t in range(4)]
        return outs

    assert _close(*_both(scenario, arch))


def test_kv_dtype_setting(native_ext, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    from mlxinfer.errors import InvalidParameter
    from mlxinfer.kernels.patch import apply_kernels

    model = _tiny()
    try:
        for name, dtype in (("float32", mx.float32), ("", mx.float16)):
            monkeypatch.setenv("MLXINFER_KV_DTYPE", name)
            apply_kernels(model, "custom")
            cache = make_prompt_cache(model)
            _run(model, cache, [1, 2, 3])
            assert cache[0].keys.dtype == dtype
        monkeypatch.setenv("MLXINFER_KV_DTYPE", "int8")
        with pytest.raises(InvalidParameter, match="MLXINFER_KV_DTYPE"):
            apply_kernels(model, "custom")  # when the model loads, not mid-reply
    finally:
        apply_kernels(model, "builtin")


def test_evaluating_the_cache_runs_the_op(native_ext):
    """mlx-lm's prefill evaluates only the cache state (the chunk's logits are dropped): the writes happen."""

    def scenario(model, cache):
        model(mx.array([list(range(40))]), cache=cache)  # output never evaluated
        mx.eval([layer.state for layer in cache])
        return [_run(model, cache, [41])]

    assert _close(*_both(scenario))


def test_trim_never_overwrites_what_a_holder_may_read(native_ext):
    """A state taken before a trim (mlx-lm hands out the whole buffers) keeps its values below its offset: after
    the trim the op copies into a fresh buffer instead of overwriting those positions."""
    held = []

    def scenario(model, cache):
        outs = [_run(model, cache, list(range(10)))]
        keys, _, offset = cache[0].state
        keys = native_ext.array_handle(keys)  # our own handle: mlx-lm's `keys[...] = k` rebinds the cache's object
        mx.eval(keys)
        before = np.array(keys[:, :, :offset])
        for layer in cache:
            layer.trim(4)
        outs.append(_run(model, cache, [101, 102, 103]))
        mx.eval(outs)
        held.append(np.array_equal(np.array(keys[:, :, :offset]), before) and cache[0].offset == 9)
        return outs

    assert _close(*_both(scenario)) and held == [True, True]


def test_decode_keeps_its_buffers_and_other_writers_get_a_copy(native_ext, monkeypatch):
    """Steady decode writes into the buffers it reserved; after mlx-lm's own update (another array in the cache)
    the next step copies into fresh buffers, and the results stay the built-in's throughout."""
    from mlxinfer.native.cpu_provider import NativeCpuProvider

    from mlxinfer.kernels import selfcheck

    monkeypatch.setattr(selfcheck, "check_model", lambda model: [])  # it reserves buffers too; count decode's only
    reserved = []
    real = NativeCpuProvider.kv_reserve
    monkeypatch.setattr(NativeCpuProvider, "kv_reserve",
                        lambda self, shape, *a, **k: reserved.append(shape) or real(self, shape, *a, **k))

    def scenario(model, cache):
        outs, counts = [_run(model, cache, list(range(20)))], [len(reserved)]
        for t in range(3):
            outs.append(_run(model, cache, [50 + t]))
        counts.append(len(reserved))
        for layer in cache:  # someone else appends through mlx-lm's own update
            layer.update_and_fetch(mx.zeros((1, 2, 1, 32)), mx.zeros((1, 2, 1, 32)))
        outs.append(_run(model, cache, [77]))
        counts.append(len(reserved))
        assert cache[0].offset == 25
        return outs, counts

    (ref, ref_counts), (got, counts) = _both(scenario)
    assert ref_counts == [0, 0, 0]
    assert counts == [4, 4, 8] and reserved[0] == (1, 2, 256, 32)  # k and v of 2 layers, one 256-step buffer
    assert _close(ref, got)
