"""Import a GGUF file as a plain MLX model directory (config.json, model.safetensors, tokenizer files).

- Q4_0, Q4_1 and Q8_0 blocks map exactly onto MLX affine quantization with group size 32: the nibbles/bytes
  are repacked, ``scale = d`` and ``bias = m`` (Q4_1), ``-8·d`` (Q4_0) or ``-128·d`` (Q8_0, stored unsigned).
- Every other tensor type (K-quants, IQ types, F16, BF16...) is dequantized by the ``gguf`` package and, for 2-D
  weights, re-quantized with ``mx.quantize`` at the closest MLX bit width.
- llama.cpp permutes the rows of Q/K projections of llama-family models for its interleaved RoPE; we undo that
  so the result has the Hugging Face layout and runs with mlx-lm's default (non-traditional) RoPE.
The result is written once per file content (sha256) under the cache directory, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InvalidModel
from .gguf_tokenizer import write_tokenizer

IMPORT_VERSION = 1
Progress = Callable[[str, int, int], None]  # (stage, done, total)

# GGUF architecture -> (HF model_type, per-arch options)
_ARCHS = {
    "llama": {"model_type": "llama", "permute_qk": True},
    "mistral": {"model_type": "mistral", "permute_qk": True},
    "qwen2": {"model_type": "qwen2", "permute_qk": False},
    "qwen3": {"model_type": "qwen3", "permute_qk": False},
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensor types that repack exactly; the value is MLX's bit width.
_EXACT = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_FLOAT = {"F32", "F16", "BF16", "F64"}
# Closest MLX bit width for types that must be re-quantized.
_REQUANT_BITS = {
    "Q2_K": 3, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q8_1": 8, "Q8_K": 8,
    "IQ1_S": 2, "IQ1_M": 2, "IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 2, "IQ3_XXS": 3, "IQ3_S": 3, "IQ4_NL": 4,
    "IQ4_XS": 4, "TQ1_0": 2, "TQ2_0": 2,
}
GROUP = 32


def cache_root() -> Path:
    if os.environ.get("MLXINFER_CACHE"):
        return Path(os.environ["MLXINFER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxinfer"


def file_digest(path: Path) -> str:
    """sha256 of the file, memoised by (path, size, mtime) so a large GGUF is hashed once."""
    st = path.stat()
    memo_file = cache_root() / "gguf" / "digests.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    memo[key] = h.hexdigest()
    _atomic_write_text(memo_file, json.dumps(memo))
    return memo[key]


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def imported_dir(path: Path) -> Path:
    """Where the MLX directory for this GGUF file lives (whether or not it exists yet)."""
    return cache_root() / "gguf" / f"{file_digest(path)[:24]}-v{IMPORT_VERSION}"


@dataclass
class _Reader:
    """The GGUF fields as plain Python values plus the tensor list."""

    meta: dict
    tensors: list


def _open(path: Path) -> _Reader:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/etc. on bad files
        raise InvalidModel(
            f"{path.name}: not a readable GGUF file ({type(e).__name__}: {e})",
            hint="the file may be truncated or corrupt; download it again",
        ) from None
    meta = {}
    for name, field in reader.fields.items():
        try:
            meta[name] = field.contents()
        except Exception:  # noqa: BLE001 - a malformed optional field is skipped, the required ones are checked
            continue
    return _Reader(meta, reader.tensors)


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = _GLOBAL_NAMES.get(base)
    return f"{mapped}.{suffix}" if mapped else None


def _repack_exact(kind: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks (rows, n_blocks * block_bytes) -> MLX (packed uint32, scales f16, biases f16)."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(rows, -1, block_bytes)  # (rows, n_blocks, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # (rows, n_blocks)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128  # (rows, n_blocks, 32) in [0, 255]
        packed = q.astype(np.uint8).reshape(rows, -1).view(np.uint32)
        return packed, d, (d.astype(np.float32) * -128).astype(np.float16)
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # (rows, n_blocks, 16)
    # GGUF: byte j holds element j (low nibble) and j+16 (high); MLX: byte b holds elements 2b and 2b+1.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, n_blocks, 32) in element order
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8).reshape(rows, -1).view(np.uint32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        return packed, d, m
    return packed, d, (d.astype(np.float32) * -8).astype(np.float16)


def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row index that undoes llama.cpp's Q/K permutation: W_hf = W_gguf[idx]."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


def _llm_config(meta: dict, arch: str, has_output: bool) -> dict:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        config = {
            "model_type": _ARCHS[arch]["model_type"],
            "architectures": [],
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
    except (TypeError, KeyError) as e:
        raise InvalidModel(f"GGUF metadata lacks {e}", hint="the file is incomplete or not an LLM") from None
    if arch in ("qwen2",):
        config["attention_bias"] = True
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "type": scaling, "rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 0)) or None,
        }
    config["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    return config


def convert_gguf(path: Path, out_dir: Path, progress: Progress | None = None) -> Path:
    """Convert ``path`` into an MLX model directory at ``out_dir`` (written atomically)."""
    import mlx.core as mx

    r = _open(path)
    arch = r.meta.get("general.architecture")
    if arch not in _ARCHS:
        raise InvalidModel(
            f"{path.name}: unsupported GGUF architecture '{arch}'", hint=f"supported: {', '.join(sorted(_ARCHS))}"
        )
    names = {t.name for t in r.tensors}
    config = _llm_config(r.meta, arch, has_output="output.weight" in names)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    permute = _ARCHS[arch]["permute_qk"]

    weights: dict[str, mx.array] = {}
    layer_quant: dict[str, dict] = {}
    bit_counts: dict[int, int] = {}
    for i, t in enumerate(r.tensors):
        if progress:
            progress("import", i, len(r.tensors))
        hf = _hf_name(t.name)
        if hf is None:
            if t.name.startswith("rope_freqs"):
                continue  # recomputed by mlx-lm from the config
            raise InvalidModel(f"{path.name}: unknown tensor '{t.name}' for architecture '{arch}'")
        kind = t.tensor_type.name
        prefix = hf.rsplit(".", 1)[0]
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims innermost first
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        perm = None
        if permute and prefix.endswith(("q_proj", "k_proj")):
            perm = _unpermute_rows(rows, n_heads if prefix.endswith("q_proj") else n_kv)
        try:
            if kind in _EXACT:
                w, s, b = _repack_exact(kind, np.asarray(t.data), rows)
                if perm is not None:
                    w, s, b = w[perm], s[perm], b[perm]
                weights[f"{prefix}.weight"] = mx.array(w)
                weights[f"{prefix}.scales"] = mx.array(s)
                weights[f"{prefix}.biases"] = mx.array(b)
                bits = _EXACT[kind]
            else:
                if kind in _FLOAT:
                    arr = np.asarray(t.data)
                    if kind == "BF16":
                        arr = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                    arr = arr.astype(np.float32).reshape(shape)
                elif kind in _REQUANT_BITS:
                    import gguf

                    arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
                else:
                    raise InvalidModel(
                        f"{path.name}: unsupported GGUF tensor type {kind} in '{t.name}'",
                        hint="re-export the model as Q8_0, Q4_K or F16",
                    )
                if perm is not None:
                    arr = arr[perm]
                if kind in _FLOAT or arr.ndim == 1:
                    weights[hf] = mx.array(arr).astype(mx.float16 if arr.ndim > 1 else mx.float32)
                    bits = None
                else:
                    bits = _REQUANT_BITS[kind]
                    w, s, b = mx.quantize(mx.array(arr), group_size=GROUP, bits=bits)
                    weights[f"{prefix}.weight"] = w
                    weights[f"{prefix}.scales"] = s.astype(mx.float16)
                    weights[f"{prefix}.biases"] = b.astype(mx.float16)
        except (ValueError, IndexError) as e:
            raise InvalidModel(
                f"{path.name}: tensor '{t.name}' is damaged ({e})", hint="the file may be truncated; download it again"
            ) from None
        if bits is not None:
            layer_quant[prefix] = {"group_size": GROUP, "bits": bits}
            bit_counts[bits] = bit_counts.get(bits, 0) + 1

    if bit_counts:
        main_bits = max(bit_counts, key=bit_counts.get)
        quant = {"group_size": GROUP, "bits": main_bits, "mode": "affine"}
        for prefix, q in layer_quant.items():
            if q["bits"] != main_bits:
                quant[prefix] = q
        config["quantization"] = quant
        config["quantization_config"] = quant
    config["mlxinfer"] = {
        "source": "gguf", "file": path.name, "file_type": r.meta.get("general.file_type"),
        "name": r.meta.get("general.name"), "import_version": IMPORT_VERSION,
    }

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        tok_meta = {k: v for k, v in r.meta.items() if k.startswith("tokenizer.")}
        tok_config = write_tokenizer(tok_meta, tmp, context_length=config["max_position_embeddings"])
        gen = {}
        for key in ("bos", "eos"):
            idx = r.meta.get(f"tokenizer.ggml.{key}_token_id")
            if idx is not None:
                gen[f"{key}_token_id"] = int(idx)
        config.update(gen)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if progress:
            progress("write", 0, 1)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del tok_config
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        if progress:
            progress("write", 1, 1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def import_gguf(path: Path, progress: Progress | None = None) -> Path:
    """The cached MLX directory for a GGUF file, converting it on first use."""
    path = Path(path)
    target = imported_dir(path)
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    return convert_gguf(path, target, progress)
