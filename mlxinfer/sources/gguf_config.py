"""GGUF metadata -> the Hugging Face ``config.json`` and ``generation_config.json`` that mlx-lm reads, plus the
``general.*`` facts (name, size label, file type) kept in config.json's "mlxinfer" section for the chat header."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidModel

# GGUF architecture -> HF model_type / class, and whether llama.cpp permuted Q/K rows at conversion.
ARCHS = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("mistral", "MistralForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
}
# Per-architecture GGUF block tensor names that differ from the llama mapping.
BLOCK_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight; Gemma's by 1 + w)
NORM_SHIFT = {"gemma3": 1.0}


def llm_config(meta: dict, arch: str, has_output: bool) -> dict:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    model_type, cls, _ = ARCHS[arch]
    try:
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        config = {
            "model_type": model_type, "architectures": [cls],
            "hidden_size": hidden,
            "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(get("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 4096)),
            "vocab_size": len(meta["tokenizer.ggml.tokens"]),
            "tie_word_embeddings": not has_output,
            "head_dim": int(get("attention.key_length", hidden // heads)),
        }
    except (TypeError, KeyError, ValueError, ZeroDivisionError) as e:
        raise InvalidModel(f"GGUF metadata lacks or garbles {e}", hint="the file is incomplete or not an LLM") from None
    if arch == "qwen2":
        config["attention_bias"] = True
    if arch == "gemma3":
        # as llama.cpp's loader: sliding-window layers use a local RoPE base, every 6th layer is global, and
        # queries are scaled by 1/sqrt(head_dim) except on the 27B (62 layers), where it is hidden/heads
        config.update({
            "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
            "sliding_window": int(get("attention.sliding_window", 512)), "sliding_window_pattern": 6,
            "query_pre_attn_scalar": hidden / heads if config["num_hidden_layers"] == 62 else config["head_dim"],
        })
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        if get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    return config


def llama3_rope_scaling(factors: np.ndarray, base: float, head_dim: int) -> dict:
    """Llama 3.x GGUFs carry their RoPE scaling as a per-frequency factor tensor (``rope_freqs``); recover the
    ``llama3`` rope_scaling parameters that llama.cpp's converter computed it from (it uses this formula)."""
    wavelen = 2 * np.pi * base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low:
                    continue
                smooth = (orig / wavelen - low) / (high - low)
                expected = np.where(wavelen < orig / high, 1.0, np.where(
                    wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)))
                if np.allclose(expected, factors, rtol=1e-4, atol=1e-6):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise InvalidModel("the GGUF's rope_freqs factors do not follow the Llama 3 RoPE scaling rule",
                       hint="this RoPE scaling is not supported yet")


_EOG_TEXTS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>"}


def generation_config(meta: dict) -> dict:
    """BOS and the end-of-generation ids: EOS, then EOT/EOM and the end-of-turn tokens llama.cpp detects."""
    gen: dict[str, Any] = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        gen["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    eos = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    # llama.cpp also ends generation at these control tokens when the vocabulary has them
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    eos += [i for i, tok in enumerate(tokens) if tok in _EOG_TEXTS and (not types or types[i] in (3, 4))]
    eos = list(dict.fromkeys(eos))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return gen


# general.file_type names for the common files (no ``gguf`` import needed on the fast path)
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}


def _file_type_name(value: int) -> str:
    if value in _FILE_TYPES:
        return _FILE_TYPES[value]
    import gguf

    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


def header_info(meta: dict, path: Path) -> dict:
    """What the chat header and `models` show: name, size label, file type; from ``general.*``."""
    info: dict[str, Any] = {"source": "gguf", "file": path.name}
    for key in ("name", "basename", "finetune", "size_label", "organization", "license", "quantization_version"):
        if meta.get(f"general.{key}") is not None:
            info[key] = meta[f"general.{key}"]
    if meta.get("general.file_type") is not None:
        info["file_type"] = int(meta["general.file_type"])
        info["file_type_name"] = _file_type_name(int(meta["general.file_type"]))
    return info
