"""The one place that swaps mlx-lm's quantized linear layers, SwiGLU MLPs and attention call for kernel-backed ones.

``apply_kernels(model, mode)`` picks a provider for the current backend (Metal -> our .metal kernels, CUDA -> the
same bodies through ``mx.fast.cuda_kernel``, CPU -> ``mlxinfer.native.provider()``) and then:

* turns every plain ``nn.QuantizedLinear`` into ``KernelQuantizedLinear`` (a subclass: same parameters, same
  ``isinstance``), whose ``__call__`` asks the provider first and falls back to the built-in;
* turns MLPs whose ``__call__`` is exactly mlx-lm's ``down_proj(swiglu(gate_proj(x), up_proj(x)))`` into a subclass
  that asks the provider's optional ``swiglu`` for the fused gate/up step;
* replaces ``scaled_dot_product_attention`` in the model's mlx-lm module (models do
  ``from .base import scaled_dot_product_attention``) with a wrapper that asks the provider first;
* routes the tied LM head, ``nn.RMSNorm`` and ``nn.RoPE`` through the provider's optional methods;
* hands attention modules and decoder blocks written as mlx-lm's llama code to ``fused_llama`` (q/k/v + RoPE as
  one op, skip connections and norms folded in) and ``fused_block`` (the whole layer as one op): the CPU pays
  several microseconds per MLX op in decode.

The attention swap is per mlx-lm *module* (e.g. all llama models in the process), not per model instance;
``apply_kernels(model, "builtin")`` undoes both swaps.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import mlx.nn as nn

from mlxinfer.engine.backend import backend
from mlxinfer.errors import InvalidParameter, MlxinferError
from mlxinfer.kernels import eligibility, fused_block
from mlxinfer.kernels.provider import KernelProvider

ENV_VAR = "MLXINFER_KERNELS"
MODES = ("auto", "custom", "builtin")

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
    _swap_linears(model, provider)
    _swap_mlps(model, provider)
    _swap_small_ops(model, provider)
    from mlxinfer.kernels import fused_llama, selfcheck  # they build on this module's classes

    fused_llama.swap_attention_inputs(model, provider)
    fused_llama.swap_blocks(model, provider)
    modules = _swap_attention(model, provider)
    findings = selfcheck.check_model(model)
    if findings and mode == "custom":
        restore_builtin(model)
        raise MlxinferError(findings[0].line(), hint="use --kernels auto (it falls back) or --kernels builtin")
    why_not = [f.line() for f in findings]
    validated = eligibility.mlx_lm_validated()
    if validated is not None:
        why_not.append(f"fused layers off: {validated}")
    detail = (f"{provider.name} on {where}: {describe(model)}, attention in {', '.join(modules) or 'no modules'}"
              + "".join(f"; {line}" for line in why_not))
    return KernelReport(provider.name, detail)


def describe(model: nn.Module) -> str:
    """What runs in ``model`` now, counted from its modules' classes (after the self-check turned off what failed)."""
    counts = {"quantized linear layers": 0, "fused SwiGLU MLPs": 0}
    labels = {KernelQuantizedLinear: "quantized linear layers", **{cls: label for cls, _, label in _SMALL_OPS}}
    kinds = {"swiglu": "fused SwiGLU MLPs", "attention": "fused q/k/v+RoPE attention inputs",
             "block": "blocks with fused skip connections"}
    for _, m in model.named_modules():
        cls = type(m)
        label = labels.get(cls)
        base = getattr(cls, "_fused_base", None)
        if base is not None:
            label = next((kinds[k] for (k, b), c in _FUSED_CLASSES.items() if c is cls), None)
            if m.__dict__.get(fused_block.CONFIG_ATTR):
                counts["decoder layers as one op"] = counts.get("decoder layers as one op", 0) + 1
        if label:
            counts[label] = counts.get(label, 0) + 1
    first = [f"{counts.pop(k)} {k}" for k in ("quantized linear layers", "fused SwiGLU MLPs")]
    return ", ".join(first + [f"{n} {what}" for what, n in counts.items() if n])


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
    return eligibility.has_role(m, eligibility.MLP_SWIGLU) and _plain_quantized(
        [getattr(m, name, None) for name in ("gate_proj", "up_proj")]
    )


def _swap_mlps(model: nn.Module, provider: KernelProvider) -> int:
    return _swap_fused(model, provider, "swiglu", "swiglu", _is_plain_swiglu_mlp, _swiglu_call)


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
