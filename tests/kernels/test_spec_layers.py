"""The spec-driven one-op decoder layer (``kernels.spec`` + ``decoder_layer``) per architecture: the spec read from
each mlx-lm block class, fused vs MLX built-in logits over a prefill and 32 decode steps, and the self-check
refusing a changed gemma3 / phi3 / olmo2 / olmo3 / ministral3 class.

Tolerance: the fused path differs from MLX's by rounding only. Measured on these tiny models (AVX2, max abs logit
difference relative to the largest |logit|, prefill + 32 decode steps): 1.3e-4 to 7.8e-4 with the default
float16 KV cache; with MLXINFER_KV_DTYPE=float32, 0.9e-6 to 2.5e-6 with the float32 decode matvec and 0.8e-4 to
1.2e-4 with the int16-activation one (AVX2 int16 / VNNI, the default where the CPU has it). ``REL_TOL`` = 5e-3
(float16 cache) and 5e-4 (float32); a changed formula gives 1e-1 and more. These comparisons run with prefill at
float32 (``float_prefill``: the int8 prefill GEMM off, as the load-time self-check runs it; on the AVX2 integer
and AVX-512 VNNI sets that is the int16 prefill GEMM, ~1e-5).

The opt-in int8 prefill (MLXINFER_PREFILL=int8: x rounded to int8 per 32-block, llama.cpp's Q8_0 grade) is checked on its own
against the same built-in logits: rounding each activation to 1/254 of its block's largest magnitude, through every
projection of every layer of these random (untrained, so noise-like) models, gives 0.7e-2 to 2.7e-2 of the largest
logit here. ``INT8_REL_TOL`` = 5e-2 holds that with margin and still fails a wrong weight, scale or group (errors
of order 1); a floor of 1e-4 shows that the int8 path ran at all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as cache_lib
from mlx_lm.models import gemma3_text, ministral3, olmo2, olmo3, phi3

from mlxinfer.kernels import fused_block, patch, selfcheck, spec
from mlxinfer.native import int8_activations

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_arch  # noqa: E402

REL_TOL = {"float16": 5e-3, "float32": 5e-4}
INT8_REL_TOL = 5e-2
DECODE_STEPS = 32
PROMPT = [1, 17, 923, 4, 88, 1203, 5, 77, 311, 9, 40, 2048, 3, 61, 500, 12, 7, 1999, 25, 8, 640, 33, 2, 91]
# Sliding windows of 16 so that the 24-token prompt and the decode steps both run past them.
CASES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "smollm3": {}, "phi3": {}, "phi4_mini": {},
    "gemma3_text": {"sliding_window": 16}, "olmo2": {}, "olmo3": {"sliding_window": 16},
    # The tiny ministral3's original context is 8: its query scale changes every 8 positions of the prompt.
    "ministral3": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
}


def model_for(name: str):
    return tiny_arch.make_model(name, overrides=CASES[name])


def teacher_forced(model, tokens: list) -> mx.array:
    """Logits of a prefill of PROMPT and then one step per token of ``tokens`` (the same inputs for both paths)."""
    cache = cache_lib.make_prompt_cache(model)
    out = [model(mx.array([PROMPT]), cache=cache)[0, -1]]
    for t in tokens:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    mx.eval(out)
    return mx.stack(out)


def greedy(model) -> list:
    cache = cache_lib.make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)[0, -1]
    tokens = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens


@pytest.mark.parametrize("kv", ["float16", "float32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layers_match_builtin_over_prefill_and_decode(native, float_prefill, name, kv, monkeypatch):
    monkeypatch.setenv("MLXINFER_KV_DTYPE", kv)
    model = model_for(name)
    patch.apply_kernels(model, "builtin")
    tokens = greedy(model)
    expected = teacher_forced(model, tokens)
    report = patch.apply_kernels(model, "auto")
    n = len(model.layers)
    assert f"{n} decoder layers as one op" in report.detail, report.detail
    assert "self-check" not in report.detail, report.detail
    assert all(fused_block.is_one_op(layer) for layer in model.layers)
    got = teacher_forced(model, tokens)
    err = float(mx.abs(got - expected).max()) / float(mx.abs(expected).max())
    assert err < REL_TOL[kv], err
    if kv == "float32":
        assert greedy(model) == tokens
    patch.apply_kernels(model, "builtin")


LONG_PROMPT = [(i * 7919) % 49000 + 3 for i in range(320)]


@pytest.mark.parametrize("kv", ["float16", "float32"])
@pytest.mark.parametrize("name", ["llama", "phi3", "gemma3_text", "qwen3"])
def test_long_prompt_rows_on_the_pool_match_builtin(native, float_prefill, name, kv, monkeypatch):
    """A 320-token prompt: enough rows that the layer op's row work (norms, RoPE, the float16 staging, activations,
    residuals, the GEMM's x preparation) runs in chunks on the thread pool. Every prompt position's logits and 4
    decode steps after it match the built-ins (phi3: the fused gate_up, whose activations go to their own rows)."""
    monkeypatch.setenv("MLXINFER_KV_DTYPE", kv)
    model = model_for(name)

    def run():
        cache = cache_lib.make_prompt_cache(model)
        out = [model(mx.array([LONG_PROMPT]), cache=cache)[0]]
        for t in (5, 99, 1234, 7):
            out.append(model(mx.array([[t]]), cache=cache)[0])
        mx.eval(out)
        return mx.concatenate(out)

    patch.apply_kernels(model, "builtin")
    expected = run()
    report = patch.apply_kernels(model, "auto")
    assert f"{len(model.layers)} decoder layers as one op" in report.detail, report.detail
    got = run()
    err = float(mx.abs(got - expected).max()) / float(mx.abs(expected).max())
    assert err < REL_TOL[kv], err
    patch.apply_kernels(model, "builtin")


@pytest.mark.parametrize("name", sorted(CASES))
def test_int8_prefill_within_its_tolerance(native, name, monkeypatch):
    """The opt-in int8 prefill (MLXINFER_PREFILL=int8; here switched on in-process): the same comparison with
    prefill x rounded to int8 (INT8_REL_TOL, see the module doc); the kernel report says so."""
    from mlxinfer import native as native_mod

    if not native_mod.extension().has_int8_prefill():
        pytest.skip(f"no int8 prefill in this kernel set ({native_mod.extension().isa()})")
    if tiny_arch.ARCHS[name].bits != 4:
        pytest.skip("8-bit weights: the int8 prefill GEMM is for 4-bit ones (8-bit prefill stays float32)")
    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")
    model = model_for(name)
    patch.apply_kernels(model, "builtin")
    tokens = greedy(model)
    expected = teacher_forced(model, tokens)
    with int8_activations(prefill=True):
        report = patch.apply_kernels(model, "auto")
        assert "prefill at int8" in report.detail and "self-check" not in report.detail, report.detail
        got = teacher_forced(model, tokens)
    err = float(mx.abs(got - expected).max()) / float(mx.abs(expected).max())
    print(f"{name}: int8 prefill max rel. logit error {err:.3g}")
    assert 1e-4 < err < INT8_REL_TOL, err
    patch.apply_kernels(model, "builtin")


def test_gemma3_spec_reads_the_class():
    model = model_for("gemma3_text")
    s0, s1 = (spec.spec_of(b, 16) for b in model.layers)
    assert s0.norm_placement == "sandwich" and s0.norm_offset == 1.0 and s0.activation == spec.GELU_TANH
    assert s0.sliding_window == 16 and s1.sliding_window == 0  # pattern 2: layer 1 is global
    assert s0.rope.base == 10000.0 and s1.rope.base == 1e6
    assert s0.attn_scale == pytest.approx(32 ** -0.5) and s0.qk_norm_eps == s0.norm_eps == 1e-6
    assert {"q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"} <= set(s0.names())
    assert s0.qk_norm and not (s0.fused_qkv or s0.fused_gate_up or s0.qkv_bias)
    assert isinstance(spec.spec_of(model.layers[0], 0), str)  # a sliding layer without a window: refused


def test_phi3_spec_reads_the_class():
    s = spec.spec_of(model_for("phi4_mini").layers[0])
    assert {"qkv.weight", "gate_up.weight", "rope_freqs"} <= set(s.names()) and "q.weight" not in s.names()
    assert s.rope.dims == 12 and s.head_dim == 16 and s.rope.input_scale > 1.0  # partial rotary, LongRoPE scale
    assert s.fused_qkv and s.fused_gate_up and not s.qk_norm and s.activation == spec.SILU
    plain = spec.spec_of(model_for("phi3").layers[0])
    assert plain.rope.dims == 16 and plain.rope.freqs_path == "" and plain.rope.input_scale == 1.0


def test_olmo_specs_read_the_classes():
    """olmo2 / olmo3: post norms only, whole-width q/k norms; olmo3's sliding layer has its window and plain RoPE,
    its full layer YaRN (periods and an input scale)."""
    s = spec.spec_of(model_for("olmo2").layers[0])
    assert s.norm_placement == "post" and s.qk_norm and s.qk_norm_whole and s.rope.freqs_path == ""
    assert {"attn_out_norm", "mlp_out_norm"} <= set(s.names()) and not {"attn_norm", "mlp_norm"} & set(s.names())
    sliding, full = (spec.spec_of(b) for b in model_for("olmo3").layers)
    assert sliding.sliding_window == 16 and full.sliding_window == 0
    assert sliding.rope.freqs_path == "" and sliding.rope.input_scale == 1.0
    assert full.rope.freqs_path == "self_attn.rope._freqs" and full.rope.input_scale > 1.0  # YaRN's mscale
    assert "rope_freqs" in full.names() and s.config()["qk_norm_whole"] == 1.0


def test_ministral3_spec_reads_the_class():
    """ministral3: llama's layer with YaRN periods, a sliding layer from layer_types and a query factor per row
    (the model's attn_scale), which the block's fused call passes to the op."""
    model = model_for("ministral3")
    sliding, full = (spec.spec_of(b) for b in model.layers)
    assert sliding.q_row_scale and full.q_row_scale and sliding.config()["q_row_scale"] == 1.0
    assert sliding.sliding_window == 16 and full.sliding_window == 0
    assert full.rope.freqs_path == "self_attn.rope._freqs" and full.norm_placement == "pre" and not full.qk_norm
    # What its attention computes without an attn_scale: 1 below the original context (8), then 1 + 0.1 log(1 + n)
    import math

    s = spec.query_scale(model.layers[0], 4, 6).reshape(-1).tolist()  # positions 6, 7, 8, 9
    assert s == pytest.approx([1.0, 1.0, 1.0 + 0.1 * math.log(2.0), 1.0 + 0.1 * math.log(2.0)])


def test_smollm3_nope_layers():
    a, b = (spec.spec_of(layer) for layer in model_for("smollm3").layers)
    assert a.rope is not None and b.rope is None  # no_rope_layer_interval 2: layer 1 has no RoPE


def test_qwen2_biases_and_report_for_a_block_the_op_cannot_take(native):
    assert spec.spec_of(model_for("qwen2").layers[0]).qkv_bias
    model = tiny_arch.make_model("qwen3_moe")
    report = patch.apply_kernels(model, "auto")
    assert "2 decoder layers not as one op: MLP is not the SwiGLU MLP class" in report.detail, report.detail
    patch.apply_kernels(model, "builtin")


def test_plan_takes_names_not_positions(native):
    s = spec.spec_of(model_for("llama").layers[0])
    names = list(s.names())
    assert native.decoder_layer_plan(names, s.config()) is not None
    assert native.decoder_layer_plan(list(reversed(names)), s.config()) is not None  # any order
    assert native.decoder_layer_plan(names + ["o.bias"], s.config()) is None  # a weight the op has no slot for
    assert native.decoder_layer_plan(names[:-1], s.config()) is None  # a missing one
    assert native.decoder_layer_plan(names, {**s.config(), "activation": 7}) is None


def _silu_mlp(self, x):
    import mlx.nn as nn

    return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _phi3_gelu_mlp(self, x):
    import mlx.nn as nn

    gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
    return self.down_proj(nn.gelu_approx(gate) * up)


def _with_bias(original):
    # 2.0 on hidden states reaching ~36 here (the self-check compares relative to the largest magnitude)
    def __call__(self, x, mask=None, cache=None):
        return original(self, x, mask, cache) + 2.0

    return __call__


def _olmo_per_head_qk_norm(original):
    # q/k normalised per head (Qwen3's way) instead of over the whole projection: the norm weight would not even
    # fit, so the changed attention applies the first head_dim entries per head.
    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        d = self.head_dim
        q = mx.fast.rms_norm(self.q_proj(x).reshape(B, L, -1, d), self.q_norm.weight[:d], self.q_norm.eps)
        k = mx.fast.rms_norm(self.k_proj(x).reshape(B, L, -1, d), self.k_norm.weight[:d], self.k_norm.eps)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, -1, d).transpose(0, 2, 1, 3)
        if cache is not None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        from mlx_lm.models.base import scaled_dot_product_attention

        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return __call__


def _ministral3_unscaled(original):
    # The attention ignoring the factor its model passes (queries never rescaled past the original context).
    def __call__(self, x, attn_scale=None, mask=None, cache=None):
        return original(self, x, mx.ones((x.shape[1], 1)), mask, cache)

    return __call__


def _ministral3_with_bias(original):
    def __call__(self, x, attn_scale=None, mask=None, cache=None):
        return original(self, x, attn_scale, mask, cache) + 2.0

    return __call__


_BLOCKS = {"gemma3_text": gemma3_text.TransformerBlock, "phi3": phi3.TransformerBlock,
           "olmo2": olmo2.TransformerBlock, "olmo3": olmo3.Olmo3DecoderLayer}


@pytest.mark.parametrize("name,change", [("gemma3_text", "silu mlp"), ("gemma3_text", "added bias"),
                                         ("phi3", "gelu mlp"), ("phi3", "added bias"), ("olmo2", "added bias"),
                                         ("olmo2", "per-head q/k norms"), ("olmo3", "added bias"),
                                         ("ministral3", "added bias"), ("ministral3", "unscaled queries")])
def test_selfcheck_refuses_changed_classes(native, float_prefill, monkeypatch, name, change):
    if name == "ministral3":  # its block and attention take attn_scale between x and mask
        if change == "added bias":
            monkeypatch.setattr(ministral3.TransformerBlock, "__call__",
                                _ministral3_with_bias(ministral3.TransformerBlock.__call__))
        else:
            monkeypatch.setattr(ministral3.Attention, "__call__", _ministral3_unscaled(ministral3.Attention.__call__))
    elif change == "silu mlp":
        monkeypatch.setattr(gemma3_text.MLP, "__call__", _silu_mlp)
    elif change == "gelu mlp":
        monkeypatch.setattr(phi3.MLP, "__call__", _phi3_gelu_mlp)
    elif change == "per-head q/k norms":
        monkeypatch.setattr(olmo2.Attention, "__call__", _olmo_per_head_qk_norm(olmo2.Attention.__call__))
    else:
        monkeypatch.setattr(_BLOCKS[name], "__call__", _with_bias(_BLOCKS[name].__call__))
    model = model_for(name)
    patch.apply_kernels(model, "builtin")
    tokens = greedy(model)[:4]
    expected = teacher_forced(model, tokens)
    report = patch.apply_kernels(model, "auto")
    assert "self-check" in report.detail and "disagreed" in report.detail, report.detail
    assert "decoder layers as one op" not in report.detail, report.detail
    got = teacher_forced(model, tokens)
    assert mx.allclose(got, expected, atol=2e-3, rtol=2e-3).item(), float(mx.abs(got - expected).max())
    assert not any(selfcheck._is_fused(m) for _, m in model.named_modules())
    patch.apply_kernels(model, "builtin")


@pytest.mark.parametrize("name", ["gemma3_text", "olmo3", "ministral3"])
def test_sliding_batched_rows_match_alone(native, monkeypatch, name):
    """The server's way (rows prefilled alone, merged by mlx-lm: a BatchKVCache, for the sliding layers' rotating
    caches a BatchRotatingKVCache; decoded together) past the sliding window: the batched sliding layers run per
    op (mlx-lm's), each row still gets its own greedy tokens."""
    monkeypatch.setenv("MLXINFER_KV_DTYPE", "float32")
    model = model_for(name)
    assert "2 decoder layers as one op" in patch.apply_kernels(model, "auto").detail
    prompts, steps = [PROMPT, PROMPT[5:15]], 20

    def alone(prompt):
        cache = cache_lib.make_prompt_cache(model)
        tokens = [int(mx.argmax(model(mx.array([prompt]), cache=cache)[0, -1]))]
        for _ in range(steps):
            tokens.append(int(mx.argmax(model(mx.array([[tokens[-1]]]), cache=cache)[0, -1])))
        return tokens

    want = [alone(p) for p in prompts]
    caches = [cache_lib.make_prompt_cache(model) for _ in prompts]
    got = [[int(mx.argmax(model(mx.array([p]), cache=c)[0, -1]))] for p, c in zip(prompts, caches)]
    batch = [layer[0].merge(list(layer)) for layer in zip(*caches)]  # sliding layers: a BatchRotatingKVCache
    for _ in range(steps):
        y = mx.argmax(model(mx.array([[g[-1]] for g in got]), cache=batch)[:, -1], axis=-1).tolist()
        for g, t in zip(got, y):
            g.append(t)
    assert got == want
    patch.apply_kernels(model, "builtin")
