"""scripts/bench_arch.py: the random GGUFs ``cpu_bench.py --arch`` feeds both engines, at test size.

Per architecture (llama with Llama-3 RoPE factors, qwen3, gemma3, phi3, olmo2, mistral3) and 4-bit type: mlxinfer's
GGUF import of the written file gives the logits of the mlx-lm model built independently from the table's config
and the file's dequantized weights — over a prompt and decode steps, with built-in and with native kernels. The
llama.cpp comparison runs only where --llama-python's venv has llama_cpp (MLXINFER_LLAMA_PYTHON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_arch  # noqa: E402

LLAMA_PYTHON = os.environ.get("MLXINFER_LLAMA_PYTHON", "/work/llama-venv/bin/python")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path / "cache"))


def _logits(model, prompt, follow):
    """Prefill logits of every prompt position, then one row per single-token decode step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = [np.array(model(mx.array(prompt)[None], cache=cache)[0].astype(mx.float32))]
    rows += [np.array(model(mx.array([[t]]), cache=cache)[0].astype(mx.float32)) for t in follow]
    return np.concatenate(rows)


@pytest.mark.parametrize("qtype", bench_arch.QTYPES)
@pytest.mark.parametrize("key", list(bench_arch.ARCHS))
def test_import_matches_the_reference_model(tmp_path, key, qtype):
    import mlxinfer
    from mlxinfer import native

    arch = bench_arch.tiny(bench_arch.ARCHS[key])
    path = bench_arch.write_gguf(bench_arch.gguf_path(tmp_path, key, arch, qtype, 0), arch, qtype)
    prompt, follow = bench_arch.prompt_ids(arch, 10), bench_arch.prompt_ids(arch, 4, seed=2)
    want = _logits(bench_arch.reference_model(arch, qtype), prompt, follow)
    assert want.std() > 0.5  # the random weights give spread-out logits, not a constant

    loaded = mlxinfer.load(str(path), kernels="builtin")
    config = json.loads((Path(loaded.path) / "config.json").read_text())
    def same(got, want):  # metadata floats are float32
        if isinstance(want, dict):
            return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
        return got == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want)

    for field, value in bench_arch.hf_config(arch).items():
        assert same(config[field], value), (field, config[field], value)
    # the 4-bit blocks repack exactly: only float summation order differs
    np.testing.assert_allclose(_logits(loaded.model, prompt, follow), want, rtol=1e-4, atol=1e-4)

    if native.extension() is None:
        pytest.skip(native.status())
    native_model = mlxinfer.load(str(path), kernels="custom").model
    # float16 KV cache (as llama.cpp's) on the native path: within 1% of the logit spread. Prefill on its precise
    # path (the opt-in int8 prefill off even under MLXINFER_PREFILL=int8: its ~1-3% of a logit is bounded in
    # tests/kernels/test_spec_layers.py), so that this checks the import.
    toggle = getattr(native.extension(), "set_int8_prefill", None)
    before = toggle(False) if toggle is not None else None
    try:
        got = _logits(native_model, prompt, follow)
    finally:
        if toggle is not None:
            toggle(before)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.01 * want.std() * 3)


# parameter counts of the real checkpoints (safetensors totals, tied embeddings counted once)
PUBLISHED = {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920,
             "gemma3-270m": 268_098_176, "gemma3-1b": 999_885_952, "phi4-mini": 3_836_021_760,
             "olmo2-1b": 1_484_916_736,  # olmo2: its config's shapes summed; the model card says 1.48B
             "ministral3-3b": 3_429_006_336}  # its text_config's shapes summed (the vision tower left out)


@pytest.mark.parametrize("key", list(bench_arch.ARCHS))
def test_real_shapes_have_the_published_parameter_count(key):
    """Every tensor the GGUF holds, counted: exactly the real model's size (a wrong hidden size, head count,
    intermediate size or vocabulary would not add up)."""
    specs = bench_arch.tensors(bench_arch.ARCHS[key])
    assert sum(int(np.prod(shape)) for name, shape, _ in specs if name != "rope_freqs.weight") == PUBLISHED[key]


def test_phi3_tensors_are_fused():
    names = {n: s for n, s, _ in bench_arch.tensors(bench_arch.ARCHS["phi4-mini"])}
    assert names["blk.0.attn_qkv.weight"] == ((24 + 2 * 8) * 128, 3072)
    assert names["blk.31.ffn_up.weight"] == (2 * 8192, 3072) and "blk.0.ffn_gate.weight" not in names


def test_shape_overrides():
    base = bench_arch.ARCHS["phi4-mini"]
    small = bench_arch.with_shape(base, "layers=8,head_dim=64,eps=1e-6,tied=false")
    assert (small.layers, small.head_dim, small.rotary_dims, small.eps, small.tied) == (8, 64, 48, 1e-6, False)
    with pytest.raises(ValueError, match="unknown field 'width'"):
        bench_arch.with_shape(base, "width=3")


