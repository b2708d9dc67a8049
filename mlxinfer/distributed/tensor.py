"""Tensor parallel through mlx-lm's ``model.shard(group)``: each rank holds 1/size of every attention and MLP
matrix; the two ``sharded-to-all`` projections per layer (o_proj, down_proj) end in an all-reduce.

``why_not(model, config, size)`` says why a model cannot be sharded this way (no ``shard`` method, head counts or
quantization groups that do not divide) so the caller can fall back to pipeline parallel with that reason.
"""

from __future__ import annotations

from typing import Optional

from .group import World


def why_not(model, config: dict, size: int) -> Optional[str]:
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm's {config.get('model_type', '?')} model has no shard() (tensor parallel)"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = text.get("num_attention_heads")
    kv = text.get("num_key_value_heads", heads)
    inter = text.get("intermediate_size")
    hidden = text.get("hidden_size")
    for name, value in (("attention heads", heads), ("key/value heads", kv), ("MLP width", inter)):
        if isinstance(value, int) and value % size:
            return f"{value} {name} do not divide by {size} ranks"
    q = config.get("quantization") or {}
    group = q.get("group_size") if isinstance(q, dict) else None
    if isinstance(group, int) and isinstance(heads, int) and isinstance(hidden, int):
        head_dim = text.get("head_dim") or hidden // heads
        for name, width in (("attention output", heads * head_dim), ("MLP width", inter or 0)):
            if width and (width // size) % group:
                return f"the {name} ({width}) split {size} ways is not a multiple of the quantization group {group}"
    return None


def shard(model, world: World) -> dict:
    model.shard(world.group)
    return {"strategy": "tensor", "layers": "all (1/%d of each matrix)" % world.size}


def kernel_groups(model) -> str:
    """What runs each layer group of a tensor-parallel model, read from its module classes after the kernels
    were applied: mlx's sharded layers (MLX's built-in quantized matmul) and the custom kernel classes."""
    sharded, custom, quantized = [], {}, False
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not leaf or leaf.isdigit():
            continue
        where = type(m).__module__
        if where.startswith("mlx.nn.layers.distributed"):
            quantized = quantized or type(m).__name__.startswith("Quantized")
            if leaf not in sharded:
                sharded.append(leaf)
        elif where.startswith("mlxinfer."):
            leaves = custom.setdefault(type(m).__name__, [])
            if leaf not in leaves:
                leaves.append(leaf)
    matmul = "quantized matmul" if quantized else "matmul"
    line = (f"sharded linear layers run MLX's built-in {matmul} ({', '.join(sorted(sharded)) or 'none'}: the "
            "custom kernels take only unsharded nn.QuantizedLinear, and the fused attention / MLP / decoder layer, "
            "which fold whole projections into one op with no all-reduce, step aside)")
    if custom:
        line += "; custom kernels: " + ", ".join(f"{', '.join(sorted(v))} ({k})" for k, v in sorted(custom.items()))
    return line
