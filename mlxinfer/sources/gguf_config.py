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
    "phi3": ("phi3", "Phi3ForCausalLM", False),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", False),
    # Ministral 3 (llama.cpp's mistral3, the text model of Mistral 3): llama's layer, YaRN, llama-4 query scaling
    "mistral3": ("ministral3", "Ministral3ForCausalLM", True),
}
# Per-architecture GGUF block tensor names that differ from the llama mapping.
BLOCK_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3 / Phi-4-mini: fused q/k/v rows, and gate rows then up rows in one ffn_up (llama.cpp's SwiGLU split)
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # OLMo 2: norms after attention and after the MLP only (its q/k norms span the whole projection)
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight; Gemma's by 1 + w)
NORM_SHIFT = {"gemma3": 1.0}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
COMMON_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Bounds on the sizes read from metadata (as engine.model_checks bounds config.json): far beyond real models,
# far below what would exhaust memory. (key suffix, config field, lowest, highest)
_INT_KEYS = (
    ("embedding_length", "hidden_size", 1, 1 << 17),
    ("block_count", "num_hidden_layers", 1, 4096),
    ("feed_forward_length", "intermediate_size", 0, 1 << 20),
    ("attention.head_count", "num_attention_heads", 1, 1 << 12),
    ("attention.head_count_kv", "num_key_value_heads", 1, 1 << 12),
    ("context_length", "max_position_embeddings", 1, 1 << 28),
)
MAX_VOCAB = 1 << 24
_MISSING = object()


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> the Hugging Face name mlx-lm loads (None: not a tensor of this architecture)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = (base.split(".", 2) + ["", ""])[:3]
        mapped = (BLOCK_NAMES.get(arch, {}).get(part) or COMMON_BLOCK_NAMES.get(part)) if layer.isdigit() else None
        return f"model.layers.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = GLOBAL_NAMES.get(base)
    return f"{mapped}.{suffix}" if mapped else None


def gguf_name(hf: str, arch: str = "llama") -> str:
    """The inverse of ``hf_name``, for messages about tensors a file lacks (``hf`` itself when unmapped)."""
    base, _, suffix = hf.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        names = {**COMMON_BLOCK_NAMES, **BLOCK_NAMES.get(arch, {})}  # this architecture's GGUF -> HF names
        found = [g for g, h in names.items() if h == part]
        return f"blk.{layer}.{found[0]}.{suffix}" if found else hf
    for g, h in GLOBAL_NAMES.items():
        if h == base:
            return f"{g}.{suffix}"
    return hf


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def meta_int(meta: dict, key: str, default=_MISSING, lo: int = 0, hi: int = 1 << 62) -> int:
    """An integer metadata value within [lo, hi], or one line naming the key."""
    value = meta.get(key, default)
    if value is _MISSING or value is None:
        raise InvalidModel(f"GGUF metadata lacks '{key}'", hint="the file is incomplete or not a supported LLM")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidModel(f"GGUF metadata '{key}' is {_short(value)}, not a whole number",
                           hint="the file is corrupt or not a supported LLM")
    if not lo <= value <= hi:
        raise InvalidModel(f"GGUF metadata '{key}' is {value}, outside {lo}..{hi}",
                           hint="the file is corrupt or not a supported LLM")
    return value


def meta_float(meta: dict, key: str, default: float, *, positive: bool = False) -> float:
    value = meta.get(key, default)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and np.isfinite(value) and (
        value > 0 if positive else value >= 0)
    if not ok:
        raise InvalidModel(f"GGUF metadata '{key}' is {_short(value)}, not a {'positive' if positive else 'non-negative'}"
                           " number", hint="the file is corrupt")
    return float(value)


def llm_config(meta: dict, arch: str, has_output: bool) -> dict:
    """config.json for mlx-lm from ``{arch}.*`` metadata; every value is type- and bounds-checked, naming its key."""
    model_type, cls, permuted = ARCHS[arch]
    config: dict[str, Any] = {"model_type": model_type, "architectures": [cls]}
    for key, field, lo, hi in _INT_KEYS:
        default = config.get("num_attention_heads", _MISSING) if key == "attention.head_count_kv" else (
            4096 if key == "context_length" else _MISSING)
        config[field] = meta_int(meta, f"{arch}.{key}", default, lo, hi)
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    if f"{arch}.attention.key_length" in meta:
        head_dim = meta_int(meta, f"{arch}.attention.key_length", lo=1, hi=1 << 14)
    elif hidden % heads:
        raise InvalidModel(f"GGUF metadata '{arch}.embedding_length' {hidden} does not divide by "
                           f"'{arch}.attention.head_count' {heads}", hint="the file is corrupt")
    else:
        head_dim = hidden // heads
    if heads % kv:
        raise InvalidModel(f"GGUF metadata '{arch}.attention.head_count' {heads} is not a multiple of "
                           f"'{arch}.attention.head_count_kv' {kv}", hint="the file is corrupt")
    if permuted and head_dim % 2:
        raise InvalidModel(f"GGUF metadata gives an odd head size {head_dim} ('{arch}.embedding_length' / "
                           f"'{arch}.attention.head_count'); RoPE needs an even one", hint="the file is corrupt")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= MAX_VOCAB:
        raise InvalidModel("GGUF metadata 'tokenizer.ggml.tokens' is not a vocabulary of 1.."
                           f"{MAX_VOCAB} tokens", hint="the file is corrupt or not an LLM")
    config.update({
        "rms_norm_eps": meta_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta_float(meta, f"{arch}.rope.freq_base", 10000.0, positive=True),
        "vocab_size": len(tokens),
        "tie_word_embeddings": not has_output,
        "head_dim": head_dim,
    })

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    if arch == "qwen2":
        config["attention_bias"] = True
    if arch == "gemma3":
        # as llama.cpp's loader: sliding-window layers use a local RoPE base, every 6th layer is global, and
        # queries are scaled by 1/sqrt(head_dim) except on the 27B (62 layers), where it is hidden/heads
        config.update({
            "rope_local_base_freq": meta_float(meta, f"{arch}.rope.freq_base_swa", 10000.0, positive=True),
            "sliding_window": meta_int(meta, f"{arch}.attention.sliding_window", 512, 1, 1 << 28),
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": hidden / heads if config["num_hidden_layers"] == 62 else config["head_dim"],
        })
    if arch == "phi3":
        _phi3_config(meta, config)
    if arch == "mistral3":
        _mistral3_config(meta, config)
        return config
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        if not isinstance(scaling, str):
            raise InvalidModel(f"GGUF metadata '{arch}.rope.scaling.type' is {_short(scaling)}, not a name")
        factor = meta_float(meta, f"{arch}.rope.scaling.factor", 1.0, positive=True)
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling, "factor": factor}
        if get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = meta_int(
                meta, f"{arch}.rope.scaling.original_context_length", lo=1, hi=1 << 28)
    return config


