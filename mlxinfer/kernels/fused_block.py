"""A whole llama / Qwen2 / Qwen3 decoder layer as one provider op (``decoder_block``), the KV cache written in place.

Why: on MLX's CPU backend each graph op costs ~7 us of Python, graph building and dispatch, and a SmolLM2
decode step is small enough for that to matter (7 fused ops x 30 layers was ~20% of a step). ``fused_llama``'s
blocks call :func:`native_block` first and fall back to their per-op path when it returns None.

The in-place promise. MLX arrays are values; ``decoder_block`` writes this step's keys and values into the two
buffers it is given, at ``[offset, offset + L)``. This module is its only caller and keeps that safe:

* it passes only buffers that ``kv_reserve`` allocated for this cache (fresh memory: never a view of another
  array, never a buffer donated by one), recognised by MLX descriptor identity (``array_id``): mlx-lm's own update
  (``keys[...] = k`` rebinds the Python object to a new array) or ``cache.state = ...`` hands the cache other
  arrays, and the next call copies them into a fresh buffer instead;
* it writes only at or past the high-water mark of what the cache ever held in that buffer: whoever took the
  buffer (``cache.state``) or a slice of it reads below the offset of that moment. After ``cache.trim`` the next
  call copies into a fresh buffer first, so positions a holder may still read are never overwritten.

Like mlx-lm's ``KVCache``, the buffers grow in steps of ``cache.step`` positions (a copy into a larger buffer).
They hold float16 unless ``MLXINFER_KV_DTYPE=float32`` (see :func:`kv_dtype`).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.errors import InvalidParameter

KV_DTYPE_ENV = "MLXINFER_KV_DTYPE"
_TAG = "_mlxinfer_kv"  # KVCache attribute: [k handle, v handle, k id, v id, high-water mark]
CONFIG_ATTR = "_native_block_config"  # block attribute: (provider config, head_dim, extra paths), or False
_LINEARS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
_QKV_BIASES = (("self_attn", "q_proj", "bias"), ("self_attn", "k_proj", "bias"), ("self_attn", "v_proj", "bias"))
_QK_NORMS = (("self_attn", "q_norm", "weight"), ("self_attn", "k_norm", "weight"))


def prepare(block, attention: str) -> bool:
    """Decide once whether ``block`` (llama's block code, with ``attention`` "llama" or "qwen3" source code, the
    block's ``_kernel_provider`` set) runs as one ``decoder_block`` op; True when it does."""
    kv_dtype()  # a bad MLXINFER_KV_DTYPE fails when the model loads, not in the middle of a reply
    config = _block_config(block, attention)
    block.__dict__[CONFIG_ATTR] = config
    return config is not False


def native_block(block, x: mx.array, mask, cache) -> Optional[mx.array]:
    """``block(x, mask, cache)`` for a prepared block as one provider op, or None when this call is not one the op
    takes (then nothing has changed but, perhaps, the cache's buffers)."""
    from mlx_lm.models.cache import KVCache

    config = block.__dict__.get(CONFIG_ATTR)
    if (not config or type(cache) is not KVCache or x.ndim != 3 or x.dtype != mx.float32
            or not isinstance(cache.offset, int)):
        return None
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return None
    provider = block._kernel_provider
    attn = block["self_attn"]
    buffers = _owned_buffers(provider, cache, (x.shape[0], attn.n_kv_heads, config[1]), x.shape[1])
    if buffers is None:
        return None
    # Dict lookups, not attributes: nn.Module attribute access is a Python __getattr__ (~0.2 us each).
    weights = []
    for parent, name in _LINEARS:
        lin = block[parent][name]
        weights += (lin["weight"], lin["scales"], lin["biases"])
    weights += (block["input_layernorm"]["weight"], block["post_attention_layernorm"]["weight"])
    for parent, name, key in config[2]:
        weights.append(block[parent][name][key])
    out = provider.decoder_block(x, weights, *buffers, offset=cache.offset, causal=mask is not None,
                                 config=config[0], freqs=getattr(attn["rope"], "_freqs", None))
    if out is None:  # a model the op does not take: stop asking for this block
        block.__dict__[CONFIG_ATTR] = False
        return None
    y, k, v = out
    cache.keys, cache.values = k, v  # the same memory; evaluating them runs the op (mx.eval(cache.state))
    cache.offset += x.shape[1]
    _tag(provider, cache, k, v)
    return y


def _block_config(block, attention: str):
    """(The provider's fixed arguments for this block, head_dim, paths of the extra weights), or False when its
    parts are not all the op's kind."""
    from mlxinfer.kernels.eligibility import MLP_SWIGLU, has_role
    from mlxinfer.kernels.fused_llama import plain_rope, rope_kwargs

    provider = block._kernel_provider
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    try:
        layers = [getattr(getattr(block, parent), name) for parent, name in _LINEARS]
    except AttributeError:
        return False
    norms = [getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None)]
    with_bias = ["bias" in q for q in layers]
    if (getattr(provider, "block_config", None) is None
            or not all(isinstance(q, nn.QuantizedLinear) and q.mode == "affine" and q.get("biases") is not None
                       for q in layers)
            or len({(q.group_size, q.bits) for q in layers}) != 1
            or any(with_bias[3:]) or with_bias[:3] not in ([False] * 3, [True] * 3)
            or not all(isinstance(n, nn.RMSNorm) for n in norms)
            or not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "scale"))
            or not plain_rope(getattr(attn, "rope", None)) or not has_role(mlp, MLP_SWIGLU)):
        return False
    extras = _QKV_BIASES if with_bias[0] else ()
    qk_eps = 0.0
    if attention == "qwen3":
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if not (isinstance(qn, nn.RMSNorm) and isinstance(kn, nn.RMSNorm) and qn.eps == kn.eps):
            return False
        extras, qk_eps = extras + _QK_NORMS, qn.eps
    rope = rope_kwargs(attn.rope)
    head_dim = attn.q_proj["weight"].shape[0] // attn.n_heads
    config = provider.block_config(
        group_size=layers[0].group_size, bits=layers[0].bits, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
        head_dim=head_dim, rope_dims=attn.rope.dims, traditional=attn.rope.traditional, base=rope["base"],
        rope_scale=rope["scale"], attn_scale=attn.scale, eps1=norms[0].eps, eps2=norms[1].eps,
        qkv_bias=with_bias[0], qk_norm=attention == "qwen3", qk_eps=qk_eps,
    )
    return config, head_dim, extras


