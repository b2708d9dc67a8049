"""The one place that swaps mlx-lm's quantized linear layers, SwiGLU MLPs and attention call for kernel-backed ones.

``apply_kernels(model, mode)`` picks a provider for the current backend (Metal -> our .metal kernels, CUDA -> the
same bodies through ``mx.fast.cuda_kernel``, CPU -> ``mlxinfer.native.provider()``) and then:

* turns every plain ``nn.QuantizedLinear`` into ``KernelQuantizedLinear`` (a subclass: same parameters, same
  ``isinstance``), whose ``__call__`` asks the provider first and falls back to the built-in;
* turns MLPs whose ``__call__`` is exactly mlx-lm's ``down_proj(swiglu(gate_proj(x), up_proj(x)))`` into a subclass
  that asks the provider's optional ``swiglu`` for the fused gate/up step;
* replaces ``scaled_dot_product_attention`` in the model's mlx-lm module (models do
  ``from .base import scaled_dot_product_attention``) with a wrapper that asks the provider first;
* routes the tied LM head, ``nn.RMSNorm`` and ``nn.RoPE`` through the provider's optional methods, and turns
  attention modules whose ``__call__`` is exactly mlx-lm llama's into a subclass whose q/k/v projections, head
  split and RoPE are one optional ``qkv_rope`` op, the KV-cache update one ``kv_append`` and the attention writes
  o_proj's layout; llama-source decoder blocks then fold their RMSNorms and skip connections into those ops
  (the CPU pays several microseconds per MLX op in decode).

The attention swap is per mlx-lm *module* (e.g. all llama models in the process), not per model instance;
``apply_kernels(model, "builtin")`` undoes both swaps.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxinfer.engine.backend import backend
from mlxinfer.errors import InvalidParameter, MlxinferError
from mlxinfer.kernels import fused_block
from mlxinfer.kernels.fused_block import native_block
from mlxinfer.kernels.provider import KernelProvider

ENV_VAR = "MLXINFER_KERNELS"
MODES = ("auto", "custom", "builtin")
_SWIGLU_CALL = "self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"

# mlx-lm module name -> its original scaled_dot_product_attention, so "builtin" can restore it.
_ORIGINAL_SDPA: dict = {}


@dataclass(frozen=True)
class KernelReport:
    name: str  # "metal-custom" | "cuda-custom" | "cpu-native" | "builtin"
    detail: str  # one line for the chat header and bench provenance


def resolve_mode(mode: str = "auto") -> str:
    """The explicit mode, or for "auto" the ``MLXINFER_KERNELS`` environment variable when it is set."""
    if mode == "auto":
        mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        source = f"{ENV_VAR}={mode!r}"
    else:
        source = f"--kernels {mode!r}"
    if mode not in MODES:
        raise InvalidParameter(f"unknown kernel mode {source}", hint="use auto, custom or builtin")
    return mode


def select_provider(name: Optional[str] = None) -> Tuple[Optional[KernelProvider], str]:
    """(provider or None, one-line reason) for the given backend (default: the current one)."""
    name = name or backend()
    if name in ("metal", "cuda"):
        from mlxinfer.kernels import gpu  # lazily: builds kernels only when a GPU backend asks

        return gpu.provider(name), gpu.status(name)
    try:
        native = importlib.import_module("mlxinfer.native")
    except ImportError as exc:
        return None, f"native CPU kernels are not installed ({exc})"
    provider = native.provider()
    return provider, native.status()


def apply_kernels(model: nn.Module, mode: str = "auto") -> KernelReport:
    """Route ``model``'s quantized matmuls and attention through the backend's custom kernels (see module doc)."""
    mode = resolve_mode(mode)
    if mode == "builtin":
        restore_builtin(model)
        return KernelReport("builtin", "MLX built-in kernels (requested)")
    where = backend()
    provider, why = select_provider(where)
    if provider is None:
        if mode == "custom":
            raise MlxinferError(
                f"custom kernels are not available on the {where} backend: {why}",
                hint="use --kernels builtin or --kernels auto",
            )
        restore_builtin(model)
        return KernelReport("builtin", f"MLX built-in kernels ({why})")
    n_linear = _swap_linears(model, provider)
    n_mlp = _swap_mlps(model, provider)
    routed = _swap_small_ops(model, provider)
    routed["fused q/k/v+RoPE attention inputs"] = _swap_attention_inputs(model, provider)
    routed["blocks with fused skip connections"], routed["decoder layers as one op"] = _swap_blocks(model, provider)
    modules = _swap_attention(model, provider)
    extra = "".join(f", {n} {what}" for what, n in routed.items() if n)
    detail = (
        f"{provider.name} on {where}: {n_linear} quantized linear layers, {n_mlp} fused SwiGLU MLPs{extra}, "
        f"attention in {', '.join(modules) or 'no modules'}"
    )
    return KernelReport(provider.name, detail)


def restore_builtin(model: nn.Module) -> None:
    """Undo ``apply_kernels``: the model's layers and its modules' attention call are MLX's again."""
    for _, m in model.named_modules():
        if isinstance(m, KernelQuantizedLinear):
            m.__class__ = nn.QuantizedLinear
            m.__dict__.pop("_kernel_provider", None)
        elif getattr(type(m), "_fused_base", None) is not None:
            m.__class__ = type(m)._fused_base
            m.__dict__.pop("_kernel_provider", None)
            m.__dict__.pop(fused_block.CONFIG_ATTR, None)
        elif type(m) in _ROUTED_BASES:
            m.__class__ = _ROUTED_BASES[type(m)]
            m.__dict__.pop("_kernel_provider", None)
    for modname in _model_module_names(model):
        if modname in _ORIGINAL_SDPA:
            setattr(sys.modules[modname], "scaled_dot_product_attention", _ORIGINAL_SDPA.pop(modname))


class KernelQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose matmul asks the kernel provider first (made by swapping ``__class__``)."""

    _kernel_provider: KernelProvider

    def __call__(self, x):
        y = self._kernel_provider.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"),
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        )
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def add_to(self, x, residual):
        """``self(x) + residual`` as one op where the provider takes a residual (the skip connections)."""
        if "bias" not in self:
            try:
                y = self._kernel_provider.quantized_matmul(
                    x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                    bits=self.bits, mode=self.mode, residual=residual,
                )
            except TypeError:  # a provider without the residual argument
                y = None
            if y is not None:
                return y
        return self(x) + residual


def _linear_add(layer: nn.Module, x, residual):
    """``layer(x)``, plus ``residual`` when given (fused when the layer is a KernelQuantizedLinear)."""
    if residual is None:
        return layer(x)
    return layer.add_to(x, residual) if isinstance(layer, KernelQuantizedLinear) else layer(x) + residual


def _swap_linears(model: nn.Module, provider: KernelProvider) -> int:
    count = 0
    for _, m in model.named_modules():
        # Only the exact class: a subclass (e.g. a LoRA layer) may rely on its own __call__.
        if type(m) is nn.QuantizedLinear or type(m) is KernelQuantizedLinear:
            m.__class__ = KernelQuantizedLinear
            m._kernel_provider = provider
            count += 1
    return count


_FUSED_CLASSES: dict = {}  # (kind, mlx-lm class) -> its Fused subclass


def _fused_subclass(kind: str, base: type, make_call: Callable) -> type:
    """A subclass of an mlx-lm class whose ``__call__`` (``make_call(base)``) tries a provider's fused kernel."""
    if (kind, base) not in _FUSED_CLASSES:
        _FUSED_CLASSES[(kind, base)] = type(
            f"Fused{base.__name__}", (base,), {"__call__": make_call(base), "_fused_base": base}
        )
    return _FUSED_CLASSES[(kind, base)]


def _swap_fused(model: nn.Module, provider: KernelProvider, method: str, kind: str, is_plain: Callable,
                make_call: Callable) -> int:
    if getattr(provider, method, None) is None:
        return 0
    count = 0
    for _, m in model.named_modules():
        if is_plain(m):
            base = getattr(type(m), "_fused_base", None) or type(m)
            m.__class__ = _fused_subclass(kind, base, make_call)
            m._kernel_provider = provider
            count += 1
    return count


def _unfused_source(m: nn.Module) -> str:
    cls = getattr(type(m), "_fused_base", None) or type(m)
    try:
        return _code_lines(inspect.getsource(cls.__call__))
    except (OSError, TypeError):
        return ""


