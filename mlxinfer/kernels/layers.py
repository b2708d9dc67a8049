"""Kernel-backed layer classes and the registry of fused subclasses: what ``fused_*`` build on and ``patch`` swaps in.

Every class here is a subclass of the MLX or mlx-lm class it replaces (same parameters, same ``isinstance``),
installed per module instance by swapping ``__class__``, and tries its provider first, falling back to the
original maths when the provider returns None. :func:`builtin_class` maps each back, so undoing is per instance
too. Nothing here changes a module-level name of MLX or mlx-lm: two models in one process, one with kernels and
one without, never see each other's choice.

Attention: mlx-lm's attention modules call ``scaled_dot_product_attention`` from their module's globals. For a
model with kernels, :func:`routed_attention_class` gives such a class a subclass whose ``__call__`` is the same
code object run with a copy of those globals in which that one name is the provider's attention
(:func:`sdpa_function`) — the module and every other model keep MLX's.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxinfer.kernels import tiling
from mlxinfer.kernels.kv_cache import NativeBatchKVCache
from mlxinfer.kernels.provider import Capabilities, KernelProvider

SDPA_NAME = "scaled_dot_product_attention"


_TILED = {"tiled": True}
_TILED_SYMMETRIC = {"tiled": True, "symmetric": True}
_PLAIN: dict = {}


def _tiles(m: nn.Module, lookup: bool = False) -> dict:
    """The provider keywords for ``m``'s weights: ``tiled=True`` when ``m`` is a tiled head (``kernels.tiling``),
    and for its matmul ``symmetric=True`` when its biases are -2^(bits-1) * scales (``tiling.symmetric``).
    The linears of a tiled one-op block are read only by its op: called on their own, they put it back first."""
    owner = m.__dict__.get("_tiled_by")
    if owner is None:
        return _PLAIN
    if owner is not m:
        tiling.untile_block(owner)
        return _PLAIN
    return _TILED_SYMMETRIC if not lookup and tiling.is_symmetric(m) else _TILED


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul asks the kernel provider first (made by swapping ``__class__``)."""

    _kernel_provider: KernelProvider

    def __call__(self, x):
        tiles = _tiles(self)  # first: it may put the weights back in MLX's layout
        y = self._kernel_provider.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits, mode=self.mode, **tiles,
        )
        if y is None:
            tiling.untile_block(self)  # MLX's own matmul reads MLX's layout
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def add_to(self, x, residual):
        """``self(x) + residual`` as one op (the skip connections). Only fused blocks call it, and only with a
        provider that has the ``FusedAttention`` capability (``residual=``)."""
        if "bias" not in self:
            tiles = _tiles(self)
            y = self._kernel_provider.quantized_matmul(
                x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                bits=self.bits, mode=self.mode, residual=residual, **tiles,
            )
            if y is not None:
                return y
        return self(x) + residual


# Small per-token ops that are a large share of decode time on the CPU backend, where MLX dispatch per op is
# costly: the tied LM head (QuantizedEmbedding.as_linear), RMSNorm and RoPE.
class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    _kernel_provider: KernelProvider
    _kernel_lookup: bool = False  # the provider has EmbeddingKernel (else the lookup is MLX's, the head ours)

    def __call__(self, x):
        tiles = _tiles(self, lookup=True)
        y = self._kernel_provider.quantized_embedding(
            x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits,
            mode=self.mode, **tiles,
        ) if self._kernel_lookup else None
        if y is None:
            tiling.untile_block(self)
            return super().__call__(x)
        return y

    def as_linear(self, x):
        tiles = _tiles(self)
        y = self._kernel_provider.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits,
            mode=self.mode, **tiles,
        )
        if y is None:
            tiling.untile_block(self)
            return super().as_linear(x)
        return y


class KernelRMSNorm(nn.RMSNorm):
    _kernel_provider: KernelProvider

    def __call__(self, x):
        y = self._kernel_provider.rms_norm(x, self["weight"], self.eps)
        return super().__call__(x) if y is None else y


