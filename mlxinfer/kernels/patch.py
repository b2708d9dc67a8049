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
* runs the load-time self-check (``kernels.selfcheck``), which turns off what disagrees with mlx-lm's code;
* where the provider reads them (``TiledWeights``), puts the one-op layers' 4-bit weights and the LM head in row
  tiles (``kernels.tiling``, each checked against itself on MLX's layout);
* on the CPU, settles the dtype of each quantized layer's scales/biases (:func:`settle_scales`).

Nothing outside ``model`` changes: another model in the process (a bench peer, the model before chat's
``/model``) keeps MLX's layers and attention. ``apply_kernels(model, "builtin")`` undoes it all.

Module chain (imports go one way): provider, eligibility, kv_cache, tiling -> layers -> fused_block -> fused_llama
-> selfcheck -> patch.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache

from mlxinfer.engine.backend import backend
from mlxinfer.errors import InvalidParameter, MlxinferError
from mlxinfer.kernels import eligibility, fused_block, fused_llama, kv_cache, layers, selfcheck
from mlxinfer.kernels.layers import KernelQuantizedLinear  # noqa: F401  (part of this module's API)
from mlxinfer.kernels.provider import Capabilities, KernelProvider, capabilities

ENV_VAR = "MLXINFER_KERNELS"
MODES = ("auto", "custom", "builtin")
# Backends where "auto" keeps MLX's built-ins, and why: measured, not assumed (``--kernels custom`` still runs
# mlxinfer's kernels there). On an H200 with MLX 0.32.4 the CUDA route gives the built-ins' greedy tokens but is
# 2-3x slower per matmul and attention call and JIT-compiles for tens of seconds (docs/kernels.md).
AUTO_BUILTIN = {
    "cuda": "faster than mlxinfer's CUDA kernels on the GPUs measured; --kernels custom runs those",
}


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
    try:
        report = _apply(model, mode)
    finally:  # also when the kernels were refused: the layers left to MLX need float32 scales
        scales = settle_scales(model)
        # The weights this replaced (untiled copies, other scale dtypes) and the self-checks' intermediates sit in
        # MLX's buffer cache; freeing them here keeps that cost out of the first prompt (~25 ms of a Gemma-3-270M
        # first token: the prefill's own clear_cache returned them).
        mx.clear_cache()
    if report.name != "builtin" and scales:
        report = KernelReport(report.name, f"{report.detail}; {scales}")
    return report


def _apply(model: nn.Module, mode: str) -> KernelReport:
    mode = resolve_mode(mode)
    restore_builtin(model)  # start from MLX's classes: applying twice, or with another provider, is the same
    if mode == "builtin":
        return KernelReport("builtin", "MLX built-in kernels (requested)")
    where = backend()
    if mode == "auto" and where in AUTO_BUILTIN:  # before select_provider: no kernel is built or self-tested
        return KernelReport("builtin", f"MLX built-in kernels ({AUTO_BUILTIN[where]})")
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
    tiled = heads = 0
    if caps.tiled and not (findings and mode == "custom"):
        tiled, tile_findings = selfcheck.tile_checked(model)
        heads, head_findings = selfcheck.tile_heads(model)
        findings += tile_findings + head_findings
    if findings and mode == "custom":
        restore_builtin(model)
        raise MlxinferError(findings[0].line(), hint="use --kernels auto (it falls back) or --kernels builtin")
    if any(fused_block.is_one_op(m) for _, m in model.named_modules()):
        # make_prompt_cache(model) (the engine, bench, server) then gives the caches the one-op layers write.
        model.make_cache = kv_cache.cache_maker(model, _windowed_layers(model))
    why_not = list(provider.report_notes()) if caps.notes else []  # e.g. the CPU's int8 prefill
    if tiled or heads:
        what = [f"{tiled} decoder layers'"] if tiled else []
        what += ["the LM head's"] if heads else []
        why_not.append(f"{' and '.join(what)} weights in row tiles")
    why_not += [f"{n} decoder layers not as one op: {why}" for why, n in block_why_not.items()]
    why_not += [f.line() for f in findings]
    validated = eligibility.mlx_lm_validated()
    if validated is not None:
        why_not.append(f"fused layers off: {validated}")
    modules = layers.attention_modules(model)
    detail = (f"{provider.name} on {where}: {describe(model)}, attention in {', '.join(modules) or 'no modules'}"
              + "".join(f"; {line}" for line in why_not))
    return KernelReport(provider.name, detail)


STORED_SCALES = "_stored_scales_dtype"  # instance attribute: the half dtype a widened layer's scales came in


def settle_scales(model: nn.Module) -> str:
    """CPU backend: float16/bfloat16 or float32 for each quantized layer's scales/biases; returns a report clause.

    Ownership: the loader keeps them as stored (``apply_dtype_policy(keep_quantized_scales=True)``) and this
    decides per layer, once the layer classes are final. A layer a native kernel runs keeps the half dtype (a 4-bit
    group-32 weight then costs 5 bits, not 6, per decode step); every other one (MLX built-ins: builtin mode, bits
    or modes the kernels lack, sharded or subclassed layers, a provider that wants x's dtype) gets float32, since
    MLX's CPU kernels are faster so and its QuantizedEmbedding lookup would return float16 rows. A widened layer
    remembers its stored dtype, so applying kernels again narrows it back exactly (float16 -> float32 is exact)."""
    if backend() != "cpu":
        return ""  # GPUs: the policy already gave scales the activation dtype, which their kernels take
    kept, widened = set(), 0
    for _, m in model.named_modules():
        scales = m.get("scales")
        if not (isinstance(scales, mx.array) and hasattr(m, "group_size") and mx.issubdtype(scales.dtype, mx.floating)):
            continue
        stored = scales.dtype if scales.dtype != mx.float32 else getattr(m, STORED_SCALES, None)
        if stored is None:  # stored as float32
            continue
        want = stored if _native_takes(m, stored) else mx.float32
        if scales.dtype != want:
            new = {k: m[k].astype(want) for k in ("scales", "biases") if isinstance(m.get(k), mx.array)}
            m.update(new)
            mx.eval(list(new.values()))  # layer by layer: the two copies of all scales never coexist
            setattr(m, STORED_SCALES, stored)
        if want == mx.float32:
            widened += 1
        else:
            kept.add((id(m), str(want).replace("mlx.core.", "")))
    if not kept:
        return ""
    names = "/".join(sorted({d for _, d in kept}))
    return (f"scales/biases as stored ({names}) in {len(kept)} quantized layers"
            + (f", float32 in {widened} run by MLX" if widened else ""))


def _native_takes(m: nn.Module, dtype) -> bool:
    """Whether the kernels bound to quantized layer ``m`` run it with scales/biases of ``dtype`` and float32 x (a
    graph-building probe: the provider answers None for what it does not take, and nothing is evaluated)."""
    provider = m.__dict__.get("_kernel_provider")
    kinds = (KernelQuantizedLinear, layers.KernelQuantizedEmbedding, layers.KernelQuantizedSwitchLinear)
    if provider is None or type(m) not in kinds:
        return False
    w, s, b = m["weight"], m["scales"].astype(dtype), m.get("biases")
    b = b.astype(dtype) if b is not None else None
    kw = {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
    x = mx.zeros((1, w.shape[-1] * 32 // m.bits), mx.float32)
    if type(m) is layers.KernelQuantizedSwitchLinear:  # experts (E, N, K): one token through expert 0
        return m.global_scale is None and provider.gather_qmm(x, w, s, b, mx.zeros((1,), mx.uint32), **kw) is not None
    if provider.quantized_matmul(x, w, s, b, **kw) is None:
        return False
    if type(m) is layers.KernelQuantizedEmbedding:  # MLX's own lookup would return rows in the scales' dtype
        return m._kernel_lookup and provider.quantized_embedding(mx.zeros((1,), mx.int32), w, s, b, **kw) is not None
    return True


def _windowed_layers(model: nn.Module) -> frozenset:
    """Indexes in ``model.layers`` of the sliding-window layers (those the model's own ``make_cache`` gives a
    ``RotatingKVCache``: gemma3_text's local layers, olmo3's sliding ones), when every one of them runs as one op
    with a window (their caches then become InPlaceRotatingKVCaches the op writes in place), else none."""
    blocks = list(getattr(model, "layers", None) or [])
    own = kv_cache.own_make_cache(model)
    if own is None or not blocks:
        return frozenset()
    caches = own(model)
    sliding = [i for i, c in enumerate(caches) if type(c) is RotatingKVCache and c.keep == 0]
    if sliding and len(caches) == len(blocks) and all(
            fused_block.is_one_op(blocks[i]) and fused_block.window_of(blocks[i]) for i in sliding):
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
