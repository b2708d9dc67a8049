"""Fusion for decoder layers written as mlx-lm's llama code (llama, Mistral, SmolLM, Qwen2; Qwen3's attention).

``patch.apply_kernels`` calls the two swaps here after the per-layer ones:

* attention modules whose ``__call__`` is llama's become a subclass whose q/k/v projections, head split and
  RoPE are one ``provider.qkv_rope`` op, the KV-cache update one ``kv_append`` and whose attention writes
  o_proj's layout (``residual=``/``norm=`` let the block fold its skip connection and RMSNorm in);
* decoder blocks whose ``__call__`` is llama's become a subclass that runs the whole layer as one
  ``decoder_block`` op when the provider has it (``fused_block``), else the fused attention and MLP with the
  skip connections as o_proj/down_proj residuals and the RMSNorms folded into the next op, else the original code.

Which mlx-lm classes these paths take is decided by class identity in ``kernels.eligibility``'s table (never by
source text), and ``kernels.selfcheck`` runs each fused configuration once against the module's own code.
"""

from __future__ import annotations

import sys
from typing import Callable, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.kernels import fused_block
from mlxinfer.kernels.patch import (
    _FUSED_CLASSES, KernelRMSNorm, KernelRoPE, _fused_subclass, _linear_add, _norm_kwargs, _plain_quantized,
    _swap_fused,
)
from mlxinfer.kernels.eligibility import ATTENTION_LLAMA, ATTENTION_QWEN3, BLOCK_PRENORM, has_role, role_of
from mlxinfer.kernels.provider import KernelProvider


