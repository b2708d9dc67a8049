"""GGUF import on tiny synthetic files written here with ``gguf.GGUFWriter`` (a 2-layer llama, KBs each).

- Q4_0 / Q4_1 / Q8_0 repack bit-exactly: MLX's dequantization of our tensors equals ``gguf.quants.dequantize``.
- F16 is kept as F16 (exact); Q4_K repacks up to float16 rounding of its scales; Q6_K is re-quantized to MLX
  8-bit within one quantization step.
- Q/K rows written with llama.cpp's permutation are un-permuted: the imported model gives the logits of the
  original Hugging Face-layout model.
- Bad files raise ``InvalidModel`` and leave nothing in the cache; a second import is a cache hit.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mlxinfer.errors import InvalidModel
from mlxinfer.sources import gguf_config, gguf_import
from mlxinfer.sources.gguf_import import import_gguf

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies start with these 256 tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = SPECIALS + _byte_chars() + ["Ġt", "he", "Ġthe", "in", "Ġa"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


VOCAB = len(tiny_vocab()[0])


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows (interleaved RoPE order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of a tiny llama in Hugging Face layout (out_features, in_features)."""
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, HIDDEN)), "model.norm.weight": 1 + rng.normal(0, .1, HIDDEN),
         "lm_head.weight": rng.normal(0, 0.1, (VOCAB, HIDDEN))}
    shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
              "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rng.normal(0, 0.1, shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{norm}.weight"] = 1 + rng.normal(0, 0.1, HIDDEN)
    return {k: v.astype(np.float32) for k, v in w.items()}


_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_TO_GGUF[part]}.{suffix}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[base] + "." + suffix