def _code_lines(source: str) -> str:
    """A method's source without blank and comment lines (mlx-lm's copies of llama's code differ in those)."""
    return "\n".join(line.rstrip() for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def _plain_quantized(layers: list) -> bool:
    """Bias-free affine QuantizedLinears sharing group size and bits (what the fused kernels take)."""
    return (
        all(isinstance(q, nn.QuantizedLinear) and "bias" not in q and q.mode == "affine" for q in layers)
        and len({(q.group_size, q.bits) for q in layers}) == 1
    )


def _norm_kwargs(norm) -> dict:
    """The provider arguments that fold an RMSNorm module into the next op (none without one)."""
    return {} if norm is None else {"norm_weight": norm["weight"], "norm_eps": norm.eps}


def _swiglu_call(base: type) -> Callable:
    # residual / norm: passed by the fused block (skip connection added by down_proj; x normalised in the op).
    def __call__(self, x, residual=None, norm=None):
        g, u = self.gate_proj, self.up_proj
        h = self._kernel_provider.swiglu(
            x, (g["weight"], g["scales"], g.get("biases")), (u["weight"], u["scales"], u.get("biases")),
            group_size=g.group_size, bits=g.bits, **_norm_kwargs(norm),
        )
        if h is None:
            y = base.__call__(self, x if norm is None else norm(x))
            return y if residual is None else y + residual
        return _linear_add(self.down_proj, h, residual)

    return __call__


def _is_plain_swiglu_mlp(m: nn.Module) -> bool:
    return _SWIGLU_CALL in _unfused_source(m) and _plain_quantized(
        [getattr(m, name, None) for name in ("gate_proj", "up_proj")]
    )


def _swap_mlps(model: nn.Module, provider: KernelProvider) -> int:
    return _swap_fused(model, provider, "swiglu", "swiglu", _is_plain_swiglu_mlp, _swiglu_call)


# Attention modules whose ``__call__`` is exactly mlx-lm llama's (q/k/v projections, head split, RoPE at
# cache.offset, cache update, attention, o_proj): on the CPU the input side is 11 small MLX ops per layer and
# token, so it becomes one ``provider.qkv_rope`` op; the cache update, attention and o_proj stay as they are.
@functools.lru_cache(maxsize=None)  # asked once per module of every model loaded
def _llama_attention_source() -> str:
    from mlx_lm.models import llama

    return _code_lines(inspect.getsource(llama.Attention.__call__))


@functools.lru_cache(maxsize=None)
def _qwen3_attention_source() -> str:
    from mlx_lm.models import qwen3

    return _code_lines(inspect.getsource(qwen3.Attention.__call__))


def _attention_call(base: type) -> Callable:
    def __call__(self, x, mask=None, cache=None, residual=None, norm=None):
        offset = 0 if cache is None else cache.offset
        q, k, v, rope = self.q_proj, self.k_proj, self.v_proj, self.rope
        out = self._kernel_provider.qkv_rope(
            x, (q["weight"], q["scales"], q["biases"]), (k["weight"], k["scales"], k["biases"]),
            (v["weight"], v["scales"], v["biases"]), group_size=q.group_size, bits=q.bits, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, head_dim=q["weight"].shape[0] // self.n_heads, rope_dims=rope.dims,
            traditional=rope.traditional, offset=offset, **_rope_kwargs(rope), **_norm_kwargs(norm),
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


def _rope_kwargs(rope) -> dict:
    """base/scale (nn.RoPE) or the precomputed periods (mlx-lm's Llama3RoPE, as it passes them to mx.fast.rope)."""
    if isinstance(rope, nn.RoPE):
        return {"base": rope.base, "scale": rope.scale}
    return {"base": None, "scale": 1.0, "freqs": rope._freqs}


def _plain_rope(rope) -> bool:
    from mlx_lm.models.rope_utils import Llama3RoPE

    return type(rope) in (nn.RoPE, KernelRoPE) or (
        type(rope) is Llama3RoPE and isinstance(getattr(rope, "_freqs", None), mx.array)
    )


def _is_plain_attention(m: nn.Module) -> bool:
    return (
        _plain_rope(getattr(m, "rope", None))
        and all(hasattr(m, a) for a in ("n_heads", "n_kv_heads", "scale"))
        and _plain_quantized([getattr(m, name, None) for name in ("q_proj", "k_proj", "v_proj")])
        and _unfused_source(m) == _llama_attention_source()
    )


def _swap_attention_inputs(model: nn.Module, provider: KernelProvider) -> int:
    return _swap_fused(model, provider, "qkv_rope", "attention", _is_plain_attention, _attention_call)


# Decoder blocks whose ``__call__`` is exactly mlx-lm llama's (x + attn(norm(x)), then h + mlp(norm(h))) and whose
# attention and MLP are the fused ones above: the skip connections go into o_proj and down_proj as a residual
# input and the RMSNorms into qkv_rope and swiglu (four MLX ops per layer and token fewer).
@functools.lru_cache(maxsize=None)
def _llama_block_source() -> str:
    from mlx_lm.models import llama

    return _code_lines(inspect.getsource(llama.TransformerBlock.__call__))


def _block_call(base: type) -> Callable:
    def __call__(self, x, mask=None, cache=None):
        # The whole layer as one op when the provider has one (fused_block.py), else: the norms run inside the
        # next op, the skip connections inside o_proj / down_proj.
        if cache is not None:
            y = native_block(self, x, mask, cache)
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


def _swap_blocks(model: nn.Module, provider: KernelProvider) -> Tuple[int, int]:
    """Blocks with llama's block code: (swapped, of which run as one ``decoder_block`` op)."""
    swapped = native = 0
    for _, m in model.named_modules():
        if not (all(type(getattr(m, n, None)) in (nn.RMSNorm, KernelRMSNorm)
                    for n in ("input_layernorm", "post_attention_layernorm"))
                and _unfused_source(m) == _llama_block_source()):
            continue
        source = _unfused_source(getattr(m, "self_attn", None))
        attention = {_llama_attention_source(): "llama", _qwen3_attention_source(): "qwen3"}.get(source)
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


# Small per-token ops that are a large share of decode time on the CPU backend, where MLX dispatch per op is
# costly: the tied LM head (QuantizedEmbedding.as_linear), RMSNorm and RoPE. Each asks the provider's optional
# method and falls back to MLX when it is absent or returns None.
class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    _kernel_provider: KernelProvider

    def __call__(self, x):
        fn = getattr(self._kernel_provider, "quantized_embedding", None)
        y = None if fn is None else fn(
            x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits,
            mode=self.mode,
        )
        return super().__call__(x) if y is None else y

    def as_linear(self, x):
        y = self._kernel_provider.quantized_matmul(
            x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits,
            mode=self.mode,
        )
        return super().as_linear(x) if y is None else y


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


_ROUTED_BASES = {KernelQuantizedEmbedding: nn.QuantizedEmbedding, KernelRMSNorm: nn.RMSNorm, KernelRoPE: nn.RoPE}
# (subclass, provider method it needs, label for the report)
_SMALL_OPS = ((KernelQuantizedEmbedding, "quantized_matmul", "LM-head/embedding"),
              (KernelRMSNorm, "rms_norm", "RMSNorms"), (KernelRoPE, "rope", "RoPEs"))


def _swap_small_ops(model: nn.Module, provider: KernelProvider) -> dict:
    counts = {}
    for cls, method, label in _SMALL_OPS:
        base, counts[label] = _ROUTED_BASES[cls], 0
        if getattr(provider, method, None) is None:
            continue
        for _, m in model.named_modules():
            if type(m) is base or type(m) is cls:  # exact classes only: subclasses may have their own maths
                m.__class__ = cls
                m._kernel_provider = provider
                counts[label] += 1
    return counts


def _model_module_names(model: nn.Module) -> list:
    names = {type(m).__module__ for _, m in model.named_modules()}
    return sorted(n for n in names if hasattr(sys.modules.get(n), "scaled_dot_product_attention"))


def _make_sdpa(provider: KernelProvider, original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is None:
            if hasattr(cache, "bits"):  # QuantizedKVCache: keys/values are (packed, scales, biases) triples
                fn = getattr(provider, "quantized_sdpa", None)
                out = None if fn is None else fn(
                    queries, keys, values, scale=scale, mask=mask, group_size=cache.group_size, bits=cache.bits
                )
            else:
                out = provider.sdpa(queries, keys, values, scale=scale, mask=mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._kernel_provider = provider
    return scaled_dot_product_attention


def _swap_attention(model: nn.Module, provider: KernelProvider) -> list:
    swapped = []
    for modname in _model_module_names(model):
        module = sys.modules[modname]
        original = _ORIGINAL_SDPA.setdefault(modname, module.scaled_dot_product_attention)
        module.scaled_dot_product_attention = _make_sdpa(provider, original)
        swapped.append(modname.rsplit(".", 1)[-1])
    return swapped
