"""The load-time self-check and the eligibility table: an upstream change under the same mlx-lm class (scaled
queries, another MLP activation, an added bias) turns the fused path off, and the output is still mlx-lm's."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import cache as cache_lib
from mlx_lm.models import llama

from kernel_cases import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_arch  # noqa: E402
from mlxinfer.errors import MlxinferError
from mlxinfer.kernels import eligibility, patch, selfcheck


def run(model, tokens=(1, 5, 7, 9, 11, 13), steps=3):
    """Logits of a prefill and a few greedy decode steps (the paths the fused layers take)."""
    cache = cache_lib.make_prompt_cache(model)
    out = [model(mx.array([list(tokens)]), cache=cache)[:, -1]]
    for _ in range(steps):
        nxt = mx.argmax(out[-1], axis=-1)
        out.append(model(nxt[:, None], cache=cache)[:, -1])
    mx.eval(out)
    return mx.concatenate(out)


def builtin_logits(**kw):
    model = tiny_llama(**kw)
    patch.apply_kernels(model, "builtin")
    return run(model)


def test_table_is_by_identity_and_version(monkeypatch):
    assert eligibility.role_of(llama.Attention) == eligibility.ATTENTION_LLAMA
    assert eligibility.role_of(llama.MLP) == eligibility.MLP_SWIGLU

    class Attention(llama.Attention):  # same name, other class: no role
        pass

    assert eligibility.role_of(Attention) is None
    assert eligibility.role_of(nn.Linear) is None
    eligibility.mlx_lm_validated.cache_clear()
    monkeypatch.setattr("mlx_lm.__version__", "9.9.9")
    try:
        assert eligibility.role_of(llama.Attention) is None
        assert "9.9.9" in eligibility.mlx_lm_validated()
    finally:
        monkeypatch.undo()
        eligibility.mlx_lm_validated.cache_clear()


def test_unchanged_model_passes_and_stays_fused(native):
    model = tiny_llama()
    report = patch.apply_kernels(model, "auto")
    assert "2 decoder layers as one op" in report.detail and "self-check" not in report.detail
    groups = selfcheck._groups(model)
    assert list(groups) == ["model.layers.0"] and len(groups["model.layers.0"]) == 2
    assert selfcheck._error(groups["model.layers.0"][0]) < selfcheck.TOLERANCE / 10


def _scaled_queries(self, x, mask=None, cache=None):
    B, L, _ = x.shape
    queries, keys, values = self.q_proj(x) * 1.5, self.k_proj(x), self.v_proj(x)
    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        queries, keys = self.rope(queries, offset=cache.offset), self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries, keys = self.rope(queries), self.rope(keys)
    output = llama.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _gelu_mlp(self, x):
    return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


def _block_with_bias(original):
    def __call__(self, x, mask=None, cache=None):
        return original(self, x, mask, cache) + 0.25

    return __call__


@pytest.mark.parametrize("change", ["scaled queries", "gelu mlp", "added bias"])
def test_upstream_change_refuses_fusion_and_output_stays_right(native, monkeypatch, change):
    if change == "scaled queries":
        monkeypatch.setattr(llama.Attention, "__call__", _scaled_queries)
    elif change == "gelu mlp":
        monkeypatch.setattr(llama.MLP, "__call__", _gelu_mlp)
    else:
        monkeypatch.setattr(llama.TransformerBlock, "__call__", _block_with_bias(llama.TransformerBlock.__call__))
    expected = builtin_logits()
    model = tiny_llama()
    report = patch.apply_kernels(model, "auto")
    assert "self-check" in report.detail and "disagreed" in report.detail, report.detail
    assert "decoder layers as one op" not in report.detail
    got = run(model)
    assert mx.allclose(got, expected, atol=2e-3, rtol=2e-3).item(), float(mx.abs(got - expected).max())
    patch.apply_kernels(model, "builtin")


def test_custom_mode_fails_instead(native, monkeypatch):
    monkeypatch.setattr(llama.MLP, "__call__", _gelu_mlp)
    model = tiny_llama()
    with pytest.raises(MlxinferError, match="self-check"):
        patch.apply_kernels(model, "custom")
    assert all(getattr(type(m), "_fused_base", None) is None for _, m in model.named_modules())


def test_broken_per_op_kernel_falls_back_to_builtins(native, monkeypatch):
    """When even the per-op kernels disagree (here: a provider whose matmul is wrong), the group runs MLX's."""

    class Wrong:
        name = "wrong"

        def __getattr__(self, item):
            return getattr(native, item)

        def decoder_layer(self, *a, **kw):  # decline the one-op layer: the per-op kernels run
            return None

        def quantized_matmul(self, x, w, scales, biases, **kw):
            return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=kw["group_size"],
                                       bits=kw["bits"]) * 1.1

    monkeypatch.setattr(patch, "select_provider", lambda where=None: (Wrong(), "wrong provider"))
    model = tiny_llama()
    report = patch.apply_kernels(model, "auto")
    assert "MLX built-ins" in report.detail, report.detail
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.QuantizedLinear and type(layer.mlp.down_proj) is nn.QuantizedLinear
    assert all(getattr(type(m), "_fused_base", None) is None for _, m in model.named_modules())
    patch.apply_kernels(model, "builtin")