def write_gguf(path: Path, weights: dict[str, np.ndarray], qtype=QT.F32, *, arch: str = "llama",
               types: dict[str, object] | None = None, permute: bool = True,
               extra: dict[str, np.ndarray] | None = None, rope_theta: float = 10000.0) -> Path:
    """A llama GGUF like llama.cpp writes it: Q/K permuted, 2-D weights in ``qtype``, norms F32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Tiny Test Llama")
    w.add_size_label("1M")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_theta)
    tokens, toktypes, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf, arr in weights.items():
        if permute and ".q_proj." in hf:
            arr = llama_permute(arr, HEADS)
        elif permute and ".k_proj." in hf:
            arr = llama_permute(arr, KV_HEADS)
        t = (types or {}).get(hf, qtype if arr.ndim == 2 else QT.F32)
        if isinstance(t, tuple):  # (type, raw blocks) made by the test
            w.add_tensor(gguf_name(hf), t[1], raw_dtype=t[0])
        elif t in (QT.F32, QT.F16):
            w.add_tensor(gguf_name(hf), arr.astype(np.float32 if t == QT.F32 else np.float16))
        elif t == QT.I32:
            w.add_tensor(gguf_name(hf), arr.astype(np.int32))
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(arr, t), raw_dtype=t)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MLXINFER_CACHE", str(root))
    return root


def load_weights(model_dir: Path) -> dict[str, mx.array]:
    return mx.load(str(model_dir / "model.safetensors"))


def mlx_dequant(w: dict, prefix: str, bits: int) -> np.ndarray:
    # float32 scales (as the CPU loader uses them): then d*q + m is exact in float32, like gguf's own arithmetic
    out = mx.dequantize(w[f"{prefix}.weight"], w[f"{prefix}.scales"].astype(mx.float32),
                        w[f"{prefix}.biases"].astype(mx.float32), group_size=32, bits=bits)
    return np.array(out)


@pytest.mark.parametrize("qtype,bits", [(QT.Q4_0, 4), (QT.Q4_1, 4), (QT.Q8_0, 8), (QT.Q5_0, 5), (QT.Q5_1, 5)])
def test_exact_types_repack_bit_for_bit(tmp_path, qtype, bits):
    weights = hf_weights()
    model_dir = import_gguf(write_gguf(tmp_path / "m.gguf", weights, qtype))
    w = load_weights(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    for hf, arr in weights.items():
        if arr.ndim != 2:
            continue
        prefix = hf.removesuffix(".weight")
        # Q/K were quantized after llama.cpp's row permutation; blocks lie within rows, so un-permuting our
        # rows must give exactly the blocks of the unpermuted matrix
        expected = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        got = mlx_dequant(w, prefix, bits)
        assert got.dtype == np.float32 and np.array_equal(got, expected), hf


def _random_kquant(rng, shape: tuple[int, int], qtype) -> np.ndarray:
    """Random K-quant blocks with sane float16 super-block scales (the rest of the bytes may be anything)."""
    n_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (shape[0] * shape[1] // 256, n_bytes), dtype=np.uint8)
    half = lambda v: np.full(len(raw), v, np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if qtype in (QT.Q4_K, QT.Q5_K):
        raw[:, 0:2], raw[:, 2:4] = half(0.002), half(0.001)  # d, dmin
    else:  # Q6_K: d is the last field
        raw[:, -2:] = half(0.0005)
    return raw.reshape(shape[0], -1)


@pytest.mark.parametrize("kquant,bits", [(QT.Q4_K, 4), (QT.Q5_K, 5)])
def test_f16_kept_and_k_quants_converted_within_tolerance(tmp_path, kquant, bits):
    weights = hf_weights()
    rng = np.random.default_rng(1)
    q4k, q6k = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"  # in = 256
    raw = {q4k: _random_kquant(rng, weights[q4k].shape, kquant), q6k: _random_kquant(rng, weights[q6k].shape, QT.Q6_K)}
    types = {hf: (kquant if hf == q4k else QT.Q6_K, blocks) for hf, blocks in raw.items()}
    model_dir = import_gguf(write_gguf(tmp_path / "m.gguf", weights, QT.F16, types=types))
    w = load_weights(model_dir)
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert w[q_proj].dtype == mx.float16
    assert np.array_equal(np.array(w[q_proj]), weights[q_proj].astype(np.float16))
    assert np.array_equal(np.array(w["model.norm.weight"]), weights["model.norm.weight"])

    # Q4_K/Q5_K: each 32-weight sub-block is affine (d*sc*q - dmin*m), repacked with the same q; only the scale
    # and bias are rounded to float16 (relative error <= 2^-11 each): |error| <= (q_max * scale + |bias|) * 2^-11
    source = gguf.quants.dequantize(raw[q4k], kquant).reshape(-1, 32)
    got = mlx_dequant(w, q4k.removesuffix(".weight"), bits).reshape(-1, 32)
    scale = np.abs(np.array(w[q4k.replace("weight", "scales")].astype(mx.float32))).reshape(-1)
    bias = np.abs(np.array(w[q4k.replace("weight", "biases")].astype(mx.float32))).reshape(-1)
    bound = ((2**bits - 1) * scale + bias) * 2**-11 + 1e-9
    assert (np.abs(got - source).max(axis=1) <= bound).all()

    # Q6_K (16-weight sub-blocks, no MLX equivalent): dequantized and re-quantized to 8 bits, group 32.
    # mx.quantize's step s = (max - min) / 255 is snapped so the larger-magnitude end is exact (it moves by at
    # most s / 256, as that end lies >= 127.5 s from 0), so the far end moves < s and interior values stay
    # within half a step: |error| < s, plus float16 rounding of the stored scale (255 steps) and bias.
    source = gguf.quants.dequantize(raw[q6k], QT.Q6_K).reshape(-1, 32)
    got = mlx_dequant(w, q6k.removesuffix(".weight"), 8).reshape(-1, 32)
    step = (source.max(axis=1) - source.min(axis=1)) / 255
    bound = step + 255 * step * 2**-11 + np.abs(source).max(axis=1) * 2**-11 + 1e-9
    assert (np.abs(got - source).max(axis=1) <= bound).all()
    config = json.loads((model_dir / "config.json").read_text())
    quant = config["quantization"]
    assert quant.get("model.layers.1.mlp.down_proj", quant)["bits"] == 8
    assert quant.get("model.layers.0.mlp.down_proj", quant)["bits"] == bits
    from mlx_lm import load

    model, _ = load(str(model_dir))  # the mixed F16 / 4- or 5-bit / 8-bit directory loads and runs
    assert np.isfinite(_logits(model, [5, 6, 7])).all()


def test_bf16_kept_exact(tmp_path):
    weights = hf_weights()
    name = "model.layers.0.mlp.up_proj.weight"
    bits = (weights[name].view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 = the top half of float32
    types = {name: (QT.BF16, bits.view(np.uint8))}
    w = load_weights(import_gguf(write_gguf(tmp_path / "m.gguf", weights, QT.Q8_0, types=types)))
    assert w[name].dtype == mx.bfloat16
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(np.array(w[name].astype(mx.float32)), expected)


def _logits(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def original_model(weights: dict[str, np.ndarray], rope_scaling: dict | None = None):
    """The same tiny llama built by mlx-lm itself from Hugging Face-layout weights."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5, vocab_size=VOCAB,
        rope_theta=10000.0, head_dim=HEAD_DIM, tie_word_embeddings=False, max_position_embeddings=128,
        rope_scaling=rope_scaling)
    model = llama.Model(args)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    assert {k for k, _ in tree_flatten(model.parameters())} == set(weights)
    return model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_architectures_give_the_original_logits(tmp_path, arch):
    """No Q/K permutation for these; qwen2 has q/k/v biases, qwen3 q/k RMSNorms and tied embeddings."""
    import importlib

    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    fields = dict(model_type=arch, hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN,
                  num_attention_heads=HEADS, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=128, rope_theta=1e6, tie_word_embeddings=True)
    if arch == "qwen3":
        fields["head_dim"] = HEAD_DIM
    original = module.Model(module.ModelArgs(**fields))
    rng = np.random.default_rng(5)
    weights = {k: rng.normal(1.0 if "norm" in k else 0.0, 0.1, v.shape).astype(np.float32)
               for k, v in tree_flatten(original.parameters())}
    original.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    path = write_gguf(tmp_path / "m.gguf", weights, QT.F32, arch=arch, permute=False, rope_theta=1e6)
    imported, _ = load(str(import_gguf(path)))
    tokens = [5, 17, 200, 3, 99, 42, 7, 250]
    np.testing.assert_allclose(_logits(imported, tokens), _logits(original, tokens), rtol=1e-4, atol=1e-4)


