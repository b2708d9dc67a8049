"""Rebuild a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json`` from GGUF tokenizer metadata.

Two GGUF vocabularies are supported, each rebuilt to tokenize exactly like llama.cpp (``src/llama-vocab.cpp``):
- ``gpt2`` (byte-level BPE): llama.cpp splits text with a list of regexes chosen by ``tokenizer.ggml.pre``, each
  splitting the pieces of the previous one; we express the same list as a ``Sequence`` of ``Split(..., isolated)``
  followed by a byte-level mapping. Some pre-tokenizer types also set ``ignore_merges`` and add BOS by default.
- ``llama`` (SentencePiece BPE, Llama-2/Mistral): spaces become ``▁`` and every text fragment (the start and
  each one after a special token) gets a ``▁`` prefix; pieces merge by score with byte fallback. We express
  it as a BPE model whose merges are all vocab pairs ranked by the merged piece's score.
Control/unknown tokens become special added tokens, user-defined ones plain added tokens; both are matched in the
raw text first, like llama.cpp's ``tokenize(..., parse_special=true)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InvalidModel

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]

# regex lists as llama.cpp's llm_tokenizer_bpe builds them, and the flags its vocab loader sets per type:
# (regexes, ignore_merges, add_bos by default, clean_spaces)
_PRE_KINDS: dict[str, tuple[list[str], bool, bool, bool]] = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False, True),
    "llama3": ([_LLAMA3], True, True, True),
    "llama3-plain": ([_LLAMA3], False, False, True),
    "gpt2": ([_GPT2], False, False, True),
    "gpt2-noclean": ([_GPT2], False, False, False),
    "digits-gpt2": ([r"\p{N}", _GPT2], False, False, True),
    "digits-gpt2-noclean": ([r"\p{N}", _GPT2], False, False, False),
    "qwen2": ([_QWEN2], False, False, False),
    "qwen2-clean": ([_QWEN2], False, False, True),
    "qwen35": ([_QWEN35], False, False, False),
    "deepseek-v3": (_DEEPSEEK3, False, False, False),
    "deepseek-coder": ([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False, False, False),
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False, False, True),
    "tekken": ([_TEKKEN], True, True, False),
    "gpt-4o": ([_GPT4O], False, False, False),
}
_PRE_NAMES = {
    "llama3": "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
    "llama3-plain": "dbrx smaug-bpe glm4 chatglm-bpe",
    "gpt2": "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo jais "
            "exaone4 jina-v1-en jina-v2-code roberta-bpe",
    "gpt2-noclean": "trillion granite-docling",
    "digits-gpt2": "starcoder refact codeshell exaone minerva-7b mellum2",
    "digits-gpt2-noclean": "smollm command-r",
    "qwen2": "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2",
    "qwen2-clean": "stablelm2 megrez",
    "qwen35": "qwen35",
    "deepseek-v3": "deepseek-v3 hunyuan-dense joyai-llm hy_v4",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    "tekken": "tekken",
    "gpt-4o": "gpt-4o llama4 kanana2 talkie minimax-m2",
    "default": "default",
}
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool, bool]] = {
    name: _PRE_KINDS[kind] for kind, names in _PRE_NAMES.items() for name in names.split()
}
SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _pre_kind(pre: str | None) -> tuple[list[str], bool, bool, bool]:
    if not pre:
        return _PRE_KINDS["default"]  # llama.cpp warns and uses its default regexes
    if pre not in PRE_TOKENIZERS:
        raise InvalidModel(f"unsupported GGUF pre-tokenizer '{pre}'", hint="supported: " + ", ".join(sorted(PRE_TOKENIZERS)))
    return PRE_TOKENIZERS[pre]


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict]:
    # normalized=False: matched in the raw text before any normalizer/pre-tokenizer, as llama.cpp does
    return [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": typ != USER_DEFINED}
        for i, (tok, typ) in enumerate(zip(tokens, types)) if typ in (CONTROL, USER_DEFINED, UNKNOWN)
    ]


def _post_processor(meta: dict, add_bos: bool, add_eos: bool) -> dict | None:
    tokens = meta["tokenizer.ggml.tokens"]
    single: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}]
    pair: list[dict] = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    specials = {}
    for key, add, at_start in (("bos", add_bos, True), ("eos", add_eos, False)):
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not add or idx is None:
            continue
        tok = tokens[idx]
        special = {"SpecialToken": {"id": tok, "type_id": 0}}
        single.insert(0 if at_start else len(single), special)
        pair.insert(0 if at_start else len(pair), special)
        specials[tok] = {"id": tok, "ids": [int(idx)], "tokens": [tok]}
    if not specials:
        return None
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}


def _split_merge(merge: str) -> list[str] | None:
    # llama.cpp splits at the first space after position 0, so a merge may start with a space; one without a
    # space can never apply (llama.cpp files it under an empty pair), so it is dropped
    i = merge.find(" ", 1)
    return [merge[:i], merge[i + 1:]] if i > 0 else None


def _bpe_tokenizer_json(meta: dict[str, Any], add_bos: bool, add_eos: bool) -> dict:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    regexes, ignore_merges, _, _ = _pre_kind(meta.get("tokenizer.ggml.pre"))
    splits = [{"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False} for rx in regexes]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "post_processor": _post_processor(meta, add_bos, add_eos) or byte_level,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
            "vocab": (vocab := {tok: i for i, tok in enumerate(tokens)}),
            # as llama.cpp: a merge whose pieces or result are not in the vocabulary never applies (tokenizers
            # would refuse to load the whole file for it)
            "merges": [pair for m in meta.get("tokenizer.ggml.merges") or [] if (pair := _split_merge(m))
                       and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab],
        },
    }


MAX_PIECE_CHARS = 4096
MAX_MERGE_CHARS = 100_000_000  # characters over all merges (Gemma 3's 262k pieces: ~20M)


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[list[str]]:
    """Every (left, right) pair of vocab pieces whose concatenation is a piece, best merged score first.

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation has the highest score;
    BPE with merges ranked by that score does the same.
    """
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED, UNUSED)}
    get, merges = ids.get, []
    # A crafted vocabulary ("a", "aa", ... "a" * N) makes N²/2 merges (a 2 MB file gave a 1 GB tokenizer.json):
    # real ones give a few per piece (Gemma 3: ~2.5M for 262k pieces) and no piece is kilobytes long.
    limit, chars = max(MAX_MERGE_CHARS, 64 * len(ids)), 0
    for piece, i in ids.items():  # ~2.5M splits for a 262k vocabulary: kept to plain dict lookups
        if len(piece) > MAX_PIECE_CHARS:
            raise InvalidModel(f"the GGUF's vocabulary has a piece of {len(piece):,} characters (the most a real "
                               f"one has is far below {MAX_PIECE_CHARS:,})", hint="the file is corrupt or crafted")
        if chars > limit:
            raise InvalidModel(f"the GGUF's vocabulary makes merges of more than {limit:,} characters in all (a few "
                               "per piece in a real one)", hint="the file is corrupt or crafted")
        before = len(merges)
        for k in range(1, len(piece)):
            left = get(piece[:k])
            if left is not None:
                right = get(piece[k:])
                if right is not None:
                    merges.append((-scores[i], i, left, right))
        chars += (len(merges) - before) * len(piece)
    merges.sort()
    return [[tokens[left], tokens[right]] for _, _, left, right in merges]


def _spm_tokenizer_json(meta: dict[str, Any], add_bos: bool, add_eos: bool) -> dict:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    # a normalizer (not Metaspace) so the ▁ prefix is added to every fragment, also one that starts with a space
    normalizers = [{"type": "Prepend", "prepend": "▁"}] if add_prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": _post_processor(meta, add_bos, add_eos),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None and unk < len(tokens) else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
            "ignore_merges": False, "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": _spm_merges(tokens, types, scores),
        },
    }


def _token(meta: dict, key: str) -> str | None:
    tokens = meta["tokenizer.ggml.tokens"]
    idx = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def check_tokenizer(meta: dict[str, Any]) -> None:
    """Raise ``InvalidModel`` unless ``write_tokenizer`` can rebuild this GGUF's tokenizer."""
    for key in ("model", "pre"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not isinstance(value, str):
            raise InvalidModel(f"GGUF metadata 'tokenizer.ggml.{key}' is {value!r:.40}, not a name",
                               hint="the file is corrupt")
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise InvalidModel(f"unsupported GGUF tokenizer model '{model}'",
                           hint="mlxinfer imports byte-level BPE ('gpt2') and SentencePiece ('llama') vocabularies")
    if not meta.get("tokenizer.ggml.tokens"):
        raise InvalidModel("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    for key, kinds in (("tokens", str), ("merges", str), ("token_type", int), ("scores", (int, float))):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, kinds) for v in value)):
            raise InvalidModel(f"GGUF metadata 'tokenizer.ggml.{key}' is not a list of "
                               f"{'strings' if kinds is str else 'numbers'}", hint="the file is corrupt")
        if key in ("token_type", "scores") and value and len(value) != len(meta["tokenizer.ggml.tokens"]):
            raise InvalidModel(f"GGUF metadata 'tokenizer.ggml.{key}' has {len(value)} entries for "
                               f"{len(meta['tokenizer.ggml.tokens'])} tokens", hint="the file is corrupt")
    for key in sorted(k for k in meta if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")):
        value = meta[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidModel(f"GGUF metadata '{key}' is {value!r:.40}, not a token id", hint="the file is corrupt")
    if model == "gpt2":
        _pre_kind(meta.get("tokenizer.ggml.pre"))


def write_tokenizer(meta: dict[str, Any], out_dir: Path, *, context_length: int | None = None) -> dict:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the tokenizer config.

    ``meta`` holds plain Python values (str, int, bool, lists) for the ``tokenizer.*`` GGUF keys.
    """
    check_tokenizer(meta)
    model = meta["tokenizer.ggml.model"]
    if model == "gpt2":
        _, _, add_bos, clean = _pre_kind(meta.get("tokenizer.ggml.pre"))
    else:
        add_bos, clean = True, False
    # the GGUF's own flags win over the per-type defaults, as in llama.cpp
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    build = _bpe_tokenizer_json if model == "gpt2" else _spm_tokenizer_json
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(build(meta, add_bos, add_eos)))

    specials = {k: _token(meta, k) for k in ("bos", "eos", "unknown", "padding")}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": clean,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": specials["bos"],
        "eos_token": specials["eos"],
        "unk_token": specials["unknown"],
        "pad_token": specials["padding"],
        "model_max_length": context_length or 2**31,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    config = {k: v for k, v in config.items() if v is not None}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map = {f"{k}_token": config[f"{k}_token"] for k in ("bos", "eos", "unk", "pad") if f"{k}_token" in config}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False))
    return config