def _phi3_config(meta: dict, config: dict) -> None:
    """Partial rotary embedding (``rope.dimension_count`` of each head, 96 of 128 on Phi-4-mini); mlx-lm's phi3
    takes the head size as hidden / heads, so the file must agree."""
    hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    if head_dim * heads != hidden:
        raise InvalidModel(f"GGUF metadata 'phi3.attention.key_length' {head_dim} is not 'phi3.embedding_length' "
                           f"{hidden} / 'phi3.attention.head_count' {heads}", hint="the file is corrupt")
    rot = meta_int(meta, "phi3.rope.dimension_count", head_dim, 2, head_dim)
    if rot % 2:
        raise InvalidModel(f"GGUF metadata 'phi3.rope.dimension_count' is {rot}; RoPE needs an even size",
                           hint="the file is corrupt")
    config["partial_rotary_factor"] = rot / head_dim
    config["original_max_position_embeddings"] = meta_int(
        meta, "phi3.rope.scaling.original_context_length", config["max_position_embeddings"], 1, 1 << 28)


def _mistral3_config(meta: dict, config: dict) -> None:
    """mlx-lm's ministral3 takes its RoPE and query scaling as ``rope_parameters``: YaRN (``rope.scaling.*``; the
    magnitude scale stays 1, as llama.cpp's mistral3 graph cancels it) and the llama-4 query factor
    1 + beta * log(1 + floor(pos / length)) from ``attention.temperature_scale`` (beta, 0: none) and
    ``attention.temperature_length`` (default: the original context)."""
    theta = config.pop("rope_theta")
    params: dict[str, Any] = {"rope_theta": theta}
    scaling = meta.get("mistral3.rope.scaling.type")
    context = config["max_position_embeddings"]
    orig = meta_int(meta, "mistral3.rope.scaling.original_context_length", context, 1, 1 << 28)
    if scaling == "yarn":
        params.update({"rope_type": "yarn", "type": "yarn", "original_max_position_embeddings": orig,
                       "factor": meta_float(meta, "mistral3.rope.scaling.factor", 1.0, positive=True),
                       "beta_fast": meta_float(meta, "mistral3.rope.scaling.yarn_beta_fast", 32.0, positive=True),
                       "beta_slow": meta_float(meta, "mistral3.rope.scaling.yarn_beta_slow", 1.0, positive=True),
                       "mscale": 1.0, "mscale_all_dim": 1.0})
    elif scaling not in (None, "none"):
        raise InvalidModel(f"GGUF metadata 'mistral3.rope.scaling.type' is {_short(scaling)}; mistral3 files use "
                           "yarn or none", hint="this RoPE scaling is not supported yet")
    params["llama_4_scaling_beta"] = meta_float(meta, "mistral3.attention.temperature_scale", 0.0)
    params["original_max_position_embeddings"] = meta_int(meta, "mistral3.attention.temperature_length", orig,
                                                          1, 1 << 28)
    if params.get("rope_type") == "yarn" and params["original_max_position_embeddings"] != orig:
        raise InvalidModel("GGUF metadata 'mistral3.attention.temperature_length' differs from "
                           "'mistral3.rope.scaling.original_context_length' (mlx-lm's ministral3 has one original "
                           "context for both)", hint="this file's layout is not supported")
    config["rope_parameters"] = params