class KernelRoPE(nn.RoPE):
    _kernel_provider: KernelProvider

    def __call__(self, x, offset: int = 0):
        y = self._kernel_provider.rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset
        )
        return super().__call__(x, offset) if y is None else y


class KernelQuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's ``QuantizedSwitchLinear`` (a mixture of experts' gate/up/down: one quantized weight per expert,
    ``mx.gather_qmm`` picks each token's) through the provider's ``gather_qmm``; MLX's CPU gather_qmm reads
    ~0.5 GB/s. ``sorted_indices`` only says how the rows are ordered: the result is the same."""

    _kernel_provider: KernelProvider

    def __call__(self, x, indices, sorted_indices=False):
        y = None
        if self.global_scale is None:
            y = self._kernel_provider.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), indices,
                                                 group_size=self.group_size, bits=self.bits, mode=self.mode)
        if y is None:
            return super().__call__(x, indices, sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


_BUILTIN = {KernelQuantizedLinear: nn.QuantizedLinear, KernelQuantizedEmbedding: nn.QuantizedEmbedding,
            KernelRMSNorm: nn.RMSNorm, KernelRoPE: nn.RoPE, KernelQuantizedSwitchLinear: QuantizedSwitchLinear}
# (kernel class, the capability it needs or None for the required contract, label for the report)
SMALL_OPS = ((KernelQuantizedEmbedding, None, "LM-head/embedding"), (KernelRMSNorm, "rms_norm", "RMSNorms"),
             (KernelRoPE, "rope", "RoPEs"), (KernelQuantizedSwitchLinear, "experts", "MoE expert projections"))
INSTANCE_STATE = ("_kernel_provider", "_kernel_lookup", "_native_plan")  # what undoing a swap removes


def builtin_class(cls: type) -> type:
    """The MLX / mlx-lm class a kernel class was made from (the class itself when it is none of ours)."""
    return _BUILTIN.get(cls) or getattr(cls, "_fused_base", None) or getattr(cls, "_routed_base", None) or cls


def is_kernel_class(cls: type) -> bool:
    return builtin_class(cls) is not cls


def bind(m: nn.Module, cls: type, provider: KernelProvider) -> None:
    m.__class__ = cls
    m._kernel_provider = provider


def unbind(m: nn.Module) -> None:
    """``m`` back to its built-in class, with the per-instance kernel state gone (its weights in MLX's layout)."""
    tiling.untile_block(m)
    m.__class__ = builtin_class(type(m))
    for name in INSTANCE_STATE:
        m.__dict__.pop(name, None)


# ---- fused subclasses (made by fused_llama) ----

_FUSED: dict = {}  # (kind, mlx-lm class) -> its Fused subclass


def fused_subclass(kind: str, base: type, make_call: Callable[[type], Callable]) -> type:
    """A subclass of an mlx-lm class whose ``__call__`` (``make_call(base)``) tries a provider's fused kernel."""
    if (kind, base) not in _FUSED:
        _FUSED[(kind, base)] = type(f"Fused{base.__name__}", (base,),
                                    {"__call__": make_call(base), "_fused_base": base, "_fused_kind": kind})
    return _FUSED[(kind, base)]


def fused_kind(m: Any) -> Optional[str]:
    """"attention", "swiglu" or "block" for a module running a fused subclass, else None."""
    return getattr(type(m), "_fused_kind", None)


# ---- attention routed per instance ----

_PROVIDERS: dict = {}  # id(provider) -> (provider, its Capabilities, its mlx-lm-style attention function)
_ROUTED: dict = {}  # (mlx-lm attention class, id(provider)) -> (subclass, routed __call__)


def register(provider: KernelProvider, caps: Capabilities) -> None:
    """Record ``provider``'s capabilities (checked once by ``kernels.patch``) for the classes made for it. The
    entry holds the provider, so its id is not reused while the classes made for it exist."""
    from mlx_lm.models import base as mlx_lm_base

    if _PROVIDERS.get(id(provider), (None, None))[1] != caps:
        _PROVIDERS[id(provider)] = (provider, caps,
                                    sdpa_function(provider, caps, mlx_lm_base.scaled_dot_product_attention))
        for key in [k for k in _ROUTED if k[1] == id(provider)]:
            del _ROUTED[key]


def caps_of(provider: KernelProvider) -> Capabilities:
    """The capabilities a registered ``provider`` was found to have."""
    return _PROVIDERS[id(provider)][1]


def provider_sdpa(provider: KernelProvider) -> Callable:
    """mlx-lm's ``scaled_dot_product_attention`` through a registered ``provider``."""
    return _PROVIDERS[id(provider)][2]


def routes_attention(cls: type) -> bool:
    """``cls.__call__`` calls mlx-lm's ``scaled_dot_product_attention`` by its module-global name."""
    from mlx_lm.models import base as mlx_lm_base

    fn = getattr(cls, "__call__", None)
    code = getattr(fn, "__code__", None)
    return (code is not None and SDPA_NAME in code.co_names
            and getattr(fn, "__globals__", {}).get(SDPA_NAME) is mlx_lm_base.scaled_dot_product_attention)


def routed_call(base: type, provider: KernelProvider) -> Callable:
    """``base.__call__`` with its attention through a registered ``provider`` (the same code, its own globals)."""
    return _routed(base, provider)[1]


def routed_attention_class(base: type, provider: KernelProvider) -> type:
    """The subclass of mlx-lm attention class ``base`` whose instances run their attention through ``provider``."""
    return _routed(base, provider)[0]


def _routed(base: type, provider: KernelProvider) -> tuple:
    key = (base, id(provider))
    if key not in _ROUTED:
        fn = base.__call__
        scope = dict(fn.__globals__)  # a snapshot: the module's own globals stay as they are
        scope[SDPA_NAME] = provider_sdpa(provider)
        call = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        call.__kwdefaults__, call.__qualname__ = fn.__kwdefaults__, fn.__qualname__
        cls = type(f"Kernel{base.__name__}", (base,), {"__call__": call, "_routed_base": base})
        _ROUTED[key] = (cls, call)
    return _ROUTED[key]


def sdpa_function(provider: KernelProvider, caps: Capabilities, original: Callable) -> Callable:
    """mlx-lm's ``scaled_dot_product_attention`` asking ``provider`` first."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is None:
            if hasattr(cache, "bits"):  # QuantizedKVCache: keys/values are (packed, scales, biases) triples
                out = provider.quantized_sdpa(
                    queries, keys, values, scale=scale, mask=mask, group_size=cache.group_size, bits=cache.bits
                ) if caps.quantized_sdpa else None
            elif isinstance(cache, NativeBatchKVCache) and caps.batched and (start := cache.attention_start(
                    mask, queries.shape[2], keys.shape[2])) is not None:  # a left-padded batch: causal + start
                out = provider.sdpa(queries, keys, values, scale=scale, mask="causal", start=start)
            else:
                out = provider.sdpa(queries, keys, values, scale=scale, mask=mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention


def attention_modules(model: nn.Module) -> list:
    """The mlx-lm modules whose attention runs through the provider in ``model`` (for the report)."""
    names = {builtin_class(type(m)).__module__ for _, m in model.named_modules()
             if getattr(type(m), "_routed_base", None) is not None or fused_kind(m) == "attention"}
    return sorted(names)


# ---- what the fused paths take ----

def plain_quantized(layers: list) -> bool:
    """Bias-free affine QuantizedLinears sharing group size and bits (what the fused kernels take)."""
    return (
        all(isinstance(q, nn.QuantizedLinear) and "bias" not in q and q.mode == "affine" for q in layers)
        and len({(q.group_size, q.bits) for q in layers}) == 1
    )


def norm_kwargs(norm) -> dict:
    """The provider arguments that fold an RMSNorm module into the next op (none without one)."""
    return {} if norm is None else {"norm_weight": norm["weight"], "norm_eps": norm.eps}


def linear_add(layer: nn.Module, x, residual):
    """``layer(x)``, plus ``residual`` when given (fused when the layer is a KernelQuantizedLinear)."""
    if residual is None:
        return layer(x)
    return layer.add_to(x, residual) if isinstance(layer, KernelQuantizedLinear) else layer(x) + residual


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
