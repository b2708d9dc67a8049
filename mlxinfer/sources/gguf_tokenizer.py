"""Rebuild a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json`` from GGUF tokenizer metadata.

GGUF stores the vocabulary, merges, token types, special-token ids, the chat template and, for byte-level BPE,
the name of llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). The pre-tokenizer decides how text is split
before BPE: llama.cpp applies a list of regexes in turn, each one splitting the pieces further, and we express
the same list as a ``Sequence`` of ``Split(..., "isolated")`` followed by a byte-level mapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InvalidModel

# GPT-2's pattern, the base of most byte-level BPE vocabularies.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regexes llama.cpp applies in order (llama-vocab.cpp).
PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [_GPT2],
    "gpt2": [_GPT2],
    "gpt-2": [_GPT2],
    "mpt": [_GPT2],
    "olmo": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "falcon3": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
}

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _pre_tokenizer(pre: str) -> dict:
    if pre not in PRE_TOKENIZERS:
        raise InvalidModel(
            f"unsupported GGUF pre-tokenizer '{pre}'",
            hint=f"supported: {', '.join(sorted(PRE_TOKENIZERS))}",
        )
    splits = [
        {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
        for rx in PRE_TOKENIZERS[pre]
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict]:
    out = []
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ in (CONTROL, USER_DEFINED):
            out.append({
                "id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": typ == USER_DEFINED and False, "special": typ == CONTROL,
            })
    return out


def _bpe_tokenizer_json(meta: dict[str, Any]) -> dict:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    pre = meta.get("tokenizer.ggml.pre", "default")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(pre),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def _token(meta: dict, key: str) -> str | None:
    tokens = meta["tokenizer.ggml.tokens"]
    idx = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def write_tokenizer(meta: dict[str, Any], out_dir: Path, *, context_length: int | None = None) -> dict:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the tokenizer config.

    ``meta`` holds plain Python values (str, int, bool, lists) for the ``tokenizer.*`` GGUF keys.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise InvalidModel(
            f"unsupported GGUF tokenizer model '{model}'", hint="mlxinfer imports byte-level BPE ('gpt2') tokenizers"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(_bpe_tokenizer_json(meta), ensure_ascii=False))

    specials = {k: _token(meta, k) for k in ("bos", "eos", "unknown", "padding")}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
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
