"""GGUF sources go through the foundation's import; with no quantization options the result equals it exactly."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxinfer.convert import ConvertOptions, convert


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.slow
def test_gguf_q8_0_and_q4_1_equal_the_direct_import(bundled_gguf, smollm2_dir, tmp_path, monkeypatch):
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(bundled_gguf)).tensors}
    assert {"Q8_0", "Q4_1"} <= kinds  # the bundled file holds both block types (token_embd is Q8_0)
    # an empty import cache: convert must run the import itself (into its temp dir), not copy the cached one
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))
    r = convert(str(bundled_gguf), tmp_path / "out", ConvertOptions(eval=False, shard_bytes=40 << 20))
    assert len(r.shards) >= 2
    assert not list((tmp_path / "cache").glob("gguf/*-v*"))  # the import went to the temp dir, not the cache
    assert not list((tmp_path / "out").glob("_gguf*"))
    ours, direct = _tensors(r.out_dir), _tensors(smollm2_dir)
    assert set(ours) == set(direct)
    for k in direct:
        assert ours[k].dtype == direct[k].dtype and mx.array_equal(ours[k], direct[k]).item(), k
    cfg, ref = (json.loads((d / "config.json").read_text()) for d in (r.out_dir, smollm2_dir))
    assert cfg["quantization"] == ref["quantization"]
    assert cfg["mlxinfer"]["converted"]["format"] == "gguf"
    assert (r.out_dir / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_gguf_requantize_to_8_bit_with_quality(bundled_gguf, tmp_path):
    r = convert(str(bundled_gguf), tmp_path / "q8", ConvertOptions(bits=8, eval_tokens=8))
    q = json.loads((r.out_dir / "config.json").read_text())["quantization"]
    assert q == {"group_size": 64, "bits": 8, "mode": "affine"}
    # 8-bit of a 4-bit source: nearly the same distributions as the imported GGUF
    assert r.quality.kl_mean < 0.01 and r.quality.top1_agreement > 0.9
    # and it loads with mlx-lm (the engine's generation on imported models is covered by the golden tests)
    from mlx_lm import load

    model, tokenizer = load(str(r.out_dir))
    assert model(mx.array([tokenizer.encode("Paris")])).shape[-1] == 49152


@pytest.mark.slow
def test_requantizing_the_q4_1_gguf_needs_a_flag_and_says_what_it_costs(bundled_gguf, tmp_path):
    """Q4_1 (group 32) -> --bits 4 (group 64) rounds rounded weights again: refused with the sizes until
    --requantize; without --bits the source keeps its format (test above). Issue #16."""
    import subprocess
    import sys

    out = tmp_path / "q4"
    cmd = [sys.executable, "-m", "mlxinfer", "convert", str(bundled_gguf), "-o", str(out), "--bits", "4", "--no-eval"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "already quantized (GGUF Q4_1" in lines[0] and "about 4.50 bits per matrix weight" in lines[0]
    assert "--requantize" in lines[0] and not out.exists() and list(tmp_path.iterdir()) == []
    done = subprocess.run([*cmd, "--requantize"], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "note: " in done.stdout and "dequantized first" in done.stdout
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)
