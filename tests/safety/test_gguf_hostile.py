"""GGUF files whose metadata lies or whose tensors contradict it: each is refused by the CLI with one line naming
the key or tensor, exit 2, fast, and nothing in $MLXINFER_CACHE afterwards (validated before any byte is written).
The files are tiny llamas crafted here with ``gguf.GGUFWriter``; an untouched one imports and runs. The refusals
run the CLI in this process (tests/in_process.py); convert's refusal and the untouched file run a real one."""

from __future__ import annotations

import shutil
import re
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, run

H, LAYERS, HEADS, KV, FF = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DROP = object()


def _tokens() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return SPECIALS + sorted(ByteLevel.alphabet())


def base_meta() -> dict:
    tokens = _tokens()
    return {
        "llama.block_count": LAYERS, "llama.context_length": 128, "llama.embedding_length": H,
        "llama.feed_forward_length": FF, "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.merges": ["Ġ t"], "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }


def base_shapes(layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    vocab, hd = len(_tokens()), H // HEADS
    shapes = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_q.weight": (HEADS * hd, H), f"blk.{i}.attn_k.weight": (KV * hd, H),
            f"blk.{i}.attn_v.weight": (KV * hd, H), f"blk.{i}.attn_output.weight": (H, HEADS * hd),
            f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H), f"blk.{i}.ffn_down.weight": (H, FF),
            f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
        })
    return shapes


def _put(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        (w.add_int64 if value < 0 else w.add_uint64 if value >= 1 << 32 else w.add_uint32)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def make_gguf(path: Path, meta: dict | None = None, shapes: dict | None = None) -> Path:
    """A tiny llama GGUF; ``meta``/``shapes`` override (DROP removes) keys and tensor shapes."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**base_meta(), **(meta or {})}.items():
        if value is not DROP:
            _put(w, key, value)
    rng = np.random.default_rng(0)
    for name, shape in {**base_shapes(), **(shapes or {})}.items():
        if shape is not DROP:
            w.add_tensor(name, rng.normal(1 if "norm" in name else 0, 0.1, shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _patch_u64(path: Path, offset: int, value: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", value)
    path.write_bytes(bytes(data))


def _tensor_info_offset(path: Path, name: str) -> int:
    """Byte position of the data-offset field of tensor ``name``'s info in the header."""
    data = path.read_bytes()
    pos = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 + 8 * n_dims + 4


def _lie_offset(path: Path) -> None:
    _patch_u64(path, _tensor_info_offset(path, "blk.1.ffn_down.weight"), 1 << 40)


def _spm(extra: set[str]) -> tuple[dict, dict]:
    """Metadata and tensor shapes of a SentencePiece ("llama") vocabulary holding ``extra`` pieces."""
    tokens = ["<unk>", "<s>", "</s>", *sorted(extra)]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": DROP, "tokenizer.ggml.merges": DROP,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * len(tokens),
            "tokenizer.ggml.token_type": [2, 3, 3] + [1] * len(extra), "tokenizer.ggml.bos_token_id": 1}
    return meta, {"token_embd.weight": (len(tokens), H), "output.weight": (len(tokens), H)}


