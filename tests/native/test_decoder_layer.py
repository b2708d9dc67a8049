"""The spec-driven whole-layer op (``decoder_layer``) against the same layer written in MLX ops: Gemma-style
(sandwich 1 + w norms, q/k norms, GELU-tanh, sliding window), Phi-style (fused qkv and gate_up, partial rotary
with precomputed periods and an input scale) and OLMo-style (post norms only, q/k norms over the whole
projection, YaRN-like periods and input scale) layers, batch 2, prefill chunks past the window, float16 caches."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import create_causal_mask

pytestmark = [pytest.mark.slow,  # needs the compiled extension (built by the fixture when missing)
              # Float parity with MLX: prefill at float32 (the AVX2 int8 prefill GEMM off, as the load-time
              # self-check runs); tests/kernels/test_spec_layers.py holds the int8 default to its tolerance.
              pytest.mark.usefixtures("float_prefill")]

# (B, L, hidden, intermediate, n_heads, n_kv_heads, head_dim, rope dims, offset, group, bits, window, kind, half)
CASES = [
    (2, 6, 256, 384, 4, 1, 64, 64, 20, 64, 4, 8, "gemma", False),  # prefill chunk past the window, batch 2
    (1, 1, 256, 384, 4, 2, 64, 64, 30, 64, 4, 8, "gemma", True),   # decode past the window, float16 cache
    (1, 5, 256, 384, 4, 2, 64, 64, 0, 64, 4, 16, "gemma", False),  # inside the window: plain causal
    (1, 4, 256, 512, 4, 4, 64, 48, 9, 32, 4, 0, "phi", False),     # fused qkv/gate_up, partial rotary, LongRoPE
    (2, 1, 256, 512, 4, 2, 64, 48, 9, 32, 8, 0, "phi", True),
    (2, 6, 256, 384, 4, 2, 64, 64, 20, 64, 4, 8, "olmo", False),   # post norms, whole q/k norms, window
    (1, 1, 256, 384, 8, 2, 32, 32, 11, 32, 4, 0, "olmo", True),
]


def _case_layer(case):
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    mx.random.seed(sum(c for c in case if isinstance(c, int)))
    q = lambda s: mx.quantize(mx.random.normal(s) * 0.1, group_size=gs, bits=bits)  # noqa: E731
    qd, kvd = hq * D, hkv * D
    arrays: dict = {}

    def lin(name, shape):
        arrays[f"{name}.weight"], arrays[f"{name}.scales"], arrays[f"{name}.biases"] = q(shape)

    if kind in ("gemma", "olmo"):
        for name, shape in (("q", (qd, E)), ("k", (kvd, E)), ("v", (kvd, E)), ("o", (E, qd)), ("gate", (I, E)),
                            ("up", (I, E)), ("down", (E, I))):
            lin(name, shape)
    if kind == "gemma":
        for name in ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm"):
            arrays[name] = 0.1 * mx.random.normal((E,))
        arrays["q_norm"], arrays["k_norm"] = 0.1 * mx.random.normal((D,)), 0.1 * mx.random.normal((D,))
    elif kind == "olmo":  # no pre norms; q/k norms as wide as the projections
        for name, width in (("attn_out_norm", E), ("mlp_out_norm", E), ("q_norm", qd), ("k_norm", kvd)):
            arrays[name] = 1 + 0.1 * mx.random.normal((width,))
        arrays["rope_freqs"] = mx.power(10000.0, mx.arange(0, dims, 2) / dims) * (1 + mx.arange(dims // 2) / 5)
    else:
        for name, shape in (("qkv", (qd + 2 * kvd, E)), ("o", (E, qd)), ("gate_up", (2 * I, E)), ("down", (E, I))):
            lin(name, shape)
        arrays["attn_norm"], arrays["mlp_norm"] = 1 + 0.1 * mx.random.normal((E,)), 1 + 0.1 * mx.random.normal((E,))
        arrays["rope_freqs"] = mx.power(10000.0, mx.arange(0, dims, 2) / dims) * (1 + mx.arange(dims // 2) / 3)
    config = {"group_size": gs, "bits": bits, "n_heads": hq, "n_kv_heads": hkv, "head_dim": D, "rope_dims": dims,
              "traditional": 0, "rope_base": 10000.0, "rope_scale": 1.0,
              "rope_mscale": 1.0 if kind == "gemma" else 1.19, "attn_scale": 0.1 if kind == "gemma" else D ** -0.5,
              "norm_eps": 1e-6, "qk_norm_eps": 1e-6, "qk_norm_whole": 1 if kind == "olmo" else 0,
              "norm_offset": 1.0 if kind == "gemma" else 0.0, "activation": 1 if kind == "gemma" else 0,
              "window": window, "q_row_scale": 0}
    return arrays, config


def _reference(x, a, c, k_old, v_old, kind, causal, q_scale=None):
    B, L, _ = x.shape
    hq, hkv, D, dims, off = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["rope_dims"], c["norm_offset"]
    mm = lambda t, n: mx.quantized_matmul(t, a[f"{n}.weight"], a[f"{n}.scales"], a[f"{n}.biases"],  # noqa: E731
                                          transpose=True, group_size=c["group_size"], bits=c["bits"])
    norm = lambda t, n: mx.fast.rms_norm(t, a[n] + off, c["norm_eps"])  # noqa: E731
    heads = lambda t, n: t.reshape(B, L, n, D).transpose(0, 2, 1, 3)  # noqa: E731
    freqs = a.get("rope_freqs")

    def rope(t):
        t = t.at[..., :dims].multiply(c["rope_mscale"]) if c["rope_mscale"] != 1.0 else t
        return mx.fast.rope(t, dims, traditional=False, base=None if freqs is not None else c["rope_base"],
                            scale=1.0, offset=k_old.shape[2], freqs=freqs)

    if kind == "olmo":  # post norms only: the projections read x and h themselves
        q = heads(mx.fast.rms_norm(mm(x, "q"), a["q_norm"], c["qk_norm_eps"]), hq)
        k = heads(mx.fast.rms_norm(mm(x, "k"), a["k_norm"], c["qk_norm_eps"]), hkv)
        q, k, v = rope(q), rope(k), heads(mm(x, "v"), hkv)
        keys, values = mx.concatenate([k_old, k], axis=2), mx.concatenate([v_old, v], axis=2)
        mask = create_causal_mask(L, k_old.shape[2], window_size=c["window"] or None) if L > 1 else None
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=c["attn_scale"], mask=mask)
        h = x + norm(mm(o.transpose(0, 2, 1, 3).reshape(B, L, -1), "o"), "attn_out_norm")
        return h + norm(mm(nn.silu(mm(h, "gate")) * mm(h, "up"), "down"), "mlp_out_norm"), keys, values
    xn = norm(x, "attn_norm")
    if kind == "gemma":
        q, k, v = heads(mm(xn, "q"), hq), heads(mm(xn, "k"), hkv), heads(mm(xn, "v"), hkv)
        q = mx.fast.rms_norm(q, a["q_norm"] + off, c["qk_norm_eps"])
        k = mx.fast.rms_norm(k, a["k_norm"] + off, c["qk_norm_eps"])
    else:
        q, k, v = mx.split(mm(xn, "qkv"), [hq * D, (hq + hkv) * D], axis=-1)
        q, k, v = heads(q, hq), heads(k, hkv), heads(v, hkv)
    q, k = rope(q), rope(k)
    if q_scale is not None:  # Ministral 3: queries * attn_scale (B or 1, 1, L, 1) after RoPE
        q = q * q_scale
    keys, values = mx.concatenate([k_old, k], axis=2), mx.concatenate([v_old, v], axis=2)
    mask = "causal" if causal and L > 1 else None
    if c["window"]:
        mask = create_causal_mask(L, k_old.shape[2], window_size=c["window"])
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=c["attn_scale"], mask=mask)
    r = mm(o.transpose(0, 2, 1, 3).reshape(B, L, -1), "o")
    h = x + (norm(r, "attn_out_norm") if kind == "gemma" else r)
    hn = norm(h, "mlp_norm")
    if kind == "gemma":
        m = mm(nn.gelu_approx(mm(hn, "gate")) * mm(hn, "up"), "down")
        return h + norm(m, "mlp_out_norm"), keys, values
    g, u = mx.split(mm(hn, "gate_up"), 2, axis=-1)
    return h + mm(nn.silu(g) * u, "down"), keys, values


@pytest.mark.parametrize("case", CASES)
def test_matches_mlx(native_ext, case):
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    arrays, config = _case_layer(case)
    x = mx.random.normal((B, L, E))
    k_old, v_old = mx.random.normal((B, hkv, offset, D)), mx.random.normal((B, hkv, offset, D))
    if half:  # the reference sees what a float16 cache holds
        k_old, v_old = k_old.astype(mx.float16).astype(mx.float32), v_old.astype(mx.float16).astype(mx.float32)
    cap = offset + L + 5
    k_buf = native_ext.kv_reserve([B, hkv, cap, D], k_old, valid=offset, half=half)
    v_buf = native_ext.kv_reserve([B, hkv, cap, D], v_old, valid=offset, half=half)
    names = sorted(arrays)  # any order: the op goes by name
    plan = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
    y, k2, v2 = native_ext.decoder_layer(x, [arrays[n] for n in names], k_buf, v_buf, offset, L > 1, plan)
    ref_y, ref_k, ref_v = _reference(x, arrays, config, k_old, v_old, kind, L > 1)
    mx.eval(y, k2, v2, ref_y)
    tol = 2e-2 if half else 2e-3
    scale = float(mx.abs(ref_y).max())
    assert float(mx.abs(y - ref_y).max()) < tol * scale
    n = offset + L
    assert mx.allclose(k2[:, :, :n].astype(mx.float32), ref_k, atol=tol * 10).item()
    assert mx.allclose(v2[:, :, :n].astype(mx.float32), ref_v, atol=tol * 10).item()


@pytest.mark.parametrize("per_batch_row", [False, True])
def test_query_row_scale(native_ext, per_batch_row):
    """A plan with q_row_scale multiplies each query row by its q_scale value (Ministral 3's llama-4 attention
    scaling: one factor per position, or per batch row and position in a left-padded batch), keys untouched."""
    case = CASES[0]
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    arrays, config = _case_layer(case)
    config["q_row_scale"] = 1
    x = mx.random.normal((B, L, E))
    k_old, v_old = mx.random.normal((B, hkv, offset, D)), mx.random.normal((B, hkv, offset, D))
    shape = (B, 1, L, 1) if per_batch_row else (L, 1)  # what ministral3's _get_llama_4_attn_scale returns
    q_scale = 1 + 0.5 * mx.random.uniform(shape=shape)
    bufs = [native_ext.kv_reserve([B, hkv, offset + L, D], t, valid=offset) for t in (k_old, v_old)]
    names = sorted(arrays)
    plan = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
    y, k2, _ = native_ext.decoder_layer(x, [arrays[n] for n in names], *bufs, offset, True, plan,
                                        q_scale=q_scale.reshape(-1))
    ref_y, ref_k, _ = _reference(x, arrays, config, k_old, v_old, kind, True, q_scale=q_scale)
    plain_y, _, _ = _reference(x, arrays, config, k_old, v_old, kind, True)
    mx.eval(y, k2, ref_y, plain_y)
    scale = float(mx.abs(ref_y).max())
    assert float(mx.abs(y - ref_y).max()) < 2e-3 * scale
    assert float(mx.abs(plain_y - ref_y).max()) > 5e-2 * scale  # the scale matters at these values
    assert mx.allclose(k2[:, :, :offset + L], ref_k, atol=2e-2).item()


def test_query_row_scale_comes_with_its_plan(native_ext):
    arrays, config = _case_layer(CASES[0])
    names = sorted(arrays)
    ws = [arrays[n] for n in names]
    x = mx.zeros((2, 6, 256))
    kb = native_ext.kv_reserve([2, 1, 32, 64])
    plain = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
    scaled = native_ext.decoder_layer_plan(names, {**{k: float(v) for k, v in config.items()}, "q_row_scale": 1.0})
    with pytest.raises(ValueError, match="needs q_scale"):
        native_ext.decoder_layer(x, ws, kb, kb, 0, True, scaled)
    with pytest.raises(ValueError, match="takes no q_scale"):
        native_ext.decoder_layer(x, ws, kb, kb, 0, True, plain, q_scale=mx.ones((6,)))
    for bad in (mx.ones((5,)), mx.ones((6,), dtype=mx.float16), mx.ones((3, 6))):
        with pytest.raises(ValueError, match="q_scale must be float32 with L or B \\* L"):
            native_ext.decoder_layer(x, ws, kb, kb, 0, True, scaled, q_scale=bad)


def test_plan_rejects_what_is_not_a_layer(native_ext):
    arrays, config = _case_layer(CASES[0])
    config = {k: float(v) for k, v in config.items()}
    names = sorted(arrays)
    with pytest.raises(ValueError, match="unknown weight name"):
        native_ext.decoder_layer_plan(names + ["softcap"], config)
    with pytest.raises(ValueError, match="given twice"):
        native_ext.decoder_layer_plan(names + ["q.weight"], config)
    with pytest.raises(ValueError, match="needs q, k, v"):
        native_ext.decoder_layer_plan([n for n in names if not n.startswith("k.")], config)
    with pytest.raises(ValueError, match="lacks 'window'"):
        native_ext.decoder_layer_plan(names, {k: v for k, v in config.items() if k != "window"})
    with pytest.raises(ValueError, match="symmetric is a promise about tiled weights"):
        native_ext.decoder_layer_plan(names, {**config, "symmetric": 1.0})
    plan = native_ext.decoder_layer_plan(names, config)
    x = mx.zeros((1, 1, 256))
    kb = native_ext.kv_reserve([1, 1, 8, 64])
    with pytest.raises(ValueError, match="match the plan"):
        native_ext.decoder_layer(x, [arrays[n] for n in names[:-1]], kb, kb, 0, False, plan)
    swapped = [arrays[n] for n in names]
    i, j = names.index("attn_norm"), names.index("q_norm")
    swapped[i], swapped[j] = swapped[j], swapped[i]  # arrays not in the plan's name order
    with pytest.raises(ValueError):
        native_ext.decoder_layer(x, swapped, kb, kb, 0, False, plan)


def test_qk_norm_width_must_match_the_plan(native_ext):
    """Whole-projection q/k norms (OLMo) and per-head ones (Qwen3, Gemma) differ by the plan's qk_norm_whole; a
    weight of the other width is refused when the graph is built, not read past its end."""
    arrays, config = _case_layer(CASES[5])
    names = sorted(arrays)
    x = mx.zeros((2, 1, 256))
    kb = native_ext.kv_reserve([2, 2, 8, 64])
    per_head = native_ext.decoder_layer_plan(names, {**{k: float(v) for k, v in config.items()}, "qk_norm_whole": 0.0})
    with pytest.raises(ValueError, match="q_norm must be float32 \\(64,\\)"):
        native_ext.decoder_layer(x, [arrays[n] for n in names], kb, kb, 0, False, per_head)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]])
def test_half_scales_give_the_float32_result(native_ext, case):
    """Scales/biases as a CPU model keeps them (float16, as stored) give exactly the result of their float32
    copies: decode rows, and a 12-row prefill (the dequantized tiles)."""
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    arrays, config = _case_layer(case)
    quant = lambda n: n.endswith((".scales", ".biases"))  # noqa: E731
    half_arrays = {n: a.astype(mx.float16) if quant(n) else a for n, a in arrays.items()}
    wide_arrays = {n: a.astype(mx.float32) if quant(n) else a for n, a in half_arrays.items()}  # widened exactly
    x = mx.random.normal((B, L, E))
    names = sorted(arrays)
    plan = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
    outs = []
    for a in (half_arrays, wide_arrays):
        bufs = [native_ext.kv_reserve([B, hkv, offset + L, D], mx.zeros((B, hkv, offset, D)), valid=offset, half=half)
                for _ in range(2)]
        outs.append(native_ext.decoder_layer(x, [a[n] for n in names], *bufs, offset, L > 1, plan))
        mx.eval(outs[-1])
    for got, want in zip(*outs):
        assert mx.array_equal(got, want).item()


def test_held_weights_give_the_graph_input_result(native_ext):
    """Weights already evaluated (a loaded model's) are held by the op instead of being graph inputs (less eval
    bookkeeping per token); lazy ones stay graph inputs. Both give the same layer, bit for bit."""
    case = CASES[3]
    B, L, E, I, hq, hkv, D, dims, offset, gs, bits, window, kind, half = case
    names = None
    outs = []
    for evaluated in (False, True):
        arrays, config = _case_layer(case)  # seeded: the same weights both times
        if evaluated:
            mx.eval(list(arrays.values()))
        x = mx.random.normal((B, L, E), key=mx.random.key(7))
        names = sorted(arrays)
        plan = native_ext.decoder_layer_plan(names, {k: float(v) for k, v in config.items()})
        bufs = [native_ext.kv_reserve([B, hkv, offset + L, D], None, valid=0, half=half) for _ in range(2)]
        outs.append(native_ext.decoder_layer(x, [arrays[n] for n in names], *bufs, 0, L > 1, plan))
        mx.eval(outs[-1])
    for a, b in zip(*outs):
        assert mx.array_equal(a, b).item()