# Attention modules with llama's attention code (eligibility.ATTENTION_LLAMA): on the CPU the input side is 11
# small MLX ops per layer and token, so it becomes one ``provider.qkv_rope`` op; the cache update, attention and
# o_proj stay as they are.
def _attention_call(base: type) -> Callable:
    def __call__(self, x, mask=None, cache=None, residual=None, norm=None):
        offset = 0 if cache is None else cache.offset
        q, k, v, rope = self.q_proj, self.k_proj, self.v_proj, self.rope
        out = self._kernel_provider.qkv_rope(
            x, (q["weight"], q["scales"], q["biases"]), (k["weight"], k["scales"], k["biases"]),
            (v["weight"], v["scales"], v["biases"]), group_size=q.group_size, bits=q.bits, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, head_dim=q["weight"].shape[0] // self.n_heads, rope_dims=rope.dims,
            traditional=rope.traditional, offset=offset, **rope_kwargs(rope), **_norm_kwargs(norm),
        )
        if out is None:
            y = base.__call__(self, x if norm is None else norm(x), mask, cache)
            return y if residual is None else y + residual
        queries, keys, values = out  # (B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim) x 2, RoPE'd
        B, L, _ = x.shape
        kv_len = -1
        if cache is not None:
            appended = _append_kv(self._kernel_provider, cache, keys, values)
            if appended is None:
                keys, values = cache.update_and_fetch(keys, values)
            else:
                keys, values, kv_len = appended  # whole buffers; the first kv_len positions are valid
        # Attention straight into (B, L, n_heads, head_dim) saves the transpose copy before o_proj.
        output = self._kernel_provider.sdpa(queries, keys, values, scale=self.scale, mask=mask, heads_last=True,
                                            kv_len=kv_len)
        if output is None:
            if kv_len >= 0:
                keys, values = keys[..., :kv_len, :], values[..., :kv_len, :]
            # The module's (possibly swapped) attention function, looked up as the original code does.
            sdpa = sys.modules[base.__module__].scaled_dot_product_attention
            output = sdpa(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
            output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return _linear_add(self.o_proj, output, residual)  # (B, L, n_heads * head_dim) -> (B, L, hidden)

    return __call__


def _append_kv(provider: KernelProvider, cache, keys, values):
    """mlx-lm's ``KVCache.update_and_fetch`` as one provider op (4 MLX ops otherwise) when the cache is a plain
    ``KVCache`` whose buffers have room: (k_buf, v_buf, valid length), or None to let the cache do it."""
    from mlx_lm.models.cache import KVCache

    fn = getattr(provider, "kv_append", None)
    if fn is None or type(cache) is not KVCache or cache.keys is None:
        return None
    prev, n = cache.offset, keys.shape[2]
    if not isinstance(prev, int) or prev + n > cache.keys.shape[2]:
        return None  # mlx-lm grows the buffers
    out = fn(cache.keys, cache.values, keys, values, prev)
    if out is None:
        return None
    cache.keys, cache.values = out
    cache.offset = prev + n
    return out[0], out[1], cache.offset


def rope_kwargs(rope) -> dict:
    """base/scale (nn.RoPE) or the precomputed periods (mlx-lm's Llama3RoPE, as it passes them to mx.fast.rope)."""
    if isinstance(rope, nn.RoPE):
        return {"base": rope.base, "scale": rope.scale}
    return {"base": None, "scale": 1.0, "freqs": rope._freqs}


def plain_rope(rope) -> bool:
    from mlx_lm.models.rope_utils import Llama3RoPE

    return type(rope) in (nn.RoPE, KernelRoPE) or (
        type(rope) is Llama3RoPE and isinstance(getattr(rope, "_freqs", None), mx.array)
    )


def is_plain_attention(m: nn.Module) -> bool:
    return (
        plain_rope(getattr(m, "rope", None))
        and all(hasattr(m, a) for a in ("n_heads", "n_kv_heads", "scale"))
        and _plain_quantized([getattr(m, name, None) for name in ("q_proj", "k_proj", "v_proj")])
        and has_role(m, ATTENTION_LLAMA)
    )


def swap_attention_inputs(model: nn.Module, provider: KernelProvider) -> int:
    return _swap_fused(model, provider, "qkv_rope", "attention", is_plain_attention, _attention_call)


# Decoder blocks with llama's pre-norm block code (eligibility.BLOCK_PRENORM) whose attention and MLP are the
# fused ones above: the skip connections go into o_proj and down_proj as a residual input and the RMSNorms into
# qkv_rope and swiglu (four MLX ops per layer and token fewer).
def _block_call(base: type) -> Callable:
    def __call__(self, x, mask=None, cache=None):
        # The whole layer as one op when the provider has one (fused_block.py), else: the norms run inside the
        # next op, the skip connections inside o_proj / down_proj.
        if cache is not None:
            y = fused_block.native_block(self, x, mask, cache)
            if y is not None:
                return y
        if not _fused_parts(self):  # a block only the whole-layer op covers (e.g. Qwen3's q/k norms)
            return base.__call__(self, x, mask, cache)
        h = self.self_attn(x, mask, cache, residual=x, norm=self.input_layernorm)
        return self.mlp(h, residual=h, norm=self.post_attention_layernorm)

    return __call__


def _fused_parts(m: nn.Module) -> bool:
    """The block's attention and MLP are the fused ones above (they take residual= and norm=)."""
    fused = lambda sub, kind: type(sub) is _FUSED_CLASSES.get((kind, getattr(type(sub), "_fused_base", None)))  # noqa: E731
    return fused(getattr(m, "self_attn", None), "attention") and fused(getattr(m, "mlp", None), "swiglu")


def swap_blocks(model: nn.Module, provider: KernelProvider) -> Tuple[int, int]:
    """Pre-norm blocks (eligibility table): (swapped, of which run as one ``decoder_block`` op)."""
    swapped = native = 0
    for _, m in model.named_modules():
        if not (all(type(getattr(m, n, None)) in (nn.RMSNorm, KernelRMSNorm)
                    for n in ("input_layernorm", "post_attention_layernorm"))
                and has_role(m, BLOCK_PRENORM)):
            continue
        attention = {ATTENTION_LLAMA: "llama", ATTENTION_QWEN3: "qwen3"}.get(
            role_of(type(getattr(m, "self_attn", None))))
        m._kernel_provider = provider
        one_op = attention is not None and getattr(provider, "decoder_block", None) is not None and \
            fused_block.prepare(m, attention)
        if one_op or _fused_parts(m):
            base = getattr(type(m), "_fused_base", None) or type(m)
            m.__class__ = _fused_subclass("block", base, _block_call)
            swapped, native = swapped + 1, native + bool(one_op)
        else:
            m.__dict__.pop("_kernel_provider", None)
    return swapped, native