CASES = {
    # name: (metadata overrides, tensor shape overrides, post-write patch, needles in the one line)
    "shape contradicts embedding_length": ({}, {"blk.0.ffn_up.weight": (FF // 2, H)}, None,
                                           ["blk.0.ffn_up.weight", "64 x 64", "128 x 64"]),
    "q rows contradict head_count": ({"llama.attention.head_count": 2, "llama.attention.head_count_kv": 2}, {},
                                     None, ["blk.0.attn_k.weight", "metadata"]),
    "vocabulary contradicts token_embd": ({}, {"token_embd.weight": (100, H)}, None, ["token_embd.weight", "100 x 64"]),
    "missing tensor": ({}, {"blk.1.ffn_down.weight": DROP}, None, ["lacks tensor 'blk.1.ffn_down.weight'"]),
    "extra layer beyond block_count": ({}, {"blk.2.attn_norm.weight": (H,)}, None,
                                       ["blk.2.attn_norm.weight", "llama.block_count"]),
    "block_count 10**9": ({"llama.block_count": 10**9}, {}, None, ["llama.block_count", "1000000000"]),
    "block_count beyond the tensors": ({"llama.block_count": 3}, {}, None, ["llama.block_count", "2 layers"]),
    "embedding_length 0": ({"llama.embedding_length": 0}, {}, None, ["llama.embedding_length", "outside"]),
    "zero dimension tensor": ({}, {"blk.0.ffn_norm.weight": (0,)}, None, ["blk.0.ffn_norm.weight", "zero dimension"]),
    "embedding does not divide by heads": ({"llama.embedding_length": 66, "llama.attention.head_count": 4}, {}, None,
                                           ["llama.embedding_length", "66", "llama.attention.head_count"]),
    "head_count_kv does not divide": ({"llama.attention.head_count_kv": 3}, {}, None,
                                      ["llama.attention.head_count_kv", "multiple"]),
    "head_count missing": ({"llama.attention.head_count": DROP}, {}, None, ["lacks 'llama.attention.head_count'"]),
    "head_count is text": ({"llama.attention.head_count": "four"}, {}, None,
                           ["llama.attention.head_count", "not a whole number"]),
    "context_length negative": ({"llama.context_length": -5}, {}, None, ["llama.context_length", "-5"]),
    "eps is nan": ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, {}, None,
                   ["llama.attention.layer_norm_rms_epsilon"]),
    "bos id outside the vocabulary": ({"tokenizer.ggml.bos_token_id": 10**6}, {}, None,
                                      ["tokenizer.ggml.bos_token_id", "1000000"]),
    "tensor count 2**40": ({}, {}, lambda p: _patch_u64(p, 8, 1 << 40), ["count", "end of the file"]),
    "metadata count 2**40": ({}, {}, lambda p: _patch_u64(p, 16, 1 << 40), ["count", "end of the file"]),
    "data offset past the end": ({}, {}, _lie_offset, ["blk.1.ffn_down.weight", "truncated"]),
    # Memory blow-ups from small files: a metadata array became a Python list (~9x its bytes), and a vocabulary of
    # "a", "aa", ... "a" * N made N²/2 SentencePiece merges (a 2 MB file gave a 1 GB tokenizer.json).
    "metadata array of 4M+ entries": ({"general.junk": [0] * 4_000_001}, {}, None, ["metadata array of 4,000,001"]),
    "SentencePiece merges explode": (*_spm({f"a{'a' * k}" for k in range(1500)}), None,
                                     ["merges of more than", "characters in all"]),
    "SentencePiece piece of 5000 characters": (*_spm({"x" * 5000}), None, ["a piece of 5,000 characters"]),
}


def _cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_gguf_is_refused_before_anything_is_written(tmp_path, case):
    meta, shapes, patch, needles = CASES[case]
    path = make_gguf(tmp_path / "hostile.gguf", meta, shapes)
    if patch:
        patch(path)
    cache = tmp_path / "cache"
    started = time.monotonic()
    proc = run_in_process("generate", str(path), "-p", "hi", "-n", "1", env={"MLXINFER_CACHE": str(cache)},
                          timeout=120)
    assert_one_line_error(proc, *needles)
    assert time.monotonic() - started < 60
    assert _cache_files(cache) == []


def test_hostile_gguf_convert_leaves_nothing(tmp_path):
    """Through convert too: the import into its temp dir is refused before it starts; no output, no temp dir."""
    path = make_gguf(tmp_path / "hostile.gguf", shapes={"blk.0.ffn_up.weight": (FF // 2, H)})
    proc = run("convert", str(path), "-o", str(tmp_path / "out"), "--bits", "4", "--no-eval",
               env={"MLXINFER_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(proc, "blk.0.ffn_up.weight")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostile.gguf"]


def test_the_untouched_file_imports_and_runs(tmp_path):
    """The control: the same builder without a lie gives a model the CLI runs (so the cases above can fail)."""
    path = make_gguf(tmp_path / "good.gguf")
    cache = tmp_path / "cache"
    proc = run("generate", str(path), "-p", "hi", "-n", "2", "--temp", "0", env={"MLXINFER_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert any(p.name == "model.safetensors" for p in cache.rglob("*"))
    assert not [p for p in cache.rglob(".*.tmp-*")]


GARBAGE = ["text", -1, 0, 2**40, 1.5, float("inf"), True, [1, 2], ["a", "b"]]


def test_every_metadata_key_garbled_fails_cleanly(tmp_path, monkeypatch):
    """Each metadata key replaced by each kind of garbage, imported in-process: it either imports or raises the
    one-line InvalidModel, never another exception (an exit 1), and a failure leaves the cache empty."""
    from mlxinfer.errors import InvalidModel
    from mlxinfer.sources.gguf_import import import_gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("MLXINFER_CACHE", str(cache))
    outcomes = {"imported": 0, "refused": 0}
    for key in base_meta():
        for i, value in enumerate(GARBAGE):
            path = make_gguf(tmp_path / f"g{i}.gguf", {key: value})
            try:
                import_gguf(path)
                outcomes["imported"] += 1
                shutil.rmtree(cache)
            except InvalidModel as e:
                outcomes["refused"] += 1
                assert "\n" not in str(e)
                assert _cache_files(cache) == [], (key, value)
            path.unlink()
    assert outcomes["refused"] > 100 and outcomes["imported"] > 5, outcomes


def test_every_tensor_misshapen_is_refused(tmp_path, monkeypatch):
    """Each tensor one row longer, flattened or given an extra leading axis: refused by name, cache empty."""
    from mlxinfer.errors import InvalidModel
    from mlxinfer.sources.gguf_import import import_gguf

    cache = tmp_path / "cache"
    monkeypatch.setenv("MLXINFER_CACHE", str(cache))
    for name, shape in base_shapes().items():
        for bad in ((shape[0] + 1, *shape[1:]), (int(np.prod(shape)),) if len(shape) > 1 else (1, *shape),
                    (1, *shape)):
            path = make_gguf(tmp_path / "m.gguf", shapes={name: bad})
            with pytest.raises(InvalidModel, match=re.escape(name)):
                import_gguf(path)
            assert _cache_files(cache) == [], (name, bad)
