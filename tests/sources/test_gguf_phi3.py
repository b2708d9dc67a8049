"""GGUF import of phi3 (Phi-3, Phi-4-mini): fused qkv and gate+up rows, partial rotary embedding, LongRoPE factors.

Files come from scripts/bench_arch.py's writer (llama.cpp's phi3 layout); the reference is mlx-lm's phi3 model
built from the Hugging Face config and the file's dequantized weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_arch  # noqa: E402

from mlxinfer.errors import InvalidModel  # noqa: E402
from mlxinfer.sources.gguf_import import import_gguf  # noqa: E402

PHI = bench_arch.tiny(bench_arch.ARCHS["phi4-mini"])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MLXINFER_CACHE", str(root))
    return root


def _logits(model, tokens):
    return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))


def _load(model_dir: Path):
    """As mlxinfer runs it on the CPU (float32 activations and scales): the 4-bit blocks are then exact."""
    import mlxinfer

    return mlxinfer.load(str(model_dir), kernels="builtin").model


def test_partial_rotary_and_fused_projections(tmp_path):
    path = bench_arch.write_gguf(tmp_path / "p.gguf", PHI, "Q4_0")
    model_dir = import_gguf(path)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["partial_rotary_factor"]) == ("phi3", 0.75)
    imported = _load(model_dir)
    tokens = bench_arch.prompt_ids(PHI, 12)
    np.testing.assert_allclose(_logits(imported, tokens), _logits(bench_arch.reference_model(PHI), tokens),
                               rtol=1e-4, atol=1e-4)
    # the rotary share matters: the same weights with RoPE on the whole head give other logits
    whole = bench_arch.reference_model(bench_arch.with_shape(PHI, "rotary_dims=16"))
    assert np.abs(_logits(whole, tokens) - _logits(imported, tokens)).max() > 1e-2


def test_longrope_factors_become_rope_scaling(tmp_path):
    """Phi-4-mini GGUFs carry LongRoPE as two F32 tensors; mlx-lm's SuScaledRoPE takes them from config.json."""
    import mlx_lm.utils
    rng = np.random.default_rng(3)
    half = PHI.rotary_dims // 2
    long, short = (rng.uniform(1.0, 8.0, half).astype(np.float32), rng.uniform(1.0, 1.5, half).astype(np.float32))
    path = bench_arch.write_gguf(tmp_path / "l.gguf", PHI, "Q4_1", extra_tensors={
        "rope_factors_long.weight": long, "rope_factors_short.weight": short},
        extra_meta={"phi3.rope.scaling.original_context_length": 64})
    model_dir = import_gguf(path)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_scaling"]["type"] == "longrope"
    assert config["rope_scaling"]["long_factor"] == pytest.approx(long.tolist())
    assert config["original_max_position_embeddings"] == 64 and config["max_position_embeddings"] == PHI.context

    hf = {**bench_arch.hf_config(PHI), "original_max_position_embeddings": 64,
          "rope_scaling": {"type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}}
    model_class, args_class = mlx_lm.utils._get_classes(hf)
    reference = model_class(args_class.from_dict(hf))
    reference.load_weights(list({k: mx.array(v) for k, v in bench_arch.hf_weights(PHI, "Q4_1").items()}.items()))
    imported = _load(model_dir)
    tokens = bench_arch.prompt_ids(PHI, 12)
    np.testing.assert_allclose(_logits(imported, tokens), _logits(reference, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("extra,meta,message", [
    ({}, {"phi3.rope.dimension_count": 11}, "'phi3.rope.dimension_count' is 11; RoPE needs an even size"),
    ({}, {"phi3.rope.dimension_count": 64}, "'phi3.rope.dimension_count' is 64, outside 2..16"),
    ({"rope_factors_long.weight": np.ones(6, np.float32)}, {}, "needs both 'rope_factors_long' and 'rope_factors_short'"),
    ({"rope_factors_long.weight": np.ones(5, np.float32), "rope_factors_short.weight": np.ones(5, np.float32)}, {},
     "'rope_factors_long.weight' is not 6 positive factors"),
    ({"rope_factors_long.weight": -np.ones(6, np.float32), "rope_factors_short.weight": np.ones(6, np.float32)}, {},
     "'rope_factors_long.weight' is not 6 positive factors"),
])
def test_bad_phi3_files_are_one_clear_error(tmp_path, cache, extra, meta, message):
    # extra_meta overwrites the writer's own value of a key
    path = bench_arch.write_gguf(tmp_path / "bad.gguf", PHI, "Q4_0", extra_tensors=extra, extra_meta=meta)
    with pytest.raises(InvalidModel, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_gguf(path)
    assert not (cache / "gguf").exists() or not list((cache / "gguf").glob("*-v*"))  # nothing half-written


def test_head_size_must_be_hidden_over_heads(tmp_path):
    """mlx-lm's phi3 derives the head size from hidden / heads; a file saying otherwise is refused up front."""
    odd = bench_arch.with_shape(PHI, "head_dim=32,rotary_dims=24")
    with pytest.raises(InvalidModel, match="'phi3.attention.key_length' 32 is not 'phi3.embedding_length' 64 / "):
        import_gguf(bench_arch.write_gguf(tmp_path / "h.gguf", odd, "Q4_0"))
