"""Fusion for decoder layers written as mlx-lm's llama code (llama, Mistral, SmolLM, Qwen2; Qwen3's attention).

``patch.apply_kernels`` calls the swaps here after the per-layer ones:

* SwiGLU MLPs (eligibility.MLP_SWIGLU) become a subclass asking the provider's ``swiglu`` for the gate/up step;
* attention modules with llama's attention code become a subclass whose q/k/v projections, head split and
  RoPE are one ``provider.qkv_rope`` op, the KV-cache update one ``kv_append`` and whose attention writes
  o_proj's layout (``residual=``/``norm=`` let the block fold its skip connection and RMSNorm in);
* decoder blocks of ``kernels.spec``'s table (llama, qwen2, qwen3, gemma3_text, phi3, ...) become a subclass that
  runs the whole layer as one ``decoder_layer`` op when the provider has it (``fused_block``), else (llama's
  block code) the fused attention and MLP with the skip connections as o_proj/down_proj residuals and the
  RMSNorms folded into the next op, else the original code.

Which mlx-lm classes these paths take is decided by class identity in ``kernels.eligibility``'s and
``kernels.spec``'s tables (never by source text), and ``kernels.selfcheck`` runs each fused configuration once against the module's own code.
"""

from __future__ import annotations

from typing import Callable

import mlx.nn as nn

from mlxinfer.kernels import fused_block, spec
from mlxinfer.kernels.eligibility import (
    ATTENTION_LLAMA, BLOCK_PRENORM, MLP_SWIGLU, has_role,
)
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlxinfer.kernels.kv_cache import NativeBatchKVCache
from mlxinfer.kernels.layers import (
    KernelRMSNorm, bind, builtin_class, caps_of, fused_kind, fused_subclass, linear_add, norm_kwargs, plain_quantized,
    plain_rope, provider_sdpa, rope_kwargs, routed_call,
)
from mlxinfer.kernels.provider import Capabilities, KernelProvider


def _swap(model: nn.Module, provider: KernelProvider, kind: str, is_plain: Callable, make_call: Callable) -> int:
    count = 0
    for _, m in model.named_modules():
        if is_plain(m):
            bind(m, fused_subclass(kind, builtin_class(type(m)), make_call), provider)
            count += 1
    return count


# ---- SwiGLU MLPs ----

def _swiglu_call(base: type) -> Callable:
    # residual / norm: passed by the fused block (skip connection added by down_proj; x normalised in the op).
    def __call__(self, x, residual=None, norm=None):
        g, u = self.gate_proj, self.up_proj
        h = self._kernel_provider.swiglu(
            x, (g["weight"], g["scales"], g.get("biases")), (u["weight"], u["scales"], u.get("biases")),
            group_size=g.group_size, bits=g.bits, **norm_kwargs(norm),
        )
        if h is None:
            y = base.__call__(self, x if norm is None else norm(x))
            return y if residual is None else y + residual
        return linear_add(self.down_proj, h, residual)

    return __call__


def _is_plain_swiglu_mlp(m: nn.Module) -> bool:
    return has_role(m, MLP_SWIGLU) and plain_quantized([getattr(m, name, None) for name in ("gate_proj", "up_proj")])


def swap_mlps(model: nn.Module, provider: KernelProvider, caps: Capabilities) -> int:
    return _swap(model, provider, "swiglu", _is_plain_swiglu_mlp, _swiglu_call) if caps.swiglu else 0


# ---- attention (eligibility.ATTENTION_LLAMA): on the CPU the input side is 11 small MLX ops per layer and
# token, so it becomes one ``provider.qkv_rope`` op ----