_GEMMA_NAMES = {**_TO_GGUF, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def test_gemma3_gives_the_original_logits(tmp_path):
    """gemma3: llama.cpp's own norm names, RMSNorm weights stored as 1 + w, local/global RoPE and sliding window
    from the metadata, tied embeddings."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.models import gemma3_text

    layers, window = 6, 4  # layer 5 is global (pattern 6); a 4-token window matters for 10 tokens
    original = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=HIDDEN, num_hidden_layers=layers, intermediate_size=FFN,
        num_attention_heads=HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=KV_HEADS,
        rope_theta=1e6, rope_local_base_freq=10000.0, query_pre_attn_scalar=HEAD_DIM, sliding_window=window,
        sliding_window_pattern=6, max_position_embeddings=128))
    original.sanitize({})  # no lm_head.weight: tied embeddings, as in the GGUF
    rng = np.random.default_rng(6)
    weights = {k: rng.normal(0.0, 0.3 if "norm" in k else 0.1, v.shape).astype(np.float32)
               for k, v in tree_flatten(original.parameters())}
    original.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 128), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_key_length, HEAD_DIM), (w.add_value_length, HEAD_DIM), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_rope_freq_base, 1e6), (w.add_sliding_window, window)):
        add(value)
    tokens, toktypes, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    for hf, arr in weights.items():
        base = hf.removesuffix(".weight")
        if base.startswith("model.layers."):
            _, _, layer, part = base.split(".", 3)
            name = f"blk.{layer}.{_GEMMA_NAMES[part]}.weight"
        else:
            name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}[base] + ".weight"
        w.add_tensor(name, arr + 1 if hf.endswith("norm.weight") else arr)  # llama.cpp's Gemma norm convention
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    model_dir = import_gguf(tmp_path / "g.gguf")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["query_pre_attn_scalar"]) == ("gemma3_text", 4, 16)
    imported, _ = load(str(model_dir))
    tokens = [5, 17, 200, 3, 99, 42, 7, 250, 11, 64]
    np.testing.assert_allclose(_logits(imported, tokens), _logits(original, tokens), rtol=1e-4, atol=1e-4)


def test_qk_unpermutation_gives_the_original_logits(tmp_path, monkeypatch):
    from mlx_lm import load

    weights = hf_weights(seed=3)
    original = original_model(weights)
    model_dir = import_gguf(write_gguf(tmp_path / "m.gguf", weights, QT.F32))
    imported, _ = load(str(model_dir))
    tokens = [5, 17, 200, 3, 99, 42, 7, 250]
    expected = _logits(original, tokens)
    np.testing.assert_allclose(_logits(imported, tokens), expected, rtol=1e-4, atol=1e-4)

    # the same file imported without un-permuting gives other logits: the check above can fail
    monkeypatch.setitem(gguf_config.ARCHS, "llama", ("llama", "LlamaForCausalLM", False))
    monkeypatch.setattr(gguf_import, "IMPORT_VERSION", 999)
    wrong, _ = load(str(import_gguf(tmp_path / "m.gguf")))
    assert np.abs(_logits(wrong, tokens) - expected).max() > 1e-2


def llama3_rope_factors(factor=32.0, low=1.0, high=4.0, orig=8192, base=10000.0) -> np.ndarray:
    """The ``rope_freqs`` tensor as llama.cpp's convert_hf_to_gguf.py computes it for Llama 3.x."""
    out = []
    for freq in 1.0 / (base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM)):
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from mlx_lm import load

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = llama3_rope_factors()
    # all three regions of the rule occur at this head_dim: kept, interpolated, fully scaled
    assert (factors == 1).any() and (factors == 32).any() and ((factors > 1) & (factors < 32)).any()
    weights = hf_weights(seed=4)
    path = write_gguf(tmp_path / "m.gguf", weights, QT.F32, extra={"rope_freqs.weight": factors})
    model_dir = import_gguf(path)
    assert json.loads((model_dir / "config.json").read_text())["rope_scaling"] == scaling
    imported, _ = load(str(model_dir))
    tokens = list(range(3, 3 + 40))
    expected = _logits(original_model(weights, scaling), tokens)
    np.testing.assert_allclose(_logits(imported, tokens), expected, rtol=1e-4, atol=1e-4)
    assert np.abs(_logits(original_model(weights), tokens) - expected).max() > 1e-3  # the scaling matters

    bad = write_gguf(tmp_path / "bad.gguf", weights, QT.F32, extra={"rope_freqs.weight": factors[::-1].copy()})
    with pytest.raises(InvalidModel, match="rope_freqs"):
        import_gguf(bad)


