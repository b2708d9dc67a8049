"""Tiny random-weight models in Hugging Face format (fp16 safetensors + config.json + tokenizer), built in tests.

The tokenizer is a 512-token byte-level BPE trained on mlxinfer's own evaluation sample, so the models are small
(a vocabulary of 49152 would make the embedding dominate every test) and the sample tokenizes densely.
Weights are scaled so that next-token distributions are peaked, like a trained model's: with near-uniform outputs
every KL divergence would be tiny and a quality test could not fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

ARCHS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True,
              "head_dim": 32},
}


def make_tokenizer(out_dir: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mlxinfer.convert.quality import sample_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([sample_text()], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 2048,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }))
    (out_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                  "pad_token": "<|endoftext|>"}))
    return out_dir


def hf_config(arch: str, *, hidden: int = 64, layers: int = 4, intermediate: int = 128, vocab: int = VOCAB) -> dict:
    config = {
        **ARCHS[arch], "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": vocab, "max_position_embeddings": 2048, "torch_dtype": "float16",
        "bos_token_id": 0, "eos_token_id": 2,
    }
    if arch == "qwen2":
        config["attention_bias"] = True  # HF qwen2 has q/k/v biases; mlx-lm builds them unconditionally
    return config


def _shapes(config: dict) -> dict[str, tuple]:
    """HF tensor names and shapes, built from the mlx-lm model class (the same names as the HF checkpoint)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def make_hf_model(out_dir: Path, tokenizer_dir: Path, arch: str = "llama", *, seed: int = 0, shards: int = 2,
                  dtype=np.float16, **sizes) -> Path:
    """Write a random-weight model in Hugging Face layout (sharded safetensors + index) into ``out_dir``."""
    import mlx.core as mx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(arch, **sizes)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in _shapes(config).items():
        if name.endswith("norm.weight"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            arr = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or "lm_head" in name:
            arr = 0.5 * rng.standard_normal(shape)  # peaked logits: std ~ 0.5 * sqrt(hidden)
        else:
            arr = rng.standard_normal(shape) / np.sqrt(shape[-1])
        tensors[name] = arr.astype(dtype)
    if arch == "llama":  # present in many HF llama checkpoints; mlx-lm's sanitize drops it
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, dtype=np.float32)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {k: mx.array(tensors[k]) for k in names[i * per:(i + 1) * per]}
        mx.save_safetensors(str(out_dir / fname), part, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 2}))
    for f in Path(tokenizer_dir).iterdir():
        (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir
