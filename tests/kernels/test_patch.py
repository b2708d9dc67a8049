"""apply_kernels on a tiny random-weight mlx-lm llama: routing through a provider, fallback, restore, mode rules."""

from __future__ import annotations

import sys
import types

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import cache as cache_lib
from mlx_lm.models import llama

from kernel_cases import tiny_llama
from mlxinfer.errors import InvalidParameter, MlxinferError
from mlxinfer.kernels import patch
from mlxinfer.kernels.patch import KernelQuantizedLinear, apply_kernels


class CountingProvider:
    """Returns the built-in answer shifted by a function of x, so a routed call changes the logits."""

    name = "fake-custom"

    def __init__(self):
        self.calls = {"qmm": 0, "sdpa": 0, "swiglu": 0, "qsdpa": 0}

    def quantized_matmul(self, x, w, scales, biases, *, group_size, bits, mode="affine"):
        self.calls["qmm"] += 1
        y = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
        return y + 0.01 * mx.tanh(x.sum(axis=-1, keepdims=True))

    def sdpa(self, q, k, v, *, scale, mask):
        self.calls["sdpa"] += 1
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) * 1.5

    def swiglu(self, x, gate, up, *, group_size, bits):
        self.calls["swiglu"] += 1
        g = mx.quantized_matmul(x, *gate, transpose=True, group_size=group_size, bits=bits)
        u = mx.quantized_matmul(x, *up, transpose=True, group_size=group_size, bits=bits)
        return nn.silu(g) * u * 2.0

    def quantized_sdpa(self, q, k, v, *, scale, mask, group_size, bits):
        self.calls["qsdpa"] += 1
        return None


class DecliningProvider:
    name = "fake-declines"

    def quantized_matmul(self, *a, **k):
        return None

    def sdpa(self, *a, **k):
        return None

    def swiglu(self, *a, **k):
        return None

    def qkv_rope(self, *a, **k):
        return None


@pytest.fixture(autouse=True)
def no_selfcheck(monkeypatch):
    """These providers are wrong on purpose (so that routing shows in the logits): the load-time self-check would
    turn them off. It has its own tests (test_selfcheck.py)."""
    from mlxinfer.kernels import selfcheck

    monkeypatch.setattr(selfcheck, "check_model", lambda model: [])


@pytest.fixture
def cpu_provider(monkeypatch):
    """Install a fake ``mlxinfer.native`` whose provider the test chooses; restores mlx-lm afterwards."""
    holder = {"provider": None}
    fake = types.ModuleType("mlxinfer.native")
    fake.provider = lambda: holder["provider"]
    fake.status = lambda: "fake native: " + ("ready" if holder["provider"] else "not built")
    monkeypatch.setitem(sys.modules, "mlxinfer.native", fake)
    monkeypatch.delenv(patch.ENV_VAR, raising=False)
    original = llama.scaled_dot_product_attention
    yield holder
    llama.scaled_dot_product_attention = original


def logits(model, tokens, cache=None):
    out = model(mx.array([tokens]), cache=cache)
    mx.eval(out)
    return out


def test_patch_targets_exist_in_installed_mlx_lm():
    # If mlx-lm renames these, the patch would silently do nothing: fail loudly instead.
    from mlx_lm.models import base

    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert hasattr(cache_lib.QuantizedKVCache(), "bits")
    # The eligibility table names llama's classes by identity: a tiny llama's attention must qualify.
    from mlxinfer.kernels import fused_llama

    assert fused_llama.is_plain_attention(tiny_llama().model.layers[0].self_attn)


def test_routes_through_provider_and_restores(cpu_provider):
    model = tiny_llama()
    tokens = [1, 5, 7, 9, 11]
    before = logits(model, tokens)
    fake = CountingProvider()
    cpu_provider["provider"] = fake
    report = apply_kernels(model, "auto")
    assert report.name == "fake-custom" and "llama" in report.detail
    assert isinstance(model.model.layers[0].self_attn.q_proj, KernelQuantizedLinear)
    after = logits(model, tokens)
    assert fake.calls["qmm"] > 0 and fake.calls["sdpa"] == 2 and fake.calls["swiglu"] == 2
    assert not mx.allclose(before, after, atol=1e-3).item()

    # "builtin" puts MLX back: same logits as before patching.
    assert apply_kernels(model, "builtin").name == "builtin"
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    assert type(model.model.layers[0].mlp) is llama.MLP
    assert mx.array_equal(logits(model, tokens), before).item()


