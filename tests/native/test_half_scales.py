"""Quantized scales/biases on the CPU: kept as stored (float16/bfloat16) where a native kernel runs the layer,
float32 where MLX runs it (``engine.loader.apply_dtype_policy(keep_quantized_scales=True)`` then
``kernels.patch.settle_scales``), with the same logits either way."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxinfer.engine import loader
from mlxinfer.kernels import patch
from mlxinfer.kernels.layers import KernelQuantizedEmbedding, KernelQuantizedLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_arch  # noqa: E402

pytestmark = pytest.mark.slow  # needs the compiled extension (built by the fixture when missing)

REL_TOL = 5e-3  # native vs built-in logits, float16 KV cache (tests/kernels/test_spec_layers.py measures ≤ 7.8e-4)


def _quantized(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m.get("scales"), mx.array)}


def _logits(model, ids) -> mx.array:
    cache = make_prompt_cache(model)
    out = [model(mx.array([ids]), cache=cache)[0, -1]]
    for t in (5, 77, 1000, 3):
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    mx.eval(out)
    return mx.stack(out)


def _rel(got, want) -> float:
    return float(mx.abs(got - want).max()) / float(mx.abs(want).max())


def test_loader_keeps_stored_scales_where_native_kernels_run(native_ext, bundled_gguf):
    import mlxinfer

    with mx.stream(mx.cpu):
        wide = mlxinfer.load(str(bundled_gguf), kernels="builtin")  # MLX runs every layer: float32 scales
        assert all(m["scales"].dtype == mx.float32 for m in _quantized(wide.model).values())
        loaded = mlxinfer.load(str(bundled_gguf), kernels="custom")
        q = _quantized(loaded.model)
        assert q and all(type(m) in (KernelQuantizedLinear, KernelQuantizedEmbedding) for m in q.values())
        assert all(m["scales"].dtype == mx.float16 and m["biases"].dtype == mx.float16 for m in q.values())
        assert "scales/biases as stored (float16)" in loaded.kernels_detail, loaded.kernels_detail
        floats = [v for k, v in tree_flatten(loaded.model.parameters())
                  if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases"))]
        assert floats and all(v.dtype == mx.float32 for v in floats)  # norms etc. still follow the policy
        saved = sum(m["scales"].nbytes + m["biases"].nbytes for m in q.values())
        assert wide.weight_bytes() - loaded.weight_bytes() == saved

        ids = loaded.tokenizer.encode("The capital of France is")
        stored = {name: mx.array(m["scales"]) for name, m in q.items()}
        native = _logits(loaded.model, ids)
        patch.apply_kernels(loaded.model, "builtin")  # widened for MLX's kernels ...
        assert all(m["scales"].dtype == mx.float32 for m in q.values())
        builtin = _logits(loaded.model, ids)
        assert mx.array_equal(builtin, _logits(wide.model, ids)).item()  # ... exactly the float32 load
        assert _rel(native, builtin) < REL_TOL
        patch.apply_kernels(loaded.model, "custom")  # ... and narrowed back, bit for bit
        assert all(m["scales"].dtype == mx.float16 and mx.array_equal(m["scales"], stored[n]).item()
                   for n, m in q.items())
        assert mx.array_equal(_logits(loaded.model, ids), native).item()


def _half_llama_with_a_3bit_layer():
    """The tiny llama as the CPU loader leaves a float16 checkpoint (float32 norms/embeddings' policy applied,
    quantized scales float16), with one 3-bit down_proj that no native kernel takes."""
    model = tiny_arch.make_model("llama")
    mlp = model.layers[0].mlp
    lin = nn.Linear(128, 64, bias=False)  # intermediate -> hidden
    lin.weight = mx.random.normal(lin.weight.shape, key=mx.random.key(3)) * (12.0 / 128 ** 0.5)
    mlp.down_proj = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=3)
    model.set_dtype(mx.float16)  # a float16 checkpoint
    assert loader.apply_dtype_policy(model, keep_quantized_scales=True) == "float32"
    mx.eval(model.parameters())
    return model


def test_a_layer_mlx_runs_gets_float32_scales_and_the_same_logits(native_ext):
    model = _half_llama_with_a_3bit_layer()
    q = _quantized(model)
    assert all(m["scales"].dtype == mx.float16 for m in q.values())
    assert model.layers[0].input_layernorm.weight.dtype == mx.float32
    ids = [1, 17, 923, 4, 88, 1203, 5]
    patch.apply_kernels(model, "builtin")
    want = _logits(model, ids)
    report = patch.apply_kernels(model, "auto")
    odd = model.layers[0].mlp.down_proj
    assert type(odd) is KernelQuantizedLinear and odd["scales"].dtype == mx.float32  # MLX runs it (3-bit)
    assert all(m["scales"].dtype == mx.float16 for m in q.values() if m is not odd)
    assert f"in {len(q) - 1} quantized layers, float32 in 1 run by MLX" in report.detail, report.detail
    assert _rel(_logits(model, ids), want) < REL_TOL
    patch.apply_kernels(model, "builtin")


def test_policy_without_kernels_and_on_gpus_widens_or_keeps_as_before(monkeypatch):
    model = tiny_arch.make_model("qwen2")
    model.set_dtype(mx.float16)
    assert loader.apply_dtype_policy(model) == "float32"  # convert's quality check: no kernels follow
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    model.set_dtype(mx.float16)
    monkeypatch.setattr(loader, "activation_dtype", lambda d: d)  # a GPU: activations in the model's dtype
    assert loader.apply_dtype_policy(model, keep_quantized_scales=True) == "float16"
    monkeypatch.setattr(patch, "backend", lambda: "metal")
    assert patch.settle_scales(model) == ""  # GPU kernels take scales in x's dtype: nothing to settle
    assert all(m["scales"].dtype == mx.float16 for m in _quantized(model).values())
