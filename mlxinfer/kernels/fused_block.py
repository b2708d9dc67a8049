"""A whole decoder layer as one provider op (``decoder_layer``), described by a ``kernels.spec.LayerSpec``, the KV
cache written in place.

Why: on MLX's CPU backend each graph op costs ~7 us of Python, graph building and dispatch, and a SmolLM2
decode step is small enough for that to matter (7 fused ops x 30 layers was ~20% of a step); Gemma 3 and Phi-3
had no fused path at all. ``fused_llama``'s blocks call :func:`native_block` first and fall back to their
per-op path (or the module's own code) when it returns None.

The op writes this step's keys and values into the cache's buffers in place; ``kernels.kv_cache.InPlaceKVCache``
owns those buffers and says when that is safe (its module doc has the rules). Sliding-window layers (Gemma's
local layers) get an ``InPlaceRotatingKVCache``: mlx-lm's RotatingKVCache semantics, O(window) positions held;
the op then writes at a buffer index apart from the position (RoPE) and attends from the oldest kept key, each
query to its last ``window`` keys (given a plain cache instead, it reads the window of one that keeps every
position: the same maths). This module is the op's only caller. The
block's fixed arguments are worked out once (:func:`prepare`) and kept on the block as a :class:`BlockPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from mlxinfer.kernels import spec as spec_lib
from mlxinfer.kernels import tiling
from mlxinfer.kernels.kv_cache import InPlaceKVCache, InPlaceRotatingKVCache, NativeBatchKVCache, kv_dtype
from mlxinfer.kernels.layers import caps_of


@dataclass(frozen=True)
class BlockPlan:
    spec: spec_lib.LayerSpec
    plan: Any          # the provider's plan (decoder_layer_plan)
    owners: tuple      # ((module, key), ...): where each named array lives (spec.owners)
    tiled_plan: Any = None  # the plan reading the linears in row tiles (kernels.tiling), while they are tiled
    symmetric: Optional[bool] = None  # tiling.symmetric of the linears, asked once (weights_symmetric)


def prepare(block, provider, window: int = 0) -> str:
    """Decide once whether ``block`` (its ``_kernel_provider`` set, the provider with the ``DecoderBlockKernel``
    capability) runs as one ``decoder_layer`` op: "" when it does, else one line saying why not. ``window``:
    the model's sliding window (for Gemma's local layers)."""
    kv_dtype()  # a bad MLXINFER_KV_DTYPE fails when the model loads, not in the middle of a reply
    spec = spec_lib.spec_of(block, window)
    block._native_plan = None
    if isinstance(spec, str):
        return spec
    try:
        owners = spec_lib.owners(block, spec)
    except (AttributeError, KeyError) as exc:
        return f"weight {exc} is missing"
    plan = provider.decoder_layer_plan(spec.names(), spec.config())
    if plan is None:
        return "the provider's decoder_layer does not take this layer"
    block._native_plan = BlockPlan(spec, plan, owners)
    return ""


def is_one_op(block) -> bool:
    """``block`` runs (or will try to run) as one ``decoder_layer`` op."""
    return block.__dict__.get("_native_plan") is not None


def window_of(block) -> int:
    """The sliding window of a prepared block (0: attends to everything)."""
    plan = block.__dict__.get("_native_plan")
    return plan.spec.sliding_window if plan is not None else 0


def tile_linears(block) -> list:
    """The quantized linears a prepared block's op reads (what :func:`tile` tiles); [] for an unprepared one."""
    plan = block.__dict__.get("_native_plan")
    return [] if plan is None else [o for o, k in plan.owners if k == "weight" and isinstance(o, nn.QuantizedLinear)]


def weights_symmetric(block) -> bool:
    """Whether a prepared block's linears are symmetric (``tiling.symmetric``: a tiled plan may skip their biases);
    compared on the arrays once per preparation and kept in its plan (the self-check and every re-tiling ask)."""
    plan = block.__dict__.get("_native_plan")
    if plan is None:
        return False
    if plan.symmetric is None:
        block._native_plan = plan = replace(plan, symmetric=tiling.symmetric(tile_linears(block)))
    return plan.symmetric


def tile(block) -> bool:
    """Put a prepared block's quantized linears in row tiles (``kernels.tiling``) and run it with a plan that reads
    them so; False (nothing changed) when a linear is not tileable or the provider refuses the plan."""
    plan = block.__dict__.get("_native_plan")
    if plan is None or tiling.is_tiled(block):
        return False
    linears = tile_linears(block)
    if not linears or not all(tiling.tileable(q) for q in linears):
        return False
    symmetric = weights_symmetric(block)  # a symmetric plan reads no biases
    plan = block._native_plan
    tiled_plan = plan.tiled_plan
    if tiled_plan is None:
        config = {**plan.spec.config(), "tiled": 1, **({"symmetric": 1} if symmetric else {})}
        tiled_plan = block._kernel_provider.decoder_layer_plan(plan.spec.names(), config)
        if tiled_plan is None:
            return False
        block._native_plan = plan = replace(plan, tiled_plan=tiled_plan)
    tiling.tile_block(block, linears, symmetric)
    return True