def test_declining_provider_gives_identical_output(cpu_provider):
    model = tiny_llama(1)
    tokens = [3, 1, 4, 1, 5, 9]
    before = logits(model, tokens)
    cpu_provider["provider"] = DecliningProvider()
    assert apply_kernels(model, "custom").name == "fake-declines"
    assert mx.array_equal(logits(model, tokens), before).item()
    # Decode steps with a KV cache take the same fallback path.
    c1, c2 = model.make_cache(), model.make_cache()
    apply_kernels(model, "builtin")
    ref = [logits(model, tokens, c1), logits(model, [2], c1)]
    apply_kernels(model, "custom")
    got = [logits(model, tokens, c2), logits(model, [2], c2)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))


def test_quantized_kv_cache_asks_quantized_sdpa(cpu_provider):
    model = tiny_llama(2)
    fake = CountingProvider()
    cpu_provider["provider"] = fake
    apply_kernels(model)
    caches = [cache_lib.QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    logits(model, [1, 2, 3], caches)
    assert fake.calls["qsdpa"] == 2 and fake.calls["sdpa"] == 0  # declined -> mlx-lm's quantized path ran


def test_no_provider_auto_is_builtin_and_custom_raises(cpu_provider):
    model = tiny_llama()
    report = apply_kernels(model, "auto")
    assert report.name == "builtin" and "not built" in report.detail
    with pytest.raises(MlxinferError, match="custom kernels are not available on the cpu backend"):
        apply_kernels(model, "custom")


def test_auto_keeps_the_builtins_where_they_measured_faster(monkeypatch):
    # CUDA: "auto" keeps MLX's built-ins without building or self-testing a kernel; "custom" still asks for them.
    monkeypatch.delenv(patch.ENV_VAR, raising=False)
    monkeypatch.setattr(patch, "backend", lambda: "cuda")
    fake = CountingProvider()
    asked = []
    monkeypatch.setattr(patch, "select_provider", lambda name=None: (asked.append(name), (fake, "fake ready"))[1])
    model = tiny_llama()
    before = logits(model, [1, 2, 3])
    report = apply_kernels(model, "auto")
    assert report.name == "builtin" and patch.AUTO_BUILTIN["cuda"] in report.detail and asked == []
    assert mx.array_equal(logits(model, [1, 2, 3]), before).item()
    try:
        assert apply_kernels(model, "custom").name == "fake-custom" and asked == ["cuda"]
    finally:
        apply_kernels(model, "builtin")


def test_env_var_overrides_auto_only(cpu_provider, monkeypatch):
    model = tiny_llama()
    cpu_provider["provider"] = CountingProvider()
    monkeypatch.setenv(patch.ENV_VAR, "builtin")
    assert apply_kernels(model, "auto").name == "builtin"
    assert apply_kernels(model, "custom").name == "fake-custom"
    monkeypatch.setenv(patch.ENV_VAR, "fastest")
    with pytest.raises(InvalidParameter, match="MLXINFER_KERNELS"):
        apply_kernels(model, "auto")


def test_auto_on_this_machine_uses_the_native_cpu_provider_when_built(monkeypatch):
    # No fakes: on the CPU backend "auto" must pick mlxinfer.native's provider when it loads, else builtin.
    from mlxinfer import native

    monkeypatch.delenv(patch.ENV_VAR, raising=False)
    assert patch.backend() == "cpu"
    model = tiny_llama(4)
    tokens = [2, 4, 6, 8]
    before = logits(model, tokens)
    original = llama.scaled_dot_product_attention
    try:
        report = apply_kernels(model, "auto")
        if native.provider() is None:
            assert report.name == "builtin" and native.status() in report.detail
        else:
            assert report.name == "cpu-native"
            assert mx.allclose(logits(model, tokens), before, atol=1e-3, rtol=1e-3).item()
    finally:
        apply_kernels(model, "builtin")
        llama.scaled_dot_product_attention = original


def test_kernel_files_ship_with_their_contract():
    from mlxinfer._resources import data_path
    from mlxinfer.kernels.build import BODY_MARKER, SPECS

    folder = data_path("metal_kernels")
    for header in ("mlxk_common.h", "compat_cuda.h", "compat_emu.h", "emu_cuda_prelude.h"):
        assert (folder / header).is_file()
    for name in SPECS:
        text = (folder / f"{name}.metal").read_text()
        head = text.split(BODY_MARKER)[0]
        for word in ("inputs:", "outputs:", "template:", "grid"):
            assert word in head, f"{name}.metal header comment lacks {word!r}"


def test_other_architectures_route_too(cpu_provider):
    # qwen2 (attention bias, tied embeddings) goes through the same three swap points.
    from mlx_lm.models import qwen2

    mx.random.seed(5)
    model = qwen2.Model(qwen2.ModelArgs(
        model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        rms_norm_eps=1e-6, vocab_size=300, num_key_value_heads=2,
    ))
    nn.quantize(model, group_size=32, bits=4)
    fake = CountingProvider()
    cpu_provider["provider"] = fake
    original = qwen2.scaled_dot_product_attention
    try:
        report = apply_kernels(model)
        assert "qwen2" in report.detail
        logits(model, [1, 2, 3])
        assert fake.calls["sdpa"] == 2 and fake.calls["swiglu"] == 2 and fake.calls["qmm"] > 0
    finally:
        apply_kernels(model, "builtin")
        qwen2.scaled_dot_product_attention = original
    assert qwen2.scaled_dot_product_attention is original


class SmallOpsProvider(DecliningProvider):
    """Declines the big ops, answers RMSNorm/RoPE/LM head with a visible change."""

    name = "fake-small-ops"

    def __init__(self):
        self.calls = {"qmm": 0, "rms_norm": 0, "rope": 0}

    def quantized_matmul(self, x, w, scales, biases, *, group_size, bits, mode="affine"):
        self.calls["qmm"] += 1
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits) + 0.5

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return mx.fast.rms_norm(x, weight, eps) * 1.1

    def rope(self, x, dims, *, traditional, base, scale, offset):
        self.calls["rope"] += 1
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)


