"""Conversions of tiny Hugging Face models: uniform 4/8-bit, mixed recipes, TOML rules, dequantize, quality."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxinfer.convert import ConvertOptions, convert
from mlxinfer.convert.quality import evaluate
from mlxinfer.errors import InvalidParameter

EVAL = 512  # positions of the built-in sample compared per conversion (the full sample is ~8k tokens here)


def _load(path):
    from mlx_lm import load

    return load(str(path))


def _quantized(model) -> dict[str, nn.Module]:
    return {p: m for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def _logits_shape(model, vocab: int) -> None:
    out = model(mx.array([[5, 6, 7, 8, 9]]))
    assert out.shape == (1, 5, vocab)
    assert mx.isfinite(out).all().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_uniform_quantization(sources, tmp_path, arch, bits):
    src = sources[arch]
    r = convert(str(src), tmp_path / "out", ConvertOptions(bits=bits, eval_tokens=EVAL))
    config = json.loads((r.out_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    model, tok = _load(r.out_dir)
    q = _quantized(model)
    # every linear layer and the embedding are quantized at the requested width
    assert "model.embed_tokens" in q and all(m.bits == bits for m in q.values())
    assert not [p for p, m in model.named_modules() if type(m) is nn.Linear]
    _logits_shape(model, config["vocab_size"])
    assert tok.encode("hello world")
    # tokenizer/generation files came along; remote code never does
    assert (r.out_dir / "tokenizer.json").exists() and (r.out_dir / "generation_config.json").exists()
    meta = config["mlxinfer"]["converted"]
    assert meta["source"] == str(src) and meta["quality"]["tokens"] == EVAL
    # the model card states source, recipe, version and the quality figures
    card = (r.out_dir / "README.md").read_text()
    assert str(src) in card and f"{bits}-bit affine" in card and "KL divergence" in card and "0.1.0" in card
    # KL thresholds: see test_kl_orders_bit_widths for why these are the right scale
    assert r.quality.kl_mean < (0.05 if bits == 8 else 2.0)
    if bits == 8:
        assert r.quality.top1_agreement > 0.85
    assert 0.9 * bits < r.bits_per_weight < bits + 2  # + scales/biases and the float norms


def test_kl_orders_bit_widths(llama_src, tmp_path, tok_dir):
    """Why the thresholds above: an unrelated model of the same shape (another seed) scores ~10+ nats; 8-bit
    must be ~1000x closer than that, 4-bit at least 5x, and the metrics must order the bit widths."""
    from tinymodels import make_hf_model

    other = make_hf_model(tmp_path / "other", tok_dir, "llama", layers=8, seed=99)
    unrelated = evaluate(llama_src, other, max_tokens=EVAL)
    kl = {}
    for bits in (3, 4, 8):
        kl[bits] = convert(str(llama_src), tmp_path / f"q{bits}", ConvertOptions(bits=bits, eval_tokens=EVAL)).quality
    mixed = convert(str(llama_src), tmp_path / "mixed", ConvertOptions(recipe="mixed_4_6", eval_tokens=EVAL)).quality
    assert unrelated.kl_mean > 5.0 and unrelated.top1_agreement < 0.2
    assert kl[8].kl_mean < unrelated.kl_mean / 1000
    assert kl[4].kl_mean < unrelated.kl_mean / 5
    assert kl[8].kl_mean < kl[4].kl_mean < kl[3].kl_mean
    assert kl[8].top1_agreement > kl[4].top1_agreement > kl[3].top1_agreement
    # the mixed recipe spends bits where they matter: closer than uniform 4-bit
    assert mixed.kl_mean < kl[4].kl_mean
    # the same model against itself is exactly zero
    same = evaluate(llama_src, llama_src, max_tokens=64)
    assert same.kl_mean < 1e-6 and same.top1_agreement == 1.0 and same.ppl_converted == same.ppl_source


def test_mixed_recipe_bits_per_layer(llama_src, tmp_path):
    r = convert(str(llama_src), tmp_path / "out", ConvertOptions(recipe="mixed_3_6", eval=False))
    q = json.loads((r.out_dir / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (3, 64)
    high = {k for k, v in q.items() if isinstance(v, dict)}
    # mlx-lm's mixed_3_6 (llama.cpp's "use more bits" layers for n = 8: 0, 3, 6, 7) and lm_head; embeddings low
    expected = {"lm_head"} | {
        f"model.layers.{i}.{p}" for i in (0, 3, 6, 7) for p in ("self_attn.v_proj", "mlp.down_proj")}
    assert high == expected and all(q[k]["bits"] == 6 for k in high)
    model, _ = _load(r.out_dir)
    bits = {p: m.bits for p, m in _quantized(model).items()}
    assert bits["model.layers.3.mlp.down_proj"] == 6 and bits["model.layers.4.mlp.down_proj"] == 3
    assert bits["model.layers.1.self_attn.q_proj"] == 3 and bits["lm_head"] == 6
    _logits_shape(model, 512)


def test_toml_rules(llama_src, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text("""
name = "test-rules"
[default]
bits = 5
[[rule]]
match = "lm_head"
bits = 8
group_size = 32
[[rule]]
match = "self_attn.k_proj"
quantize = false
[[rule]]
match = "mlp.*_proj"
layers = [-1, 0]
bits = 2
[[rule]]
match = "model.layers.*.mlp.up_proj"
layers = "2-3"
bits = 6
group_size = 64
""")
    r = convert(str(llama_src), tmp_path / "out", ConvertOptions(recipe=str(rules), group_size=128, eval=False))
    model, _ = _load(r.out_dir)
    mods = dict(model.named_modules())
    assert type(mods["model.layers.1.self_attn.k_proj"]) is nn.Linear  # kept float
    assert mods["model.layers.1.self_attn.k_proj"].weight.dtype == mx.float16
    assert (mods["lm_head"].bits, mods["lm_head"].group_size) == (8, 32)
    assert mods["model.layers.7.mlp.down_proj"].bits == 2 and mods["model.layers.0.mlp.down_proj"].bits == 2
    assert (mods["model.layers.2.mlp.up_proj"].bits, mods["model.layers.2.mlp.up_proj"].group_size) == (6, 64)
    # --group-size 128 is the default now: 64-wide inputs cannot be split into groups of 128 and stay float,
    # unless a rule gives them a smaller group (up_proj of layers 2-3 above)
    assert type(mods["model.layers.1.self_attn.q_proj"]) is nn.Linear
    assert type(mods["model.layers.4.mlp.up_proj"]) is nn.Linear
    assert (mods["model.layers.1.mlp.down_proj"].bits, mods["model.layers.1.mlp.down_proj"].group_size) == (5, 128)
    assert "test-rules" in r.recipe


def test_toml_rule_that_selects_nothing_writes_nothing(llama_src, tmp_path):
    from mlxinfer.errors import ConfigError

    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nmatch = "mlp.*_proj"\nlayers = [0, 99]\nbits = 8\n')
    with pytest.raises(ConfigError, match="names layer 99, but this model has layers 0-7"):
        convert(str(llama_src), tmp_path / "out", ConvertOptions(recipe=str(rules), eval=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rules.toml"]


def test_dequantize_round_trip(llama_src, tmp_path):
    q8 = convert(str(llama_src), tmp_path / "q8", ConvertOptions(bits=8, eval=False)).out_dir
    r = convert(str(q8), tmp_path / "deq", ConvertOptions(dequantize=True, eval_tokens=EVAL))
    config = json.loads((r.out_dir / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    model, _ = _load(r.out_dir)
    assert not _quantized(model)
    src = {}
    for f in llama_src.glob("*.safetensors"):
        src.update(mx.load(str(f)))
    out = {}
    for f in r.out_dir.glob("*.safetensors"):
        out.update(mx.load(str(f)))
    w0, w1 = src["model.layers.2.mlp.up_proj.weight"], out["model.layers.2.mlp.up_proj.weight"]
    assert w1.dtype == mx.float16 and w1.shape == w0.shape
    # 8-bit affine error is at most half a step: (max - min) / 255 / 2 per group of 64
    step = (w0.reshape(-1, 64).max(-1) - w0.reshape(-1, 64).min(-1)) / 255
    err = mx.abs(w1 - w0).reshape(-1, 64).max(-1)
    assert mx.all(err <= step * 0.5 + 2e-3).item()
    assert r.quality.kl_mean < 0.05  # the dequantized 8-bit model is as close to its 8-bit source as can be: 0
    assert r.quality.kl_mean < 1e-4


def test_already_quantized_source_is_requantized(llama_src, tmp_path):
    q8 = convert(str(llama_src), tmp_path / "q8", ConvertOptions(bits=8, eval=False)).out_dir
    # 8 -> 4 bits rounds rounded weights again: refused with its cost unless asked for (issue #16)
    with pytest.raises(InvalidParameter, match=r"already quantized \(8-bit affine, group 64, 8.50 bits per "
                                               r"matrix weight\); re-quantizing it to 4-bit.*--requantize"):
        convert(str(q8), tmp_path / "q4", ConvertOptions(bits=4, eval=False))
    assert not (tmp_path / "q4").exists()
    r = convert(str(q8), tmp_path / "q4", ConvertOptions(bits=4, eval=False, requantize=True))
    assert json.loads((r.out_dir / "config.json").read_text())["quantization"]["bits"] == 4
    assert r.notes and "dequantized first" in r.notes[0]


def test_dtype_and_sharding(qwen3_src, tmp_path):
    r = convert(str(qwen3_src), tmp_path / "out", ConvertOptions(dtype="bfloat16", shard_bytes=100_000, eval=False))
    assert len(r.shards) >= 4 and r.shards[0] == f"model-00001-of-{len(r.shards):05d}.safetensors"
    index = json.loads((r.out_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(r.shards)
    tensors = {}
    for s in r.shards:
        tensors.update(mx.load(str(r.out_dir / s)))
    assert set(tensors) == set(index["weight_map"])
    assert {v.dtype for v in tensors.values()} == {mx.bfloat16}
    assert json.loads((r.out_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    import mlxinfer

    loaded = mlxinfer.load(str(r.out_dir), kernels="builtin")
    assert loaded.quantization.startswith("none")


def test_the_sources_license_is_kept_in_the_card(llama_src, tmp_path):
    """The converted card dropped the source's license: `show` then said "license unknown" for an apache-2.0
    model. Its terms still apply to the conversion."""
    import shutil

    from mlxinfer.convert import ConvertOptions, convert
    from mlxinfer.convert.card import card_license

    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    (src / "README.md").write_text("---\nlicense: mit\ntags:\n- text\n---\n# tiny\n")
    out = convert(str(src), tmp_path / "out", ConvertOptions(bits=8, eval=False)).out_dir
    assert card_license(out) == "mit"


def test_eval_tokens_beyond_the_sample_is_said(sources, tmp_path, monkeypatch):
    """--eval-tokens larger than the built-in sample compares all of it and says so (the report's 'tokens
    compared' alone did not tell the user their number was not used)."""
    from mlxinfer.convert import quality

    monkeypatch.setattr(quality, "sample_text", lambda: "The quick brown fox jumps over the lazy dog. " * 4)
    r = convert(str(sources["llama"]), tmp_path / "out", ConvertOptions(bits=8, eval_tokens=5000))
    assert 1 < r.quality.tokens < 5000
    assert f"--eval-tokens 5000 is more than the built-in sample holds with this tokenizer: compared all " \
           f"{r.quality.tokens} of its positions" in r.notes
    meta = json.loads((r.out_dir / "config.json").read_text())["mlxinfer"]["converted"]
    assert any("--eval-tokens 5000" in n for n in meta["notes"])
