"""Tiny random-weight MLX model directories, one per popular mlx-lm architecture, built in the test session.

Each model is what ``mlx_lm.convert`` would write for a real checkpoint of that family (float16 weights, mostly
quantized with ``mlx_lm.utils.quantize_model``, saved by ``save_model``/``save_config``), shrunk to hidden 64 and
2 layers. The vocabulary is SmolLM2's 49152 so the real tokenizer files can be copied in. Weights are drawn with a
fixed seed and the embeddings are scaled so logits spread like a trained model's (std ~4): greedy choices then
have clear margins, and a cache or kernel bug moves logits by far more than float32 round-off.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_COMMON = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 2048, "torch_dtype": "float16",
    "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass(frozen=True)
class Arch:
    """One tiny model: its config.json fields beyond ``_COMMON`` and how it is stored."""

    config: dict
    bits: int | None = 4          # None: left in float16
    group_size: int = 64
    what: str = ""                # the architectural feature this model covers


ARCHS: dict[str, Arch] = {
    "llama": Arch({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0}, what="untied lm_head"),
    "mistral": Arch({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "tie_word_embeddings": False,
                     "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None}, bits=None,
                    what="float16, mlx-lm remaps mistral -> llama"),
    "qwen2": Arch({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True,
                   "rms_norm_eps": 1e-6, "rope_theta": 1e6}, group_size=32, what="q/k/v biases, group 32"),
    "qwen3": Arch({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True,
                   "rms_norm_eps": 1e-6, "rope_theta": 1e6, "head_dim": 32}, what="q/k RMSNorm, head_dim 32"),
    "gemma3_text": Arch({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "head_dim": 32,
                         "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 32, "sliding_window": 64,
                         "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0, "rope_theta": 1e6},
                        what="sliding-window + global layers, (1 + w) norms, scaled embeddings"),
    "ministral3": Arch({"model_type": "ministral3", "architectures": ["Ministral3ForCausalLM"], "head_dim": 16,
                        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 128,
                        # Real Ministral 3 configs use YaRN (factor = 128 / 8); a tiny original context makes the
                        # position-dependent query scaling (floor(pos / 8)) change inside a short prompt.
                        "rope_parameters": {"rope_type": "yarn", "type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                            "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "llama_4_scaling_beta": 0.1}},
                       bits=8, what="8-bit, YaRN rope, llama-4 position-dependent query scaling"),
    # mlx-community's Ministral 3 repos: the text model inside mistral3's multimodal layout (text_config; the
    # vision tower's weights, absent here, are dropped by mlx-lm).
    "mistral3": Arch({"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
                      "text_config": "ministral3"}, group_size=32, what="ministral3 inside mistral3's text_config"),
    "smollm3": Arch({"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "rms_norm_eps": 1e-6,
                     "rope_theta": 1e5, "tie_word_embeddings": True, "no_rope_layer_interval": 2},
                    what="NoPE layers (every 2nd layer without RoPE), llama's classes"),
    "phi4_mini": Arch({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "rms_norm_eps": 1e-5,
                       "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
                       "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                       "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.4, 1.8, 2.5],
                                        "long_factor": [1.0, 1.3, 2.0, 3.5, 6.0, 11.0]}},
                      group_size=32, what="Phi-4-mini's partial rotary (0.75) and LongRoPE (SuScaledRoPE)"),
    "phi3": Arch({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "rms_norm_eps": 1e-5,
                  "rope_theta": 10000.0, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
                 group_size=32, what="fused qkv and gate_up projections"),
    "olmo2": Arch({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "rms_norm_eps": 1e-6,
                   "rope_theta": 500000.0, "tie_word_embeddings": False},
                  what="post norms only, q/k RMSNorms over the whole projection"),
    "olmo3": Arch({"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "rms_norm_eps": 1e-6, "head_dim": 32,
                   "rope_theta": 500000.0, "tie_word_embeddings": False, "sliding_window": 64,
                   "layer_types": ["sliding_attention", "full_attention"],
                   # Olmo-3's full layers use YaRN (its sliding ones plain RoPE); a factor > 1 gives an input scale.
                   "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                                    "beta_fast": 32.0, "beta_slow": 1.0}},
                  group_size=32, what="post norms, sliding + full layers, YaRN on the full ones"),
    "starcoder2": Arch({"model_type": "starcoder2", "architectures": ["Starcoder2ForCausalLM"], "norm_epsilon": 1e-5,
                        "rope_theta": 100000.0, "tie_word_embeddings": True},
                       what="LayerNorm with bias, GELU MLP with biases"),
    "gpt_neox": Arch({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "layer_norm_eps": 1e-5,
                      "rotary_emb_base": 10000, "rotary_pct": 0.25, "use_parallel_residual": True},
                     what="parallel residual, partial rotary"),
    "qwen3_moe": Arch({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16,
                       "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "num_experts": 4,
                       "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                       "moe_intermediate_size": 32, "norm_topk_prob": True},
                      what="mixture of experts (SwitchGLU), router"),
}


# Layers that add into the residual stream. Amplified so that the layers, not the token's own embedding, dominate
# the last hidden state: with tied embeddings the model would otherwise just repeat its input token when greedy.
_RESIDUAL_WRITERS = {"o_proj", "down_proj", "c_proj", "dense", "dense_4h_to_h"}
RESIDUAL_GAIN = 12.0


def config_for(name: str) -> dict:
    """config.json of the tiny ``name``; a ``text_config`` naming another arch nests that arch's whole config
    (the multimodal layout: nothing of the language model at the top level)."""
    config = ARCHS[name].config
    if isinstance(config.get("text_config"), str):
        return {**config, "text_config": config_for(config["text_config"])}
    return {**_COMMON, **config}


def _random_params(model, seed: int) -> dict:
    """Deterministic weights by parameter name (numpy's generator: stable across MLX versions)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        leaf = name.rsplit(".", 2)
        if "embed" in name or "lm_head" in name or name.endswith("embed_out.weight"):
            arr = 0.5 * rng.standard_normal(shape)  # logits std ~ 0.5 * sqrt(hidden) = 4
        elif len(shape) == 1 and "norm" in name and leaf[-1] == "weight":
            # Gemma norms multiply by (1 + w): around 0 there, around 1 elsewhere.
            base = 0.0 if "gemma" in type(model).__module__ else 1.0
            arr = base + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            arr = 0.1 * rng.standard_normal(shape)
        else:  # (out, in) or (experts, out, in): unit-variance outputs
            arr = rng.standard_normal(shape) / np.sqrt(shape[-1])
            if leaf[-2] in _RESIDUAL_WRITERS:
                arr *= RESIDUAL_GAIN
        params[name] = mx.array(arr.astype(np.float32))
    return params


def make_model(name: str, *, seed: int = 0, overrides: dict | None = None):
    """The tiny ``name`` model in memory (float32, quantized as ``ARCHS`` says), ``overrides`` merged into its
    config: what the CPU kernels run after mlxinfer's loader (float32 activations, scales and norms)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model

    arch = ARCHS[name]
    config = {**config_for(name), **(overrides or {})}
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_unflatten(list(_random_params(model, seed).items())))
    if arch.bits is not None:
        model, config = quantize_model(model, config, group_size=arch.group_size, bits=arch.bits)
    mx.eval(model.parameters())
    return model


def build(name: str, out_dir: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """Write the tiny ``name`` model (see ``ARCHS``) as an MLX model directory; returns ``out_dir``."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    arch = ARCHS[name]
    config = config_for(name)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_unflatten(list(_random_params(model, seed).items())))
    model.set_dtype(mx.float16)  # checkpoints ship float16; the loader's dtype policy decides what runs
    if arch.bits is not None:
        model, config = quantize_model(model, config, group_size=arch.group_size, bits=arch.bits)
    mx.eval(model.parameters())

    out_dir = Path(out_dir)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for fname in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / fname
        if src.is_file():
            shutil.copyfile(src, out_dir / fname)
    return out_dir
