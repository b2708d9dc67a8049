"""The in-place KV-cache promise ``kernels.fused_block`` keeps for the one-op decoder layers (``decoder_layer``; its
maths against MLX ops is in test_decoder_layer.py and tests/kernels/test_spec_layers.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = [pytest.mark.slow,  # needs the compiled extension (built by the fixture when missing)
              # Float parity with MLX: prefill at float32 (the AVX2 int8 prefill GEMM off, as the load-time
              # self-check runs); tests/kernels/test_spec_layers.py holds the int8 default to its tolerance.
              pytest.mark.usefixtures("float_prefill")]


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
    monkeypatch.setattr(selfcheck, "tile_checked", lambda model: (0, []))  # so does the check of row tiles
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