def phi3_longrope(long: np.ndarray, short: np.ndarray, config: dict) -> dict:
    """LongRoPE factors (``rope_factors_long``/``_short`` tensors, one per rotated frequency) -> rope_scaling.
    mlx-lm applies the long factors at every length (llama.cpp picks the short ones up to the original context)."""
    want = round(config["head_dim"] * config.get("partial_rotary_factor", 1.0)) // 2
    for name, arr in (("rope_factors_long", long), ("rope_factors_short", short)):
        if arr.shape != (want,) or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
            raise InvalidModel(f"tensor '{name}.weight' is not {want} positive factors (half the rotary size)",
                               hint="the file is corrupt")
    return {"type": "longrope", "long_factor": [float(v) for v in long], "short_factor": [float(v) for v in short]}


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
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    top = max(len(tokens) - 1, 0)
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        gen["bos_token_id"] = meta_int(meta, "tokenizer.ggml.bos_token_id", hi=top)
    eos = [meta_int(meta, f"tokenizer.ggml.{k}_token_id", hi=top) for k in ("eos", "eot", "eom")
           if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    if not isinstance(types, list) or (types and len(types) != len(tokens)):
        raise InvalidModel("GGUF metadata 'tokenizer.ggml.token_type' does not match 'tokenizer.ggml.tokens' "
                           "in length", hint="the file is corrupt")
    # llama.cpp also ends generation at these control tokens when the vocabulary has them
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
        if isinstance(meta.get(f"general.{key}"), (str, int, float)):
            info[key] = meta[f"general.{key}"]
    if isinstance(meta.get("general.file_type"), int):
        info["file_type"] = int(meta["general.file_type"])
        info["file_type_name"] = _file_type_name(int(meta["general.file_type"]))
    return info