def kv_dtype() -> mx.Dtype:
    """The one-op layers' KV-cache dtype: float16 (as llama.cpp's default: half the memory and half of what decode
    reads at depth; attention still computes in float32), or float32 with ``MLXINFER_KV_DTYPE=float32``."""
    name = os.environ.get(KV_DTYPE_ENV, "float16").strip().lower() or "float16"
    if name not in ("float16", "float32"):
        raise InvalidParameter(f"{KV_DTYPE_ENV}={name!r} is not a KV-cache dtype",
                               hint=f"set {KV_DTYPE_ENV} to float16 (the default) or float32")
    return mx.float16 if name == "float16" else mx.float32


def _owned_buffers(provider, cache, head_shape: tuple, L: int):
    """(k_buf, v_buf) that ``decoder_block`` may write at ``cache.offset`` (see the module doc), installed in the
    cache: its own buffers when they qualify, else fresh copies with room for L more positions."""
    keys, values, offset = cache.keys, cache.values, cache.offset
    tag = cache.__dict__.get(_TAG)
    if (tag is not None and keys is not None and offset >= tag[4] and offset + L <= keys.shape[2]
            and provider.array_id(keys) == tag[2] and provider.array_id(values) == tag[3]):
        return keys, values
    B, H, D = head_shape
    capacity = (offset + L + cache.step - 1) // cache.step * cache.step
    keep, dtype = keys is not None and offset > 0, kv_dtype()
    try:
        k = provider.kv_reserve((B, H, capacity, D), keys if keep else None, valid=offset if keep else 0, dtype=dtype)
        v = provider.kv_reserve((B, H, capacity, D), values if keep else None, valid=offset if keep else 0,
                                dtype=dtype)
    except (ValueError, TypeError):  # e.g. a cache another model filled (other shapes or dtype)
        return None
    cache.keys, cache.values = k, v
    _tag(provider, cache, k, v)
    return k, v


def _tag(provider, cache, k, v) -> None:
    """Mark k/v (now cache.keys/values) as this module's, valid up to cache.offset. The tag holds its own
    handles so that the identities it compares against cannot be reused by other arrays."""
    cache.__dict__[_TAG] = [provider.array_handle(k), provider.array_handle(v), provider.array_id(k),
                            provider.array_id(v), cache.offset]
