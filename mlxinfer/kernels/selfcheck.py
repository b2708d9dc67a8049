"""Load-time self-check: every distinct fused configuration runs once against the module's own code.

The eligibility table (``kernels.eligibility``) says which mlx-lm classes a fused path may take, by identity; it
cannot see a method that changed under the same class (an upstream edit, a monkeypatch, a subclass' data). So
before first use, one module of each configuration runs a short prefill and one decode step on random input
twice: through the fused path, and through the class' original ``__call__`` with every kernel under it undone
(MLX's own layers and attention). A disagreement turns that configuration's fused path off (then, if the
per-op kernels alone still disagree, those too) and is reported in one line; ``--kernels custom`` fails instead.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_lm.models.cache import KVCache
from mlxinfer.kernels import fused_block, tiling
from mlxinfer.kernels.fused_block import window_of
from mlxinfer.kernels.layers import (
    KernelQuantizedEmbedding, KernelQuantizedLinear, bind, builtin_class, fused_kind, is_kernel_class,
    routed_attention_class, routes_attention, unbind,
)

# Relative to the reference output's largest magnitude. The fused paths differ from MLX's by rounding only
# (activations rounded to int16 per group in the VNNI matvec, a float16 KV cache; the int8 paths are off while
# checking): measured ≤ 3e-3 on the tiny and real models; a changed formula (scaled queries, another activation,
# a bias) gives 1e-1 and more.
TOLERANCE = 2e-2
PREFILL, SEED = 5, 1234


@dataclass(frozen=True)
class Finding:
    where: str    # the first module of the configuration, e.g. "model.layers.0"
    count: int    # modules sharing the configuration
    error: float  # relative max difference of the fused path
    kept: str     # what runs now: "per-op kernels", "MLX built-ins" or "MLX's weight layout"
    checked: str = ""  # "row tiles": the tiled kernels against the same fused path on MLX's layout

    def line(self) -> str:
        if self.checked:
            return (f"self-check: the fused path of {self.where} (+{self.count - 1} alike) on {self.checked} "
                    f"disagreed with itself on MLX's layout (max rel. error {self.error:.2g} > {TOLERANCE:g}); "
                    f"{self.count} modules keep {self.kept}")
        return (f"self-check: the fused path of {self.where} (+{self.count - 1} alike) disagreed with mlx-lm's own "
                f"code (max rel. error {self.error:.2g} > {TOLERANCE:g}); {self.count} modules use {self.kept}")


def check_model(model: nn.Module) -> list[Finding]:
    """Check each fused configuration of ``model`` (after ``apply_kernels``); undo the failing ones."""
    findings = []
    for where, members in _groups(model).items():
        first = members[0]
        error = _error(first)
        if error <= TOLERANCE:
            continue
        for m in members:  # the fused layers off, the per-op kernels under them kept
            _unfuse(m, keep_per_op=True)
        kept = "per-op kernels"
        if _error(first) > TOLERANCE:
            for m in members:
                _unfuse(m, keep_per_op=False)
            kept = "MLX built-ins"
        findings.append(Finding(where, len(members), error, kept))
    return findings


def tile_checked(model: nn.Module) -> tuple[int, list[Finding]]:
    """Put the one-op layers' 4-bit linears in row tiles (``fused_block.tile``), one configuration at a time, and
    within it one weight form at a time (symmetric weights get a plan that reads no biases): the first such
    layer's fused output on the check's input must not move (the tiled kernels sum in another order: ~1e-6), else
    those layers keep MLX's layout and a finding says so. Returns (layers tiled, findings)."""
    tiled, findings = 0, []
    for where, members in _groups(model).items():
        xs = _inputs(members[0])
        if xs is None or "_native_plan" not in members[0].__dict__:
            continue
        forms = [fused_block.weights_symmetric(m) for m in members]
        verdict: dict[bool, bool] = {}  # symmetric -> its first layer tiled and passed
        for m, form in zip(members, forms):
            if form in verdict:
                tiled += verdict[form] and fused_block.tile(m)
                continue
            error = _tile_error(m, xs)
            # None: not tileable, or the op did not take the check's call (the weights were put back)
            verdict[form] = error is not None and error <= TOLERANCE
            if error is not None and not verdict[form]:
                tiling.untile_block(m)
                findings.append(Finding(where, forms.count(form), error, "MLX's weight layout", "row tiles"))
            tiled += verdict[form]
    return tiled, findings


