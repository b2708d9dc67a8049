"""Tokenizers rebuilt from GGUF metadata: a synthetic SentencePiece ('llama') vocabulary against llama.cpp's ids
(recorded by ``scripts/make_tokenizer_fixture.py``, vocabulary stored in the fixture), and every supported
byte-level pre-tokenizer type builds a working tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxinfer.errors import InvalidModel
from mlxinfer.sources.gguf_tokenizer import PRE_TOKENIZERS, write_tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizer"


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    fixture = json.loads((FIXTURES / "synthetic-spm.llamacpp.json").read_text())
    out = tmp_path_factory.mktemp("spm")
    config = write_tokenizer(fixture["tokenizer"], out)
    return fixture, config, load_tokenizer(out)


def test_spm_ids_match_llama_cpp(spm):
    fixture, _, tok = spm
    assert len(fixture["records"]) >= 200
    bad = [(r["text"], tok.encode(r["text"], add_special_tokens=False), r["ids"]) for r in fixture["records"]
           if tok.encode(r["text"], add_special_tokens=False) != r["ids"]]
    assert not bad, f"{len(bad)} differ, first: {bad[0]!r}"


def test_spm_adds_bos_like_llama_cpp(spm):
    fixture, config, tok = spm
    assert config["add_bos_token"] is True  # SPM default in llama.cpp when the GGUF has no add_bos key
    for r in fixture["records"]:
        assert tok.encode(r["text"], add_special_tokens=True) == r["ids_add_bos"], r["text"]


def test_spm_without_space_prefix(spm, tmp_path):
    from tokenizers import Tokenizer

    fixture, _, _ = spm
    write_tokenizer({**fixture["tokenizer"], "tokenizer.ggml.add_space_prefix": False}, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = [r["text"] for r in fixture["records"]]
    got = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    bad = [(t, g, e) for t, g, e in zip(texts, got, fixture["no_space_prefix_ids"]) if g != e]
    assert not bad, f"{len(bad)} differ, first: {bad[0]!r}"
    assert got != [r["ids"] for r in fixture["records"]]  # the flag changes the result


def test_spm_decode_round_trips(spm):
    fixture, _, tok = spm
    types = fixture["tokenizer"]["tokenizer.ggml.token_type"]
    plain = [r for r in fixture["records"] if all(types[i] != 3 for i in r["ids"])]
    assert len(plain) > 200
    for r in plain:  # (after a control token the ▁ prefix rule adds a space, in llama.cpp too)
        # byte fallback makes SPM lossless; the decoder drops the one space the add-space-prefix rule put in
        # front (as llama.cpp's llama_detokenize does). llama-cpp-python's piece-joining detokenize is not used
        # as the reference here: it stops at some byte-fallback pieces.
        assert tok.decode(r["ids"], skip_special_tokens=False) == r["text"], r["text"]


def test_spm_streaming_detokenizer(spm):
    _, _, tok = spm
    text = "Hello world, the capital of France is Paris.\n  def f(x): return 42"
    detok = tok.detokenizer
    detok.reset()
    for i in tok.encode(text, add_special_tokens=False):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text


def _tiny_bpe_meta(pre: str | None) -> dict:
    # the 256 GPT-2 byte characters (enough for any input) plus one merge and one special token
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    chars = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<|end|>", *chars, "Ġa"],
            "tokenizer.ggml.token_type": [3] + [1] * 257, "tokenizer.ggml.merges": ["Ġ a"],
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.bos_token_id": 0}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS) + [None])
def test_every_pre_tokenizer_type_builds_and_round_trips(tmp_path, pre):
    from tokenizers import Tokenizer

    write_tokenizer(_tiny_bpe_meta(pre), tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # the regexes compile in tokenizers' engine
    text = "Hello  wörld 12345 it's\n\tx 你好 😀 a<|end|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert 0 in enc.ids and tok.decode(enc.ids, skip_special_tokens=False) == text


def test_llama3_family_sets_ignore_merges_and_bos(tmp_path):
    config = write_tokenizer(_tiny_bpe_meta("llama-bpe"), tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    assert data["model"]["ignore_merges"] is True and config["add_bos_token"] is True
    meta = _tiny_bpe_meta("llama-bpe") | {"tokenizer.ggml.add_bos_token": False}  # the file's flag wins
    assert write_tokenizer(meta, tmp_path)["add_bos_token"] is False


def test_unsupported_vocabularies_are_clear_errors(tmp_path):
    with pytest.raises(InvalidModel, match="unsupported GGUF tokenizer model 'bert'"):
        write_tokenizer(_tiny_bpe_meta(None) | {"tokenizer.ggml.model": "bert"}, tmp_path)
    with pytest.raises(InvalidModel, match="unsupported GGUF pre-tokenizer 'made-up'"):
        write_tokenizer(_tiny_bpe_meta("made-up"), tmp_path)
