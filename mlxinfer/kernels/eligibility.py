"""Which mlx-lm classes the fused paths may replace: an explicit table, by class identity, for validated versions.

A fused path reimplements a module's maths, so it may only take a module whose maths we have read and tested.
Each row names an mlx-lm class and the role its code plays; a class is looked up by identity (the object found
at ``mlx_lm.models.<module>.<name>`` must be the module's class itself), never by comparing source text. Rows
were read against the mlx-lm versions in ``VALIDATED_MLX_LM``; on any other version no class has a role and the
fused paths step aside (per-op kernels on MLX's own layer classes still run). What the table cannot prove (a
monkeypatched or changed method on the same class) the load-time self-check (``kernels.selfcheck``) catches.

Roles:
  attention/llama  q/k/v projections, head split, RoPE at cache.offset, cache update, attention, o_proj
  attention/qwen3  the same with per-head RMSNorms on q and k before RoPE
  mlp/swiglu       down_proj(silu(gate_proj(x)) * up_proj(x))
  block/prenorm    h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))

The one-op decoder layer has its own table next to this one: ``kernels.spec.BUILDERS`` maps a block class (same
identity rule, same versions) to the builder that reads a block into a ``LayerSpec`` (gemma3_text and phi3
blocks are only there, olmo2/olmo3/ministral3 blocks too (their MLPs are rows here): their layers have no per-op
fused attention or block path).

Adding a family: a row here (per-op fused attention/MLP) and/or a builder in ``kernels.spec``, a tiny
random-weight model in tests/models/tiny_arch.py, and the parity tests in tests/kernels/ (docs/cpu-kernels.md,
"Adding an architecture").
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

VALIDATED_MLX_LM = ("0.32.",)  # version prefixes whose classes below were read and tested

ATTENTION_LLAMA, ATTENTION_QWEN3 = "attention/llama", "attention/qwen3"
MLP_SWIGLU, BLOCK_PRENORM = "mlp/swiglu", "block/prenorm"

# (mlx_lm.models module, class name) -> role. Mistral and SmolLM2/SmolLM3 run llama's classes (SmolLM3's NoPE
# layers replace the rope module, which the fused paths then decline).
ROLES: dict[tuple[str, str], str] = {
    ("llama", "Attention"): ATTENTION_LLAMA,
    ("llama", "MLP"): MLP_SWIGLU,
    ("llama", "TransformerBlock"): BLOCK_PRENORM,
    ("qwen2", "Attention"): ATTENTION_LLAMA,
    ("qwen2", "MLP"): MLP_SWIGLU,
    ("qwen2", "TransformerBlock"): BLOCK_PRENORM,
    ("qwen3", "Attention"): ATTENTION_QWEN3,
    ("qwen3", "MLP"): MLP_SWIGLU,
    ("qwen3", "TransformerBlock"): BLOCK_PRENORM,
    ("qwen3_moe", "Attention"): ATTENTION_QWEN3,
    ("qwen3_moe", "MLP"): MLP_SWIGLU,
    ("qwen3_moe", "Qwen3MoeDecoderLayer"): BLOCK_PRENORM,  # fused only in layers whose MLP is dense SwiGLU
    ("olmo2", "MLP"): MLP_SWIGLU,
    ("olmo3", "Olmo3MLP"): MLP_SWIGLU,
    ("ministral3", "MLP"): MLP_SWIGLU,
}


@functools.lru_cache(maxsize=None)
def mlx_lm_validated() -> Optional[str]:
    """None when the installed mlx-lm is a validated version, else the one-line reason the fused paths are off."""
    import mlx_lm

    version = getattr(mlx_lm, "__version__", "?")
    if any(version.startswith(prefix) for prefix in VALIDATED_MLX_LM):
        return None
    return f"mlx-lm {version} is not a version the fused layers were validated against ({', '.join(VALIDATED_MLX_LM)}x)"


def table_key(cls: type) -> Optional[tuple[str, str]]:
    """(mlx_lm.models module, class name) of an mlx-lm class (or of the class a fused subclass was made from), when
    the object found under that name is the class itself and the installed mlx-lm is validated; else None. The
    key the tables here and in ``kernels.spec`` are read with."""
    cls = getattr(cls, "_fused_base", None) or cls
    module = getattr(cls, "__module__", "")
    if not module.startswith("mlx_lm.models.") or mlx_lm_validated() is not None:
        return None
    if getattr(sys.modules.get(module), cls.__qualname__, None) is not cls:
        return None
    return module[len("mlx_lm.models."):], cls.__qualname__


def role_of(cls: type) -> Optional[str]:
    """The role of an mlx-lm class (or of the class a fused subclass was made from), or None."""
    key = table_key(cls)
    return ROLES.get(key) if key is not None else None


def has_role(module, role: str) -> bool:
    return module is not None and role_of(type(module)) == role
