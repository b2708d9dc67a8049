"""Sanity checks on a model directory before mlx-lm builds anything from it.

config.json drives what mlx-lm constructs (10**9 layers is 10**9 Python modules) and transformers reads it again
for the tokenizer, so a hostile or broken one must fail here with one line, not as a ZeroDivisionError or an
hour-long build. The sizes are also compared with the safetensors headers actually present (shapes only: a few KB
read per file, no tensor data).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..errors import DamagedFile, InvalidModel

# Generous upper bounds: ten times beyond the largest published models, far below what would exhaust memory.
_INT_LIMITS = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "num_hidden_layers": 4096,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 28,
    "num_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "n_routed_experts": 1 << 14,
    "num_experts_per_tok": 1 << 14,
}
_MAY_BE_ZERO = {"intermediate_size", "moe_intermediate_size"}  # e.g. all-MoE models
_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
_MAX_HEADER = 100 << 20  # bytes of JSON in one safetensors header; real ones are well under 10 MB
_EMBED_RE = re.compile(r"(?:^|\.)(?:embed_tokens|wte|tok_embeddings|word_embeddings)\.weight$")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "U32": 32, "I16": 16,
               "U16": 16, "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8}


def require_regular(file: Path) -> None:
    """A FIFO, device or socket where a model file should be would block the read forever (or never end)."""
    import stat

    try:
        mode = file.stat().st_mode
    except OSError:
        return  # missing: the caller's own open says so
    if not stat.S_ISREG(mode):
        raise InvalidModel(f"{file} is not a regular file (a FIFO, device or socket)",
                           hint="a model folder holds plain files; remove it or download the model again")


def read_config(path: Path) -> dict:
    """config.json as a dict, or one line saying why it cannot be one."""
    file = path / "config.json"
    require_regular(file)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InvalidModel(f"{file} is not UTF-8 text", hint="it is not a model config") from None
    except ValueError as e:
        raise InvalidModel(f"{file} is not valid JSON ({e})", hint="the file may be truncated or corrupt") from None
    except RecursionError:
        raise InvalidModel(f"{file} nests JSON too deeply", hint="it is not a model config") from None
    if not isinstance(config, dict):
        raise InvalidModel(f"{file} is a JSON {_kind(config)}, not an object", hint="it is not a model config")
    return config


def _kind(value) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def check_config(path: Path, config: dict) -> None:
    """Types and bounds of the fields mlx-lm sizes the model from (top level and text_config)."""
    file = path / "config.json"
    model_type = config.get("model_type")
    if model_type is None:
        raise InvalidModel(f"{file} has no 'model_type'",
                           hint="it names the architecture, e.g. \"llama\"; this file may not be a model config")
    if not isinstance(model_type, str) or not model_type.replace("-", "_").isidentifier():
        raise InvalidModel(f"{file}: 'model_type' is {model_type!r}, not an architecture name", hint="e.g. \"llama\"")
    scopes = [("", config)]
    if isinstance(config.get("text_config"), dict):
        scopes.append(("text_config.", config["text_config"]))
    for prefix, scope in scopes:
        for key, limit in _INT_LIMITS.items():
            value = scope.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidModel(f"{file}: '{prefix}{key}' is {value!r}, not a whole number",
                                   hint="the config is corrupt")
            low = 0 if key in _MAY_BE_ZERO else 1
            if not low <= value <= limit:
                raise InvalidModel(f"{file}: '{prefix}{key}' is {value}, outside {low}..{limit}",
                                   hint="the config is corrupt or not meant for this loader")
        for key in _FLOAT_FIELDS:
            value = scope.get(key)
            if value is None:
                continue
            bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            if bad or value < 0 or (key == "rope_theta" and value == 0):
                raise InvalidModel(f"{file}: '{prefix}{key}' is {value!r}, not a positive number",
                                   hint="the config is corrupt")
        hidden, heads, kv = (scope.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
        if hidden and heads and scope.get("head_dim") is None and hidden < heads:  # head size would be 0
            raise InvalidModel(f"{file}: '{prefix}hidden_size' {hidden} is smaller than "
                               f"'{prefix}num_attention_heads' {heads}", hint="the config is corrupt")
        if heads and kv and heads % kv:
            raise InvalidModel(f"{file}: '{prefix}num_attention_heads' {heads} is not a multiple of "
                               f"'{prefix}num_key_value_heads' {kv}", hint="the config is corrupt")
    q = config.get("quantization")
    if q is not None:
        ok = isinstance(q, dict) and all(isinstance(q.get(k), int) and not isinstance(q.get(k), bool)
                                         for k in ("bits", "group_size"))
        if not ok or not (1 <= q["bits"] <= 8 and 1 <= q["group_size"] <= 4096):
            raise InvalidModel(f"{file}: 'quantization' is {json.dumps(q)[:80]}, not bits 1..8 with a group size",
                               hint="the config is corrupt")


def safetensors_header(file: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors header, checked against the file size.
    Reads the header only."""
    try:
        require_regular(file)
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(size - 8, _MAX_HEADER):
                raise DamagedFile(f"{file} is not a safetensors file or is truncated (header length {n}, "
                                   f"file {size} bytes)", hint="delete it and download or convert again")
            header = json.loads(f.read(n))
    except OSError as e:
        raise InvalidModel(f"cannot read {file}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise DamagedFile(f"{file} has a corrupt safetensors header", hint="delete it and download or convert again") \
            from None
    if not isinstance(header, dict):
        raise DamagedFile(f"{file} has a corrupt safetensors header", hint="delete it and download or convert again")
    header.pop("__metadata__", None)
    data_size, end = size - 8 - n, 0
    for name, info in header.items():
        try:
            shape, (start, stop) = [int(d) for d in info["shape"]], info["data_offsets"]
            bits = _DTYPE_BITS.get(info["dtype"], 8)
            ok = all(d >= 0 for d in shape) and 0 <= int(start) <= int(stop)
            need = math.prod(shape) * bits // 8
        except (TypeError, KeyError, ValueError, AttributeError, OverflowError):  # OverflowError: int(1e400)
            ok, need, stop, start = False, 0, 0, 0
        if not ok or int(stop) - int(start) < need:
            raise DamagedFile(f"{file}: tensor '{name}' has an inconsistent header entry",
                               hint="the file is corrupt; delete it and download or convert again")
        end = max(end, int(stop))
    if end > data_size:
        raise DamagedFile(f"{file} is truncated: its header needs {end} bytes of data, the file has {data_size}",
                           hint="delete it and download or convert again")
    return header


def text_value(config: dict, key: str):
    """A language-model field of config.json: top level, else in ``text_config`` (the layout of multimodal
    checkpoints that mlx-lm runs as text models: Gemma 3 4B+, Mistral 3 / Ministral 3); None when in neither."""
    if key in config:
        return config[key]
    text = config.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def check_weights_match(path: Path, config: dict) -> None:
    """The vocabulary, hidden size and layer count in config.json against the tensors actually present."""
    tensors: dict[str, dict] = {}
    for file in sorted(path.glob("model*.safetensors")):
        tensors.update(safetensors_header(file))
    file = path / "config.json"
    vocab, hidden, layers = (text_value(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))

    embeds = [n for n in tensors if _EMBED_RE.search(n) and not re.search(r"vision|visual|audio", n)]
    if len(embeds) == 1 and len(tensors[embeds[0]]["shape"]) == 2:
        name = embeds[0]
        rows, cols = tensors[name]["shape"]
        if isinstance(vocab, int) and rows != vocab:
            raise InvalidModel(f"{file} says vocab_size {vocab} but {name} in the weights has {rows} rows",
                               hint="the config does not belong to these weights")
        width = _unpacked_width(name, tensors[name], config)
        if isinstance(hidden, int) and width is not None and width != hidden:
            raise InvalidModel(f"{file} says hidden_size {hidden} but {name} in the weights is {width} wide",
                               hint="the config does not belong to these weights")
    if isinstance(config.get("quantization"), dict):
        for n, info in tensors.items():  # MLX packs quantized weights into uint32 words beside their scales
            if n.endswith(".scales") and n[:-7] + ".weight" in tensors \
                    and tensors[n[:-7] + ".weight"].get("dtype") != "U32":
                raise InvalidModel(f"{file}: {n[:-7]}.weight is stored as {tensors[n[:-7] + '.weight'].get('dtype')}"
                                   " beside its scales, not as packed uint32 words",
                                   hint="the weights are corrupt or not MLX-quantized; convert the model again")
    stacks: dict[str, set[int]] = {}
    for n in tensors:
        m = _LAYER_RE.search(n)
        if m:
            stacks.setdefault(n[: m.start(1)], set()).add(int(m.group(1)))
    if isinstance(layers, int) and stacks:
        present = max(len(v) for v in stacks.values())
        if layers > present:  # more layers in the weights is fine: some models carry extra (e.g. MTP) layers
            raise InvalidModel(f"{file} says num_hidden_layers {layers} but the weights hold {present} layers",
                               hint="the config does not belong to these weights, or weight files are missing")


def _unpacked_width(name: str, info: dict, config: dict) -> int | None:
    """Columns of an embedding, undoing MLX's packing of quantized weights into uint32."""
    cols = info["shape"][1]
    if info.get("dtype") != "U32":
        return cols
    q = config.get("quantization")
    if not isinstance(q, dict):
        return None
    override = q.get(name.rsplit(".", 1)[0])
    bits = (override if isinstance(override, dict) else q).get("bits")
    return cols * 32 // bits if isinstance(bits, int) and bits > 0 else None


def check_model_files(path: Path) -> dict:
    """config.json parsed and sane, and consistent with the weights; returns it."""
    config = read_config(path)
    check_config(path, config)
    check_weights_match(path, config)
    return config