def test_untied_head_is_written_and_loaded(tmp_path):
    import mlxinfer

    arch = bench_arch.with_shape(bench_arch.tiny(bench_arch.ARCHS["smollm2-135m"]), "tied=false")
    path = bench_arch.write_gguf(tmp_path / "u.gguf", arch, "Q4_1")
    prompt = bench_arch.prompt_ids(arch, 6)
    want = _logits(bench_arch.reference_model(arch, "Q4_1"), prompt, [])
    got = _logits(mlxinfer.load(str(path), kernels="builtin").model, prompt, [])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _llama_cpp() -> bool:
    return Path(LLAMA_PYTHON).exists() and subprocess.run(
        [LLAMA_PYTHON, "-c", "import llama_cpp"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _llama_cpp(), reason=f"no llama-cpp-python at {LLAMA_PYTHON}")
@pytest.mark.parametrize("key", ["smollm2-135m", "llama-3.2-1b", "qwen3-0.6b", "gemma3-270m", "phi4-mini",
                                 "olmo2-1b", "ministral3-3b"])
def test_llama_cpp_reads_the_same_model(tmp_path, key, float_prefill):
    """The file is the ground truth for both engines: llama.cpp's logits agree with mlxinfer's (llama.cpp
    quantizes activations to 8 bits for its 4-bit dot products: a few % of the logit spread). mlxinfer's native
    prefill runs at float32 here: with its int8 default too, two different roundings of the same activations
    flipped 3 of 12 near-tied top-1 tokens of a random tiny model; the int8 default's own accuracy is held in
    tests/kernels/test_spec_layers.py and test_real_shapes.py."""
    arch = bench_arch.with_shape(bench_arch.tiny(bench_arch.ARCHS[key]), "hidden=128,head_dim=32,ffn=256,vocab=1024")
    if arch.yarn:
        # YaRN factor 1 (its frequencies unchanged): llama.cpp 0.3.36's mistral3 graph multiplies q and k by YaRN's
        # 1 + 0.1 ln(factor), which Ministral 3's config (mscale = mscale_all_dim) and llama.cpp's later mistral3
        # graph (attn_factor cancelling it) do not; the llama-4 query scale (original context 4) is still checked.
        arch = dataclasses.replace(arch, yarn=(1.0, *arch.yarn[1:]))
    path = bench_arch.write_gguf(tmp_path / f"{key}.gguf", arch, "Q4_0")
    try:
        out = bench_arch.check_logits(path, arch, llama_python=LLAMA_PYTHON, threads=2, n_prompt=12, n_follow=4)
    except RuntimeError as e:
        if "SIGILL" in str(e):  # a llama.cpp built for another CPU: not this test's subject
            pytest.skip(str(e))
        raise
    assert out["reference"] == "llama.cpp"
    for engine in ("builtin", "native"):
        row = out[engine]
        assert row["prefill_max_abs_diff"] < 0.1 * out["logit_std"] * 3, (engine, row)
        assert row["decode_max_abs_diff"] < 0.1 * out["logit_std"] * 3, (engine, row)
        assert row["prefill_top1_agree"] >= 0.9 and row["decode_top1_agree"] >= 0.75, (engine, row)


def test_cpu_bench_arch_runs_end_to_end(tmp_path):
    """The script's --arch path at test size: a table per arch and the JSON record (1 round, few tokens)."""
    out = tmp_path / "r.json"
    env = {**os.environ, "MLXINFER_CACHE": str(tmp_path / "cache")}
    shape = "hidden=64,layers=2,heads=4,kv_heads=2,head_dim=16,ffn=128,vocab=512"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "cpu_bench.py"), "--arch", "qwen3-0.6b,phi4-mini",
                           "--shape", shape, "--rounds", "1", "--prompt-tokens", "8", "--gen-tokens", "4",
                           "--threads", "2", "--engines", "builtin", "--gguf-dir", str(tmp_path), "-o", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "## qwen3-0.6b: random Q4_0 weights at Qwen/Qwen3-0.6B shapes, changed: " in proc.stdout
    record = json.loads(out.read_text())
    assert set(record) == {"qwen3-0.6b", "phi4-mini"}
    assert record["phi4-mini"]["builtin"]["decode_tok_s"] > 0 and record["phi4-mini"]["shapes"]["layers"] == 2
    assert len(list(tmp_path.glob("random-*.gguf"))) == 2