def _attention_call(base: type) -> Callable:
    def __call__(self, x, mask=None, cache=None, residual=None, norm=None):
        provider = self._kernel_provider
        offset = 0 if cache is None else cache.offset
        q, k, v, rope = self.q_proj, self.k_proj, self.v_proj, self.rope
        out = provider.qkv_rope(
            x, (q["weight"], q["scales"], q["biases"]), (k["weight"], k["scales"], k["biases"]),
            (v["weight"], v["scales"], v["biases"]), group_size=q.group_size, bits=q.bits, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, head_dim=q["weight"].shape[0] // self.n_heads, rope_dims=rope.dims,
            traditional=rope.traditional, offset=offset, **rope_kwargs(rope), **norm_kwargs(norm),
        )
        if out is None:  # the module's own code, its attention still through the provider
            y = routed_call(base, provider)(self, x if norm is None else norm(x), mask, cache)
            return y if residual is None else y + residual
        queries, keys, values = out  # (B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim) x 2, RoPE'd
        B, L, _ = x.shape
        kv_len = -1
        if cache is not None:
            appended = _append_kv(provider, cache, keys, values)
            if appended is None:
                keys, values = cache.update_and_fetch(keys, values)
            else:
                keys, values, kv_len = appended  # whole buffers; the first kv_len positions are valid
        # Attention straight into (B, L, n_heads, head_dim) saves the transpose copy before o_proj. A left-padded
        # batch's array mask is causal + each row's first key (start).
        start = cache.attention_start(mask, L, kv_len) if isinstance(cache, NativeBatchKVCache) else None
        if start is None:
            output = provider.sdpa(queries, keys, values, scale=self.scale, mask=mask, heads_last=True,
                                   kv_len=kv_len)
        else:
            output = provider.sdpa(queries, keys, values, scale=self.scale, mask="causal", heads_last=True,
                                   kv_len=kv_len, start=start)
        if output is None:
            if kv_len >= 0:
                keys, values = keys[..., :kv_len, :], values[..., :kv_len, :]
            output = provider_sdpa(provider)(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
            output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return linear_add(self.o_proj, output, residual)  # (B, L, n_heads * head_dim) -> (B, L, hidden)

    return __call__


def _append_kv(provider: KernelProvider, cache, keys, values):
    """mlx-lm's ``KVCache.update_and_fetch`` as one provider op (4 MLX ops otherwise) when the cache is an mlx-lm
    ``KVCache`` whose buffers have room, or a NativeBatchKVCache: (k_buf, v_buf, valid length), or None to let
    the cache do it."""
    if isinstance(cache, NativeBatchKVCache):
        return cache.append(keys, values)
    if (not caps_of(provider).kv_append or not isinstance(cache, KVCache) or cache.keys is None
            or type(cache).update_and_fetch is not KVCache.update_and_fetch):  # a subclass with its own update
        return None
    prev, n = cache.offset, keys.shape[2]
    if not isinstance(prev, int) or prev + n > cache.keys.shape[2]:
        return None  # mlx-lm grows the buffers
    out = provider.kv_append(cache.keys, cache.values, keys, values, prev)
    if out is None:
        return None
    cache.keys, cache.values = out
    cache.offset = prev + n
    return out[0], out[1], cache.offset


def is_plain_attention(m: nn.Module) -> bool:
    return (
        plain_rope(getattr(m, "rope", None))
        and all(hasattr(m, a) for a in ("n_heads", "n_kv_heads", "scale"))
        and plain_quantized([getattr(m, name, None) for name in ("q_proj", "k_proj", "v_proj")])
        and has_role(m, ATTENTION_LLAMA)
    )


def swap_attention_inputs(model: nn.Module, provider: KernelProvider, caps: Capabilities) -> int:
    if not caps.fused_attention:
        return 0
    return _swap(model, provider, "attention", is_plain_attention, _attention_call)


# ---- decoder blocks with llama's pre-norm block code (eligibility.BLOCK_PRENORM) whose attention and MLP are
# the fused ones above: the skip connections go into o_proj and down_proj as a residual input and the RMSNorms
# into qkv_rope and swiglu (four MLX ops per layer and token fewer) ----

def _block_call(base: type) -> Callable:
    def __call__(self, x, mask=None, cache=None):
        # The whole layer as one op when the block was prepared for it (fused_block.py; a left-padded batch too),
        # else: the norms run inside the next op, the skip connections inside o_proj / down_proj; a batch's
        # cache updated natively.
        if cache is not None:
            y = fused_block.native_block(self, x, mask, cache)
            if y is not None:
                return y
            batch = _batch_cache(self, cache)
            if batch is not None:
                cache = batch
        fused_block.leave_one_op(self)  # what runs below reads the weights with other ops
        if not fused_parts(self):  # a block only the whole-layer op covers (e.g. Qwen3's q/k norms)
            return base.__call__(self, x, mask, cache)
        h = self.self_attn(x, mask, cache, residual=x, norm=self.input_layernorm)
        return self.mlp(h, residual=h, norm=self.post_attention_layernorm)

    return __call__


def _scaled_block_call(base: type) -> Callable:
    # ministral3: the model passes each layer a factor per query position (attn_scale); called without one (the
    # self-check, a caller of its own), the attention's own function computes it, as the module's code would.
    def __call__(self, x, attn_scale=None, mask=None, cache=None):
        if cache is not None:
            scale = attn_scale if attn_scale is not None else spec.query_scale(self, x.shape[1], cache.offset)
            y = fused_block.native_block(self, x, mask, cache, q_scale=scale)
            if y is not None:
                return y
        fused_block.leave_one_op(self)
        return base.__call__(self, x, attn_scale, mask, cache)

    return __call__


def _batch_cache(block: nn.Module, cache):
    """A plain mlx-lm ``BatchKVCache`` (or one already adopted) as a NativeBatchKVCache when the provider does
    batched positions (per-row RoPE offsets, attention with a per-row start); None otherwise. Not for
    sliding-window layers: their mask is not the plain causal + left-padding one."""
    if (not isinstance(cache, BatchKVCache) or block.__dict__.get("use_sliding") or fused_block.window_of(block)
            or getattr(block.get("self_attn"), "is_sliding", False)):  # gemma3's local layers
        return None
    provider = block.__dict__.get("_kernel_provider")
    if provider is None or not caps_of(provider).batched:
        return None
    return NativeBatchKVCache.adopt(cache, provider)


def fused_parts(m: nn.Module) -> bool:
    """The block's attention and MLP are the fused ones above (they take residual= and norm=)."""
    return fused_kind(getattr(m, "self_attn", None)) == "attention" and fused_kind(getattr(m, "mlp", None)) == "swiglu"


def _windows(model: nn.Module) -> dict:
    """id(block) -> the sliding window of the model part holding it (gemma3_text keeps ``window_size`` on its
    inner model, next to ``layers``), for the blocks of such parts."""
    out = {}
    for _, m in model.named_modules():
        window, blocks = getattr(m, "window_size", None), getattr(m, "layers", None)
        if isinstance(window, int) and isinstance(blocks, list):
            out.update({id(b): window for b in blocks})
    return out


def swap_blocks(model: nn.Module, provider: KernelProvider, caps: Capabilities) -> tuple:
    """Decoder blocks of the spec table (``kernels.spec``) or with llama's pre-norm block code: (swapped, of which
    run as one ``decoder_layer`` op, {reason: count} for the table's blocks that do not). Only with the
    FusedAttention capability: a llama block falls back to the fused attention and MLP per call, the others to
    their own code."""
    swapped = native = 0
    why_not: dict = {}
    if not caps.fused_attention:
        return swapped, native, why_not
    windows = _windows(model)
    for _, m in model.named_modules():
        in_table = spec.builder_of(type(m)) is not None
        prenorm = (all(type(getattr(m, n, None)) in (nn.RMSNorm, KernelRMSNorm)
                       for n in ("input_layernorm", "post_attention_layernorm"))
                   and has_role(m, BLOCK_PRENORM))
        if not (in_table or prenorm):
            continue
        m._kernel_provider = provider
        why = "the provider has no decoder_layer op"
        if in_table and caps.decoder_block:
            why = fused_block.prepare(m, provider, windows.get(id(m), 0))
        one_op = why == ""
        if one_op or (prenorm and fused_parts(m)):
            scaled = one_op and m._native_plan.spec.q_row_scale  # a block taking attn_scale (ministral3)
            bind(m, fused_subclass("block", builtin_class(type(m)), _scaled_block_call if scaled else _block_call),
                 provider)
            swapped, native = swapped + 1, native + bool(one_op)
        else:
            m.__dict__.pop("_kernel_provider", None)
            m.__dict__.pop("_native_plan", None)
        if in_table and not one_op:
            why_not[why] = why_not.get(why, 0) + 1
    return swapped, native, why_not
