"""A whole llama / Qwen2 / Qwen3 decoder layer as one provider op (``decoder_block``), the KV cache written in place.

Why: on MLX's CPU backend each graph op costs ~7 us of Python, graph building and dispatch, and a SmolLM2
decode step is small enough for that to matter (7 fused ops x 30 layers was ~20% of a step). ``fused_llama``'s
blocks call :func:`native_block` first and fall back to their per-op path when it returns None.

The op writes this step's keys and values into the cache's buffers in place; ``kernels.kv_cache.InPlaceKVCache``
owns those buffers and says when that is safe (its module doc has the rules). This module is the op's only
caller. The block's fixed arguments are worked out once (:func:`prepare`) and kept on the block as a
:class:`BlockPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.kernels.eligibility import MLP_SWIGLU, has_role
from mlxinfer.kernels.kv_cache import InPlaceKVCache, kv_dtype
from mlxinfer.kernels.layers import plain_rope, rope_kwargs

# The weights decoder_block takes, in its order (w, scales, biases of each linear, then the two norms).
_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
_QKV_BIASES = (("self_attn", "q_proj", "bias"), ("self_attn", "k_proj", "bias"), ("self_attn", "v_proj", "bias"))
_QK_NORMS = (("self_attn", "q_norm", "weight"), ("self_attn", "k_norm", "weight"))


@dataclass(frozen=True)
class BlockPlan:
    config: Any        # the provider's fixed arguments (from block_config)
    head_dim: int
    extras: tuple      # paths of the weights after the first 23 (q/k/v biases, q/k norms)


def prepare(block, attention: str) -> bool:
    """Decide once whether ``block`` (llama's block code, with ``attention`` "llama" or "qwen3", the block's
    ``_kernel_provider`` set, the provider with the ``DecoderBlockKernel`` capability) runs as one
    ``decoder_block`` op; True when it does."""
    kv_dtype()  # a bad MLXINFER_KV_DTYPE fails when the model loads, not in the middle of a reply
    plan = _plan(block, attention)
    block._native_plan = plan
    return plan is not None


def is_one_op(block) -> bool:
    """``block`` runs (or will try to run) as one ``decoder_block`` op."""
    return block.__dict__.get("_native_plan") is not None


def native_block(block, x: mx.array, mask, cache) -> Optional[mx.array]:
    """``block(x, mask, cache)`` for a prepared block as one provider op, or None when this call is not one the op
    takes (then nothing has changed but, perhaps, the cache's buffers)."""
    # __dict__ lookups: nn.Module attribute access is a Python __getattr__ for what is not in it (~0.2 us each).
    plan = block.__dict__.get("_native_plan")
    if plan is None or x.ndim != 3 or x.dtype != mx.float32:
        return None
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return None
    cache = InPlaceKVCache.adopt(cache)
    if cache is None or not isinstance(cache.offset, int):
        return None
    provider = block._kernel_provider
    attn = block["self_attn"]
    buffers = cache.writable(provider, (x.shape[0], attn.n_kv_heads, plan.head_dim), x.shape[1])
    if buffers is None:
        return None
    weights = []
    for parent, name in _LINEARS:
        lin = block[parent][name]
        weights += (lin["weight"], lin["scales"], lin["biases"])
    weights += (block["input_layernorm"]["weight"], block["post_attention_layernorm"]["weight"])
    for parent, name, key in plan.extras:
        weights.append(block[parent][name][key])
    out = provider.decoder_block(x, weights, *buffers, offset=cache.offset, causal=mask is not None,
                                 config=plan.config, freqs=getattr(attn["rope"], "_freqs", None))
    if out is None:  # a model the op does not take: stop asking for this block
        block._native_plan = None
        return None
    y, k, v = out
    cache.written(provider, k, v, x.shape[1])
    return y


def _plan(block, attention: str) -> Optional[BlockPlan]:
    """The block's plan, or None when its parts are not all the op's kind."""
    provider = block._kernel_provider
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    try:
        layers = [getattr(getattr(block, parent), name) for parent, name in _LINEARS]
    except AttributeError:
        return None
    norms = [getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None)]
    with_bias = ["bias" in q for q in layers]
    if (not all(isinstance(q, nn.QuantizedLinear) and q.mode == "affine" and q.get("biases") is not None
                for q in layers)
            or len({(q.group_size, q.bits) for q in layers}) != 1
            or any(with_bias[3:]) or with_bias[:3] not in ([False] * 3, [True] * 3)
            or not all(isinstance(n, nn.RMSNorm) for n in norms)
            or not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "scale"))
            or not plain_rope(getattr(attn, "rope", None)) or not has_role(mlp, MLP_SWIGLU)):
        return None
    extras = _QKV_BIASES if with_bias[0] else ()
    qk_eps = 0.0
    if attention == "qwen3":
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if not (isinstance(qn, nn.RMSNorm) and isinstance(kn, nn.RMSNorm) and qn.eps == kn.eps):
            return None
        extras, qk_eps = extras + _QK_NORMS, qn.eps
    rope = rope_kwargs(attn.rope)
    head_dim = attn.q_proj["weight"].shape[0] // attn.n_heads
    config = provider.block_config(
        group_size=layers[0].group_size, bits=layers[0].bits, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
        head_dim=head_dim, rope_dims=attn.rope.dims, traditional=attn.rope.traditional, base=rope["base"],
        rope_scale=rope["scale"], attn_scale=attn.scale, eps1=norms[0].eps, eps2=norms[1].eps,
        qkv_bias=with_bias[0], qk_norm=attention == "qwen3", qk_eps=qk_eps,
    )
    return BlockPlan(config, head_dim, extras)