@pytest.mark.parametrize("int8", [True, False])
def test_selfcheck_runs_precise_activations_and_restores_them(native, monkeypatch, int8):
    """While checking, int8 decode and int8 prefill are off (rounding would hide a changed formula); afterwards each
    setting is what it was, whichever that was (MLXINFER_PREFILL=float users and the float-parity tests keep
    theirs)."""
    from mlxinfer import native as native_mod

    ext = native_mod.extension()
    seen = []
    real_run = selfcheck._run

    def read(setter):  # the setters return the setting they replace: put it straight back
        value = setter(False)
        setter(value)
        return value

    def spy(m, call, xs):
        seen.append((read(ext.set_int8_prefill), read(ext.set_int8_decode)))
        return real_run(m, call, xs)

    monkeypatch.setattr(selfcheck, "_run", spy)
    before = (ext.set_int8_prefill(int8), ext.set_int8_decode(int8))
    try:
        patch.apply_kernels(tiny_llama(), "auto")
        assert seen[0] == (False, False)  # the fused run (the first) saw both off
        assert seen[1] == (int8, int8)  # the reference (MLX's own layers) after it: restored already
        assert (ext.set_int8_prefill(int8), ext.set_int8_decode(int8)) == (int8, int8)
    finally:
        ext.set_int8_prefill(before[0])
        ext.set_int8_decode(before[1])


def _tiny_gemma(layers=6):
    return tiny_arch.make_model("gemma3_text", overrides={"num_hidden_layers": layers, "sliding_window": 16})


def test_a_layer_index_no_code_reads_does_not_split_configurations(native):
    """gemma3_text's Attention stores ``layer_idx``; its methods read only what it decided (``is_sliding``). Six
    layers are then two configurations (sliding and global), each checked once — not six (a Gemma-3-1B load spent
    ~5 s checking 26)."""
    model = _tiny_gemma()
    report = patch.apply_kernels(model, "auto")
    assert "6 decoder layers as one op" in report.detail and "self-check" not in report.detail
    groups = selfcheck._groups(model)
    assert {k: len(v) for k, v in groups.items()} == {"model.layers.0": 3, "model.layers.1": 3}
    assert [m.self_attn.is_sliding for m in groups["model.layers.0"]] == [True] * 3
    patch.apply_kernels(model, "builtin")


def test_a_layer_index_the_code_reads_is_checked_per_layer(native, monkeypatch):
    """If an upstream change makes the maths depend on ``layer_idx`` itself, every layer is its own configuration:
    the changed layers (3 and up here) are refused and the output stays mlx-lm's."""
    from mlx_lm.models import gemma3_text

    original = gemma3_text.Attention.__call__

    def __call__(self, x, mask=None, cache=None):
        out = original(self, x, mask, cache)
        return out + 0.5 if self.layer_idx >= 3 else out  # not a scale: Gemma's post-attention norm undoes one

    monkeypatch.setattr(gemma3_text.Attention, "__call__", __call__)
    reference = _tiny_gemma()
    patch.apply_kernels(reference, "builtin")
    expected = run(reference)
    model = _tiny_gemma()
    report = patch.apply_kernels(model, "auto")
    assert "self-check" in report.detail and "model.layers.3" in report.detail, report.detail
    assert "3 decoder layers as one op" in report.detail, report.detail
    got = run(model)
    # Relative to the largest logit: the layers still fused differ by rounding (float16 KV cache, ~4e-4 here); the
    # change itself moves them by 5e-2.
    rel = float(mx.abs(got - expected).max() / mx.abs(expected).max())
    assert rel < 5e-3, rel
    patch.apply_kernels(model, "builtin")


def _reads_index(attn):
    return getattr(attn, "layer_idx") > 2


def test_names_read_follows_helpers_wrappers_and_getattr(monkeypatch):
    """An index read through a module-level helper and getattr with a string, or by a method under a
    functools.wraps decorator, still counts as read (the layers are then checked one by one)."""
    import functools

    from mlx_lm.models import gemma3_text

    assert "layer_idx" not in selfcheck._names_read(gemma3_text.Attention)
    original = gemma3_text.Attention.__call__

    def via_helper(self, x, mask=None, cache=None):
        return original(self, x, mask, cache) + (0.5 if _reads_index(self) else 0.0)

    monkeypatch.setattr(gemma3_text.Attention, "__call__", via_helper)
    assert "layer_idx" in selfcheck._names_read(gemma3_text.Attention)

    def wrapped(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)

        return inner

    def direct(self, x, mask=None, cache=None):
        return original(self, x, mask, cache) * (1 + self.layer_idx)

    monkeypatch.setattr(gemma3_text.Attention, "__call__", wrapped(direct))
    assert "layer_idx" in selfcheck._names_read(gemma3_text.Attention)

    def reading_wrapper(fn):  # the wrapper itself reads the index, the wrapped method does not
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            return fn(self, *args, **kwargs) * (1 + self.layer_idx)

        return inner

    monkeypatch.setattr(gemma3_text.Attention, "__call__", reading_wrapper(original))
    assert "layer_idx" in selfcheck._names_read(gemma3_text.Attention)