def _tile_error(m: nn.Module, xs) -> Optional[float]:
    """How far ``m``'s fused output on ``xs`` moves when it is tiled (it stays tiled); None when it was not."""
    with _precise_activations():
        before = _run(m, m, xs)
        if not fused_block.tile(m):
            return None
        after = _run(m, m, xs)
    if not tiling.is_tiled(m):
        return None
    return _relative_error(after, before)


def tile_heads(model: nn.Module) -> tuple[int, list[Finding]]:
    """Row tiles for the LM head: a tied embedding whose lookup is the provider's (``_kernel_lookup``) or an
    ``lm_head`` linear, 4- or 8-bit, rows a multiple of 16. Its output on random rows must not move (and the lookup not
    at all), else it keeps MLX's layout and a finding says so. Returns (heads tiled, findings)."""
    tiled, findings = 0, []
    modules = model.named_modules()
    untied = any(type(m) is KernelQuantizedLinear and p.rpartition(".")[2] == "lm_head" for p, m in modules)
    for path, m in modules:
        # An embedding is the head only when no lm_head exists (tied); tiles would only slow its lookup otherwise.
        embedding = (type(m) is KernelQuantizedEmbedding and m.__dict__.get("_kernel_lookup", False)
                     and not untied)
        linear = type(m) is KernelQuantizedLinear and path.rpartition(".")[2] == "lm_head"
        if not (embedding or linear) or not tiling.tileable(m, (4, 8)) or tiling.tiles_of(m) is not None:
            continue
        x = mx.random.normal((3, m["weight"].shape[1] * 32 // m.bits), key=mx.random.key(SEED))
        ids = mx.array([0, 1, m["weight"].shape[0] // 2, m["weight"].shape[0] - 1])
        run = (lambda: [m.as_linear(x), m(ids)]) if embedding else (lambda: [m(x)])
        with _precise_activations():
            before = run()
            mx.eval(before)
            tiling.tile_block(m, [m], tiling.symmetric([m]))
            after = run()
            mx.eval(after)
        error = _relative_error(after, before)
        if embedding and not mx.array_equal(after[1], before[1]).item():
            error = float("inf")
        if tiling.tiles_of(m) is not m or error > TOLERANCE:  # a path that declined, or disagreed
            tiling.untile_block(m)
            findings.append(Finding(path, 1, error, "MLX's weight layout", "row tiles"))
            continue
        tiled += 1
    return tiled, findings


def _is_fused(m: nn.Module) -> bool:
    return fused_kind(m) is not None


def _groups(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Top-level fused modules (not inside another fused one) grouped by configuration, keyed by the first's path."""
    fused = [(name, m) for name, m in sorted(model.named_modules(), key=lambda nm: _natural(nm[0])) if _is_fused(m)]
    inside = {id(sub) for _, m in fused for path, sub in m.named_modules() if path}
    names_read: dict[type, frozenset] = {}  # per check, not per process: a method may be patched in between
    groups: dict[tuple, list] = {}
    names: dict[tuple, str] = {}
    for name, m in fused:
        if id(m) in inside:
            continue
        key = _signature(m, names_read)
        groups.setdefault(key, []).append(m)
        names.setdefault(key, name or "model")
    return {names[k]: v for k, v in groups.items()}


def _natural(path: str) -> tuple:
    """"layers.10" after "layers.9"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


# A module's place in the stack, stored by some mlx-lm classes (gemma3_text's Attention keeps ``layer_idx``). Left
# in the signature, it made every Gemma layer a configuration of its own: 26 checks and ~5 s of a Gemma-3-1B load.
# It is dropped only where no method of the subtree's mlx-lm classes reads it (what it decides, e.g. ``is_sliding``,
# is a scalar of its own and stays); mlxinfer's fused paths never read it.
POSITION_ATTRS = frozenset({"layer_idx", "layer_id", "idx"})


def _signature(m: nn.Module, names_read: dict) -> tuple:
    """What makes two modules compute alike: classes, scalar settings and parameter shapes of the whole subtree
    (position attributes that no code of the subtree reads left out; ``names_read`` memoises ``_names_read``),
    and the one-op layer's LayerSpec when it has one."""
    subs = list(m.named_modules())
    read = set()
    for _, sub in subs:
        cls = builtin_class(type(sub))
        if cls not in names_read:
            names_read[cls] = _names_read(cls)
        read |= names_read[cls]
    unread = POSITION_ATTRS - read
    parts = []
    for path, sub in subs:
        scalars = tuple(sorted((k, v) for k, v in vars(sub).items()
                               if isinstance(v, (int, float, bool, str)) and not k.startswith("_")
                               and k not in unread))
        parts.append((path, type(sub), scalars))
    shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in tree_flatten(m.parameters()))
    # The one-op layer's own description (its window, rope, ...): what it computes may differ where the modules
    # do not (olmo3's sliding and full layers differ only in a list on the block's args).
    plan = m.__dict__.get("_native_plan")
    return tuple(parts), shapes, plan.spec if plan is not None else None


def _names_read(cls: type) -> frozenset:
    """Every name the methods of ``cls`` and its bases below ``nn.Module`` may read (``__init__`` aside, which stores
    the attribute): the attribute and global names and the string constants of their code, and the same of what
    that code reaches (nested functions, wrapped or closed-over functions, functions of the class' module called by
    name). An attribute whose name is not among them cannot change what the module computes."""
    names: set = set()
    seen: set = set()
    stack: list = []

    def add(fn) -> None:
        fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
        if isinstance(fn, property):
            for f in (fn.fget, fn.fset, fn.fdel):
                add(f)
            return
        if hasattr(fn, "__wrapped__"):  # functools.wraps: the wrapped function, and the wrapper's own code below
            add(fn.__wrapped__)
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in seen:
            return
        seen.add(id(code))
        stack.append((code, getattr(fn, "__globals__", {})))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                add(cell.cell_contents)
            except ValueError:  # an empty cell
                pass

    for klass in cls.__mro__:
        if klass in (nn.Module, dict, object):
            continue
        for name, value in vars(klass).items():
            if name != "__init__":
                add(value)
    while stack:
        code, scope = stack.pop()
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                stack.append((c, scope))
            elif isinstance(c, str):
                names.add(c)  # getattr(self, "layer_idx")
        for name in code.co_names:
            if isinstance(scope.get(name), types.FunctionType):
                add(scope[name])
    return frozenset(names)


def _inputs(m: nn.Module) -> Optional[tuple[mx.array, mx.array]]:
    """A prefill and one decode step of random hidden states shaped for ``m`` (drawn from their own key, so the
    global random state that sampling uses is untouched)."""
    width = _input_width(m)
    if width is None:
        return None
    # A sliding layer is checked within its window: the reference then runs with a causal mask and a plain cache,
    # which is the maths of the window mask and rotating cache the model gives it while every key is in the window.
    window = window_of(m)
    length = max(1, min(PREFILL, window - 1)) if window > 0 else PREFILL
    k1, k2 = mx.random.split(mx.random.key(SEED))
    return mx.random.normal((1, length, width), key=k1), mx.random.normal((1, 1, width), key=k2)


def _input_width(m: nn.Module) -> Optional[int]:
    for name in ("q_proj", "qkv_proj", "gate_proj", "gate_up_proj", "self_attn"):
        sub = getattr(m, name, None)
        if isinstance(sub, nn.Module):
            return _input_width(sub) if name == "self_attn" else _in_features(sub)
    return None


def _in_features(linear: nn.Module) -> Optional[int]:
    if isinstance(linear, nn.QuantizedLinear):
        return linear["weight"].shape[1] * 32 // linear.bits
    if isinstance(linear, nn.Linear):
        return linear["weight"].shape[1]
    return None


def _run(m: nn.Module, call, xs) -> list[mx.array]:
    """``call`` over a prefill and a decode step, with a fresh KV cache where the module takes one."""
    code = builtin_class(type(m)).__call__.__code__
    if code.co_argcount <= 2:  # an MLP: (self, x)
        outs = [call(x) for x in xs]
    else:
        cache = KVCache()  # arguments by keyword: a block may take more than (x, mask, cache)
        outs = [call(x, mask=mask, cache=cache, **_extra(code, x)) for x, mask in zip(xs, ("causal", None))]
    mx.eval(outs)
    return outs


def _extra(code, x: mx.array) -> dict:
    """What a block takes besides (x, mask, cache), drawn so that using it wrongly shows: ministral3's
    ``attn_scale`` (a factor per query row, 1 below its original context, so the model's own would check
    nothing here) as random factors in [1, 1.5)."""
    if "attn_scale" not in code.co_varnames[:code.co_argcount]:
        return {}
    key = mx.random.key(SEED + x.shape[1])
    return {"attn_scale": 1 + 0.5 * mx.random.uniform(shape=(x.shape[1], 1), key=key)}


def _error(m: nn.Module) -> float:
    xs = _inputs(m)
    if xs is None:
        return 0.0
    with _precise_activations():
        fused = _run(m, m, xs)
    base = builtin_class(type(m))
    with _unfused_view(m):
        reference = _run(m, lambda *a, **k: base.__call__(m, *a, **k), xs)
    return _relative_error(fused, reference)


def _relative_error(got: list, reference: list) -> float:
    """The largest |got - reference| of each pair relative to that reference's largest magnitude; inf for NaN."""
    worst = 0.0
    for f, r in zip(got, reference):
        scale = float(mx.abs(r).max()) or 1.0
        worst = max(worst, float(mx.abs(f.astype(mx.float32) - r.astype(mx.float32)).max()) / scale)
    return worst if worst == worst else float("inf")  # NaN: a broken path


def _precise_activations():
    """The native kernels' activations at their precise rounding while checking: decode x at int16 (avx2i8) and
    prefill x at float32 (the AVX2 int8 prefill GEMM). Int8 x (llama.cpp-grade, ~1-3% of a layer's output on
    random input) would hide a changed formula in its rounding; test_qmm_int8_decode.py, test_qmm_avx2i8gemm.py and
    test_spec_layers.py hold the int8 paths. The settings found are restored."""
    from mlxinfer import native

    return native.int8_activations(decode=False, prefill=False)


@contextlib.contextmanager
def _unfused_view(m: nn.Module) -> Iterator[None]:
    """Every kernel class in ``m``'s subtree (its attention routing included) as MLX's while inside, its weights in
    MLX's layout (a tiled block is tiled again after)."""
    saved = [(sub, sub.__class__) for _, sub in m.named_modules()]
    retile = tiling.untile_block(m)
    try:
        for sub, cls in saved:
            sub.__class__ = builtin_class(cls)
        yield
    finally:
        for sub, cls in saved:
            sub.__class__ = cls
        if retile:
            fused_block.tile(m)


def _unfuse(m: nn.Module, *, keep_per_op: bool) -> None:
    """Turn off the fused classes in ``m``'s subtree (an attention module keeps its attention routed through the
    provider); with ``keep_per_op=False`` every kernel class."""
    for _, sub in m.named_modules():
        cls = type(sub)
        if fused_kind(sub) is None and (keep_per_op or not is_kernel_class(cls)):
            continue
        provider = sub.__dict__.get("_kernel_provider")
        unbind(sub)
        if keep_per_op and provider is not None and routes_attention(type(sub)):
            bind(sub, routed_attention_class(type(sub), provider), provider)