def test_config_metadata_tokenizer_and_mlx_lm_load(tmp_path):
    from mlx_lm import load

    model_dir = import_gguf(write_gguf(tmp_path / "m.gguf", hf_weights(), QT.Q8_0))
    config = json.loads((model_dir / "config.json").read_text())
    info = config["mlxinfer"]
    assert (info["name"], info["size_label"], info["file_type_name"]) == ("Tiny Test Llama", "1M", "Q8_0")
    # EOS first, then the control tokens llama.cpp also treats as end of generation (<|endoftext|>)
    assert config["eos_token_id"] == [2, 0] and config["num_key_value_heads"] == KV_HEADS
    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(" the in<|im_end|>", add_special_tokens=False)
    tokens = tiny_vocab()[0]
    assert ids == [tokens.index("Ġthe"), tokens.index("Ġ"), tokens.index("in"), 2]
    assert tokenizer.eos_token_id == 2


def test_reimport_is_a_cache_hit(tmp_path, monkeypatch, cache):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), QT.Q4_0)
    seen = []
    first = import_gguf(path, progress=lambda stage, done, total: seen.append((stage, done, total)))
    n_tensors = 2 + 9 * LAYERS + 1  # embeddings, output, final norm + 9 per layer
    assert seen[:2] == [("hash", 0, 1), ("hash", 1, 1)] and ("import", n_tensors, n_tensors) in seen
    assert seen[-1] == ("write", 1, 1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_import, "convert_gguf", boom)
    assert import_gguf(path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir()] == [first.name]


def _cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_gguf_is_rejected_and_leaves_nothing(tmp_path, cache, cut):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), QT.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[:200] if cut == "header" else data[: len(data) - 1000])
    with pytest.raises(InvalidModel, match="truncated"):
        import_gguf(path)
    assert _cache_files(cache) == []


def test_unsupported_architecture(tmp_path, cache):
    path = write_gguf(tmp_path / "m.gguf", hf_weights(), QT.Q8_0, arch="gemma2")
    with pytest.raises(InvalidModel, match="unsupported GGUF architecture 'gemma2'"):
        import_gguf(path)
    assert _cache_files(cache) == []


def test_unsupported_tensor_type(tmp_path, cache):
    weights = hf_weights()
    path = write_gguf(tmp_path / "m.gguf", weights, QT.Q8_0, types={"model.layers.1.mlp.up_proj.weight": QT.I32})
    with pytest.raises(InvalidModel, match=r"unsupported GGUF tensor type I32 in 'blk\.1\.ffn_up\.weight'"):
        import_gguf(path)
    assert _cache_files(cache) == []


def test_not_a_gguf_file(tmp_path, cache):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip file" * 10)
    with pytest.raises(InvalidModel, match="not a readable GGUF file"):
        import_gguf(path)
    assert _cache_files(cache) == []


def test_corrupt_headers_fail_cleanly(tmp_path, cache):
    """Random byte changes in the header: the import either works or raises InvalidModel, nothing else."""
    good = write_gguf(tmp_path / "m.gguf", hf_weights(), QT.Q8_0).read_bytes()
    header_end = good.index(b"blk.0.attn_q.weight") + 400  # metadata and the first tensor infos
    rng = np.random.default_rng(7)
    outcomes = set()
    for i in range(60):
        data = bytearray(good)
        for pos in rng.integers(0, header_end, 3):
            data[pos] = int(rng.integers(0, 256))
        path = tmp_path / f"c{i}.gguf"
        path.write_bytes(bytes(data))
        try:
            import_gguf(path)
            outcomes.add("ok")
        except InvalidModel:
            outcomes.add("InvalidModel")
        path.unlink()
    assert "InvalidModel" in outcomes
