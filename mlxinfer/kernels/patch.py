"""The one place that puts kernel-backed layers into an mlx-lm model (and takes them out again).

``apply_kernels(model, mode)`` picks a provider for the current backend (Metal -> our .metal kernels, CUDA -> the
same bodies through ``mx.fast.cuda_kernel``, CPU -> ``mlxinfer.native.provider()``), checks once which
capabilities it has (``kernels.provider``), and then, per module instance of this model:

* turns every plain ``nn.QuantizedLinear`` into ``KernelQuantizedLinear`` (a subclass: same parameters, same
  ``isinstance``), and the tied LM head / embedding, ``nn.RMSNorm`` and ``nn.RoPE`` into their kernel classes;
* hands SwiGLU MLPs, attention modules and decoder blocks of the classes in ``kernels.eligibility``'s table to
  ``fused_llama`` (q/k/v + RoPE as one op, skip connections and norms folded in) and ``fused_block`` (the whole
  layer as one op, writing a ``kernels.kv_cache.InPlaceKVCache``): the CPU pays microseconds per MLX op;
* routes every other mlx-lm attention module's ``scaled_dot_product_attention`` through the provider
  (``layers.routed_attention_class``: the module's code with its own copy of the globals);
* runs the load-time self-check (``kernels.selfcheck``), which turns off what disagrees with mlx-lm's code.

Nothing outside ``model`` changes: another model in the process (a bench peer, the model before chat's
``/model``) keeps MLX's layers and attention. ``apply_kernels(model, "builtin")`` undoes it all.

Module chain (imports go one way): provider, eligibility, kv_cache -> layers -> fused_block -> fused_llama ->
selfcheck -> patch.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.nn as nn

from mlxinfer.engine.backend import backend
from mlxinfer.errors import InvalidParameter, MlxinferError
from mlxinfer.kernels import eligibility, fused_block, fused_llama, kv_cache, layers, selfcheck
from mlxinfer.kernels.layers import KernelQuantizedLinear  # noqa: F401  (part of this module's API)
from mlxinfer.kernels.provider import Capabilities, KernelProvider, capabilities

ENV_VAR = "MLXINFER_KERNELS"
MODES = ("auto", "custom", "builtin")


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
    restore_builtin(model)  # start from MLX's classes: applying twice, or with another provider, is the same
    if mode == "builtin":
        return KernelReport("builtin", "MLX built-in kernels (requested)")
    where = backend()
    provider, why = select_provider(where)
    caps = None
    if provider is not None:
        try:
            caps = capabilities(provider)
        except TypeError as exc:
            why = f"{why}; {exc}"
    if caps is None:
        if mode == "custom":
            raise MlxinferError(
                f"custom kernels are not available on the {where} backend: {why}",
                hint="use --kernels builtin or --kernels auto",
            )
        return KernelReport("builtin", f"MLX built-in kernels ({why})")
    block_why_not = _swap(model, provider, caps)
    findings = selfcheck.check_model(model)
    if findings and mode == "custom":
        restore_builtin(model)
        raise MlxinferError(findings[0].line(), hint="use --kernels auto (it falls back) or --kernels builtin")
    if any(fused_block.is_one_op(m) for _, m in model.named_modules()):
        # make_prompt_cache(model) (the engine, bench, server) then gives the caches the one-op layers write.
        model.make_cache = kv_cache.cache_maker(model, _windowed_layers(model))
    why_not = [f"{n} decoder layers not as one op: {why}" for why, n in block_why_not.items()]
    why_not += [f.line() for f in findings]
    validated = eligibility.mlx_lm_validated()
    if validated is not None:
        why_not.append(f"fused layers off: {validated}")
    modules = layers.attention_modules(model)
    detail = (f"{provider.name} on {where}: {describe(model)}, attention in {', '.join(modules) or 'no modules'}"
              + "".join(f"; {line}" for line in why_not))
    return KernelReport(provider.name, detail)


def _windowed_layers(model: nn.Module) -> frozenset:
    """Indexes in ``model.layers`` of the sliding-window layers, when every one of them runs as one op (their
    RotatingKVCaches then become in-place caches the op reads windowed; a mix would give the model's shared
    window mask two cache layouts), else none."""
    blocks = list(getattr(model, "layers", None) or [])
    sliding = [i for i, b in enumerate(blocks) if getattr(getattr(b, "self_attn", None), "is_sliding", False)]
    if sliding and all(fused_block.is_one_op(blocks[i]) and fused_block.window_of(blocks[i]) for i in sliding):
        return frozenset(sliding)
    return frozenset()


def _swap(model: nn.Module, provider: KernelProvider, caps: Capabilities) -> dict:
    """Swap the kernel classes in; returns {reason: count} for the decoder layers that do not run as one op."""
    layers.register(provider, caps)
    for _, m in model.named_modules():
        # Exact classes only: a subclass (e.g. a LoRA layer) may rely on its own maths.
        if type(m) is nn.QuantizedLinear:
            layers.bind(m, KernelQuantizedLinear, provider)
    for cls, capability, _ in layers.SMALL_OPS:
        if capability is not None and not getattr(caps, capability):
            continue
        base = layers.builtin_class(cls)
        for _, m in model.named_modules():
            if type(m) is base:
                layers.bind(m, cls, provider)
                if cls is layers.KernelQuantizedEmbedding:
                    m._kernel_lookup = caps.embedding
    fused_llama.swap_mlps(model, provider, caps)
    fused_llama.swap_attention_inputs(model, provider, caps)
    _, _, why_not = fused_llama.swap_blocks(model, provider, caps)
    for _, m in model.named_modules():  # the other attention modules: their attention call only
        if not layers.is_kernel_class(type(m)) and type(m).__module__.startswith("mlx_lm.models.") \
                and layers.routes_attention(type(m)):
            layers.bind(m, layers.routed_attention_class(type(m), provider), provider)
    return why_not


def describe(model: nn.Module) -> str:
    """What runs in ``model`` now, counted from its modules' classes (after the self-check turned off what failed)."""
    counts = {"quantized linear layers": 0, "fused SwiGLU MLPs": 0}
    labels = {KernelQuantizedLinear: "quantized linear layers", **{cls: label for cls, _, label in layers.SMALL_OPS}}
    kinds = {"swiglu": "fused SwiGLU MLPs", "attention": "fused q/k/v+RoPE attention inputs",
             "block": "blocks with fused skip connections"}
    for _, m in model.named_modules():
        kind = layers.fused_kind(m)
        label = kinds[kind] if kind else labels.get(type(m))
        if kind == "block" and fused_block.is_one_op(m):
            counts["decoder layers as one op"] = counts.get("decoder layers as one op", 0) + 1
            if not fused_llama.fused_parts(m):  # no per-op fallback with skip connections (gemma3, phi3)
                label = None
        if label:
            counts[label] = counts.get(label, 0) + 1
    first = [f"{counts.pop(k)} {k}" for k in ("quantized linear layers", "fused SwiGLU MLPs")]
    return ", ".join(first + [f"{n} {what}" for what, n in counts.items() if n])


def restore_builtin(model: nn.Module) -> None:
    """Undo ``apply_kernels``: every module of ``model`` is MLX's / mlx-lm's class again, its caches plain."""
    for _, m in model.named_modules():
        if layers.is_kernel_class(type(m)) or "_kernel_provider" in m.__dict__:
            layers.unbind(m)
    model.__dict__.pop("make_cache", None)