def test_lm_head_norms_and_rope_route_and_restore(cpu_provider):
    """The tied LM head (QuantizedEmbedding.as_linear), RMSNorm and RoPE ask the provider's optional methods."""
    mx.random.seed(3)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300, tie_word_embeddings=True,
    )
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    tokens = [1, 2, 3, 4]
    before = logits(model, tokens)
    fake = SmallOpsProvider()
    cpu_provider["provider"] = fake
    report = apply_kernels(model, "auto")
    assert "1 LM-head/embedding" in report.detail and "5 RMSNorms" in report.detail and "2 RoPEs" in report.detail
    after = logits(model, tokens)
    assert fake.calls["rms_norm"] == 5 and fake.calls["rope"] == 4 and fake.calls["qmm"] >= 1
    assert not mx.allclose(before, after, atol=1e-3).item()
    apply_kernels(model, "builtin")
    assert type(model.model.norm) is nn.RMSNorm and type(model.model.embed_tokens) is nn.QuantizedEmbedding
    assert type(model.model.layers[0].self_attn.rope) is nn.RoPE
    assert mx.array_equal(logits(model, tokens), before).item()


class QkvProvider(DecliningProvider):
    """Answers qkv_rope with MLX's own composition, v scaled so that routing shows in the logits."""

    name = "fake-qkv"

    def __init__(self):
        self.offsets = []
        self.v_scale = 1.25

    def qkv_rope(self, x, q, k, v, *, group_size, bits, n_heads, n_kv_heads, head_dim, rope_dims, traditional,
                 base, scale, offset, norm_weight=None, norm_eps=0.0):
        self.offsets.append(offset)
        self.normed = norm_weight is not None
        if norm_weight is not None:  # the fused block folds input_layernorm in
            x = mx.fast.rms_norm(x, norm_weight, norm_eps)
        B, L, _ = x.shape
        outs = []
        for (w, s, b), heads, roped in ((q, n_heads, True), (k, n_kv_heads, True), (v, n_kv_heads, False)):
            y = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
            y = y.reshape(B, L, heads, head_dim).transpose(0, 2, 1, 3)
            if roped:
                y = mx.fast.rope(y, rope_dims, traditional=traditional, base=base, scale=scale, offset=offset)
            outs.append(y)
        return outs[0], outs[1], outs[2] * self.v_scale


def test_attention_inputs_fuse_through_qkv_rope_and_restore(cpu_provider):
    model = tiny_llama(4)
    tokens = [1, 5, 7, 9]
    c_ref = model.make_cache()
    before = [logits(model, tokens, c_ref), logits(model, [3], c_ref)]
    fake = QkvProvider()
    cpu_provider["provider"] = fake
    report = apply_kernels(model, "auto")
    assert "2 fused q/k/v+RoPE attention inputs" in report.detail
    attn = model.model.layers[0].self_attn
    assert type(attn).__name__ == "FusedAttention" and isinstance(attn, llama.Attention)
    c = model.make_cache()
    after = [logits(model, tokens, c), logits(model, [3], c)]
    assert fake.offsets == [0, 0, 4, 4]  # prefill then one decode step, 2 layers each, at the cache offset
    assert fake.normed and type(model.model.layers[0]).__name__ == "FusedTransformerBlock"
    assert c[0].offset == 5
    assert not mx.allclose(before[1], after[1], atol=1e-3).item()
    # With v unscaled the fused path is the original computation.
    fake.v_scale = 1.0
    c = model.make_cache()
    same = [logits(model, tokens, c), logits(model, [3], c)]
    assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(before, same))
    apply_kernels(model, "builtin")
    assert type(model.model.layers[0].self_attn) is llama.Attention
    assert type(model.model.layers[0]) is llama.TransformerBlock