def test_cpu_bench_check_without_llama_cpp(tmp_path):
    """--check without llama.cpp: native kernels against built-in ones on the same file, one table per arch."""
    out = tmp_path / "c.json"
    env = {**os.environ, "MLXINFER_CACHE": str(tmp_path / "cache"),
           "MLXINFER_PREFILL": "float"}  # native against built-in at float parity (int8 prefill: test_spec_layers)
    shape = "hidden=64,layers=6,heads=4,kv_heads=1,head_dim=16,ffn=128,vocab=512,sliding_window=4"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "cpu_bench.py"), "--arch", "gemma3-1b", "--check",
                           "--shape", shape, "--prompt-tokens", "12", "--threads", "2", "--gguf-dir", str(tmp_path),
                           "--llama-python", str(tmp_path / "none"), "-o", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "llama.cpp skipped" in proc.stdout and "| native |" in proc.stdout
    row = json.loads(out.read_text())["gemma3-1b"]
    assert row["reference"] == "mlxinfer builtin (no llama.cpp)" and row["prompt_tokens"] == 12
    assert row["native"]["prefill_top1_agree"] >= 0.9 and row["native"]["decode_max_abs_diff"] < 0.05


@pytest.mark.parametrize("change", ["missing post_ffw_norm", "per-head q_norm"])
def test_olmo2_file_that_does_not_match_its_metadata_is_refused(tmp_path, monkeypatch, change):
    """OLMo 2's own tensors (post norms, whole-width q/k norms) are checked like every other architecture's: one
    line naming the tensor, and nothing imported into the cache."""
    import mlxinfer
    from mlxinfer.errors import InvalidModel

    arch = bench_arch.tiny(bench_arch.ARCHS["olmo2-1b"])
    orig = bench_arch.tensors
    if change == "missing post_ffw_norm":
        name = "blk.1.post_ffw_norm.weight"
        monkeypatch.setattr(bench_arch, "tensors", lambda a: [t for t in orig(a) if t[0] != name])
    else:
        monkeypatch.setattr(bench_arch, "tensors", lambda a: [
            (n, (a.head_dim,) if n == "blk.0.attn_q_norm.weight" else s, h) for n, s, h in orig(a)])
        name = "blk.0.attn_q_norm.weight"
    path = bench_arch.write_gguf(tmp_path / "bad.gguf", arch, "Q4_0")
    with pytest.raises(InvalidModel, match=name.replace(".", r"\.")):
        mlxinfer.load(str(path))
    assert not list((tmp_path / "cache").rglob("model.safetensors"))



@pytest.mark.parametrize("meta,match", [
    ({"mistral3.attention.temperature_length": 7}, "'mistral3.attention.temperature_length' differs from"),
    ({"mistral3.attention.temperature_scale": -1.0}, "'mistral3.attention.temperature_scale' is -1.0, not a non-neg"),
    ({"mistral3.rope.scaling.type": "linear"}, "'mistral3.rope.scaling.type' is 'linear'; mistral3 files use yarn"),
])
def test_mistral3_metadata_that_does_not_fit_is_refused(tmp_path, meta, match):
    """Ministral 3's YaRN and query-scale metadata is checked before anything is written: one line naming the key,
    nothing imported into the cache (each file has no temperature keys of its own; the one with a scaling type
    of its own has no YaRN keys)."""
    import mlxinfer
    from mlxinfer.errors import InvalidModel

    arch = dataclasses.replace(bench_arch.tiny(bench_arch.ARCHS["ministral3-3b"]), attn_temp=0.0)
    if "mistral3.rope.scaling.type" in meta:
        arch = dataclasses.replace(arch, yarn=())
    path = bench_arch.write_gguf(tmp_path / "bad.gguf", arch, "Q4_0", extra_meta=meta)
    with pytest.raises(InvalidModel, match=match):
        mlxinfer.load(str(path))
    assert not list((tmp_path / "cache").rglob("model.safetensors"))


def test_a_sigill_names_the_instruction_sets_the_cpu_lacks(tmp_path):
    """A llama.cpp built for another CPU (here: AVX-VNNI on a Zen 4, which has AVX-512 VNNI but not the VEX form)
    gets a line naming what to turn off, not a guess."""
    info = ("CPU : SSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 "
            "| AMX_INT8 = 0 | LLAMAFILE = 1 | OPENMP = 1 |")
    zen4 = {"avx", "avx2", "f16c", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi"}
    assert bench_arch.missing_isa(info, zen4) == ["AVX_VNNI"]
    assert bench_arch.missing_isa(info, zen4 | {"avx_vnni"}) == []
    assert bench_arch.missing_isa(info, {"avx", "avx2", "f16c", "fma"}) == ["AVX_VNNI", "AVX512", "AVX512_VNNI"]

    fake = tmp_path / "python"  # a "llama venv" whose llama_cpp reports that build
    fake.write_text(f"#!/bin/sh\necho '{info}'\n")
    fake.chmod(0o755)
    proc = subprocess.CompletedProcess([], -4, "", "")
    line = bench_arch.llama_failure(proc, Path("m.gguf"), str(fake))
    assert "SIGILL on m.gguf" in line and "\n" not in line
    if "avx_vnni" not in bench_arch._cpu_flags():
        assert "-DGGML_AVX_VNNI=OFF" in line and "--no-cache-dir" in line
    assert "rebuild" in bench_arch.llama_failure(proc, Path("m.gguf"), None)