def leave_one_op(block) -> None:
    """Before a block's call runs anything but the one op (its per-op path, the module's own code): its weights
    back in MLX's layout if they were tiled, for good (the op reads them so too)."""
    tiling.untile_block(block)


def native_block(block, x: mx.array, mask, cache, q_scale: Optional[mx.array] = None) -> Optional[mx.array]:
    """``block(x, mask, cache)`` for a prepared block as one provider op, or None when this call is not one the op
    takes (then nothing has changed but, perhaps, the cache's buffers; the caller calls :func:`leave_one_op`
    before it runs the call otherwise). ``q_scale``: the factor per query row of a spec with ``q_row_scale``
    (Ministral 3's ``attn_scale``, (L, 1) or (B, 1, L, 1)), required there."""
    # __dict__ lookups: nn.Module attribute access is a Python __getattr__ for what is not in it (~0.2 us each).
    plan = block.__dict__.get("_native_plan")
    if plan is None or x.ndim != 3 or x.dtype != mx.float32:
        return None
    spec = plan.spec
    if spec.q_row_scale:
        if not isinstance(q_scale, mx.array) or q_scale.size not in (x.shape[1], x.shape[0] * x.shape[1]):
            return None
        q_scale = q_scale.reshape(-1).astype(mx.float32)
    else:
        q_scale = None
    if isinstance(cache, BatchKVCache):
        return _batch_block(block, plan, x, mask, cache, q_scale)
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        # A sliding layer's window mask is the one the op computes itself (gemma3_text makes it from the window).
        if not (spec.sliding_window and isinstance(mask, mx.array) and mask.dtype == mx.bool_):
            return None
    ring = InPlaceRotatingKVCache.adopt(cache, spec.sliding_window) if spec.sliding_window else None
    cache = ring if ring is not None else InPlaceKVCache.adopt(cache)
    if cache is None or not isinstance(cache.offset, int):
        return None
    provider = block._kernel_provider
    buffers = cache.writable(provider, (x.shape[0], spec.n_kv_heads, spec.head_dim), x.shape[1])
    if buffers is None:
        return None
    k_buf, v_buf, write, first = buffers
    out = provider.decoder_layer(x, [o[k] for o, k in plan.owners], k_buf, v_buf, offset=cache.offset,
                                 causal=mask is not None, plan=_plan_id(block, plan), write=write, first=first,
                                 q_scale=q_scale)
    if out is None:  # a model the op does not take: stop asking for this block
        block._native_plan = None
        return None
    y, k, v = out
    cache.written(provider, k, v, write, first, x.shape[1])
    return y


def _plan_id(block, plan: BlockPlan) -> Any:
    return plan.tiled_plan if "_tiled" in block.__dict__ else plan.plan


def _batch_block(block, plan: BlockPlan, x: mx.array, mask, cache, q_scale) -> Optional[mx.array]:
    """``native_block`` for a left-padded batch (serve's continuous batching, ``bench -b``): the same op with each
    row's first key (``left_padding``), every row written at the cache's shared index. The mask must be the cache's
    own (causal + left padding, and for a sliding layer its window, what ``make_mask`` gives: checked by shape;
    the op applies the window itself). A sliding layer's batch cache is a plain one here when the server gave
    the rows whole caches (``kv_cache.whole_caches``); mlx-lm's rotating batch cache is not taken."""
    spec = plan.spec
    provider = block._kernel_provider
    if not caps_of(provider).batched_block or (cache := NativeBatchKVCache.adopt(cache, provider)) is None:
        return None
    B, L = x.shape[0], x.shape[1]
    if not (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape == (B, 1, L, cache._idx + L)):
        return None
    buffers = cache.writable(provider, (B, spec.n_kv_heads, spec.head_dim), L)
    if buffers is None:
        return None
    k_buf, v_buf, write = buffers
    out = provider.decoder_layer(x, [o[k] for o, k in plan.owners], k_buf, v_buf, offset=write, causal=True,
                                 plan=_plan_id(block, plan), write=write, first=0, starts=cache.left_padding,
                                 q_scale=q_scale)
    if out is None:
        return None
    y, k, v = out
    cache.written(provider, k, v, L)
    return y
