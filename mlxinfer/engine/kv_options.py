"""KV-cache options: a quantized cache (``--kv-bits``) or a capped, rotating one (``--max-kv-size``).

Both are mlx-lm's own caches (``QuantizedKVCache``, ``RotatingKVCache``): :func:`make_cache` builds the model's
usual cache and swaps each plain ``KVCache`` layer for one of them. Layers with a cache of their own kind (a
sliding window, an SSM state) keep it. ``quantized_start`` > 0 is mlx-lm's ``quantized_kv_start``: layers stay
full precision until they hold that many tokens, then :func:`maybe_quantize` (called after every model call by
``steps.token_steps``) converts them.

The native CPU path's one-op decoder layers write a float KV cache in place (``kernels.kv_cache``); with these
caches they step aside per call and :func:`kernel_note` says so, for the kernel report.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import InvalidParameter

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
MIN_KV_SIZE = 32          # below this a rotating cache keeps little more than its 4 pinned tokens
ROTATING_KEEP = 4         # tokens a rotating cache never drops (mlx-lm's choice: attention sinks at the start)
# The user-facing names (flags --kv-bits / --max-kv-size, session files, /show) of KVOptions' fields.
NAMES = {"bits": "kv_bits", "group_size": "kv_group_size", "max_size": "max_kv_size",
         "quantized_start": "quantized_kv_start"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class KVOptions:
    """How the KV cache is kept. The defaults are a plain full-precision cache."""

    bits: int | None = None        # 4 or 8: QuantizedKVCache; None: full precision
    group_size: int = 64           # quantization group size (32, 64 or 128)
    max_size: int | None = None    # RotatingKVCache holding at most this many tokens; None: grows with the context
    quantized_start: int = 0       # quantize a layer once it holds this many tokens (0: from the first)

    @property
    def active(self) -> bool:
        return self.bits is not None or self.max_size is not None

    def validate(self, context_length: int | None = None, *, names: tuple[str, str] = ("--kv-bits", "--max-kv-size"),
                 combine_hint: str = "use one of them") -> "KVOptions":
        """``self`` when valid; else InvalidParameter naming the setting (``names``: how the caller's user spells
        bits and max_size, the flags by default, /set's names in chat), its allowed values and the value."""
        bits_name, size_name = names
        if self.bits is not None and (not _is_int(self.bits) or self.bits not in KV_BITS):
            raise InvalidParameter(f"invalid {bits_name} {self.bits!r}: use 4 or 8",
                                   hint="leave it off for a full-precision cache")
        if not _is_int(self.group_size) or self.group_size not in KV_GROUP_SIZES:
            raise InvalidParameter(f"invalid KV group size {self.group_size!r}: use 32, 64 or 128")
        if not _is_int(self.quantized_start) or self.quantized_start < 0:
            raise InvalidParameter(f"invalid quantized KV start {self.quantized_start!r}: must be 0 or more")
        if self.max_size is not None:
            top = f"{context_length}, the model's context" if context_length else "the model's context"
            if not _is_int(self.max_size) or self.max_size < MIN_KV_SIZE or (
                    context_length is not None and self.max_size > context_length):
                raise InvalidParameter(f"invalid {size_name} {self.max_size!r}: must be between {MIN_KV_SIZE} "
                                       f"and {top}", hint="leave it off to keep the whole context")
            if self.bits is not None:
                raise InvalidParameter(f"{bits_name} and {size_name} cannot be combined (mlx-lm has no quantized "
                                       "rotating cache)", hint=combine_hint)
        return self

    def describe(self) -> str:
        """Short words for the report and /show, e.g. "8-bit (group 64)" or "at most 512 tokens (rotating)"."""
        if self.bits is not None:
            start = f", from token {self.quantized_start}" if self.quantized_start else ""
            return f"{self.bits}-bit (group {self.group_size}{start})"
        if self.max_size is not None:
            return f"at most {self.max_size} tokens (rotating)"
        return "full precision"

    def as_dict(self) -> dict[str, Any]:
        """The options under their user-facing names (kv_bits, max_kv_size, ...), for session files and JSON."""
        return {NAMES[k]: v for k, v in asdict(self).items()}


def pick(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """KVOptions fields from ``values`` (user-facing names, dashes allowed, or field names); None left out."""
    by_name = {**{v: k for k, v in NAMES.items()}, **{k: k for k in NAMES}}
    out: dict[str, Any] = {}
    for k, v in (values or {}).items():
        f = by_name.get(str(k).strip().lower().replace("-", "_"))
        if f is not None and v is not None:
            out[f] = v
    return out


def resolve(registry_defaults: Mapping[str, Any] | None = None, saved: Mapping[str, Any] | None = None,
            flags: Mapping[str, Any] | None = None, context_length: int | None = None) -> KVOptions:
    """KVOptions by the settings precedence: registry defaults < a saved session's values < flags (None = not
    given), validated (against ``context_length`` when given). ``bits`` and ``max_size`` choose the kind of
    cache: a layer that sets one of them clears the other one set below it (--kv-bits over a session saved with
    a max_kv_size is a quantized cache, not a conflict)."""
    merged: dict[str, Any] = {}
    for layer in (pick(registry_defaults), pick(saved), pick(flags)):
        for kind, other in (("bits", "max_size"), ("max_size", "bits")):
            if kind in layer and other not in layer:
                merged.pop(other, None)
        merged.update(layer)
    return KVOptions(**merged).validate(context_length)


def _plain(c: Any) -> bool:
    from mlx_lm.models.cache import KVCache

    return isinstance(c, KVCache) and type(c).update_and_fetch is KVCache.update_and_fetch


def make_cache(model: Any, opts: KVOptions | None = None) -> list:
    """The model's prompt cache (``kernels.kv_cache.prompt_caches``) with ``opts`` applied: each plain ``KVCache``
    layer a ``QuantizedKVCache`` (``bits``, from the start) or a ``RotatingKVCache`` (``max_size``). Raises
    InvalidParameter when the model has no layer the option can apply to."""
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    from ..kernels.kv_cache import prompt_caches

    cache = prompt_caches(model)
    if opts is None or not opts.active:
        return cache
    if opts.max_size is not None:
        swap = lambda: RotatingKVCache(max_size=opts.max_size, keep=ROTATING_KEEP)  # noqa: E731
    elif opts.quantized_start == 0:
        swap = lambda: QuantizedKVCache(group_size=opts.group_size, bits=opts.bits)  # noqa: E731
    else:
        swap = None  # quantized later by maybe_quantize
    plain = [i for i, c in enumerate(cache) if _plain(c)]
    if not plain:
        kinds = ", ".join(sorted({type(c).__name__ for c in cache})) or "none"
        flag = "--kv-bits" if opts.bits is not None else "--max-kv-size"
        raise InvalidParameter(f"{flag} does not apply to this model: its KV cache is {kinds}, not mlx-lm's "
                               "plain KVCache", hint=f"run it without {flag}")
    head_dim = _head_dim(model)
    if opts.bits is not None and head_dim and head_dim % opts.group_size:
        raise InvalidParameter(f"--kv-bits does not apply to this model: its attention heads have {head_dim} "
                               f"dimensions, not a multiple of the quantization group ({opts.group_size})",
                               hint="run it without --kv-bits")
    # A head dim the args do not give is probed as one group (the probe's keys must split into whole groups).
    probe_dim = head_dim or opts.group_size
    if opts.bits is not None and (problem := quantized_attention_problem(probe_dim, opts.group_size, opts.bits)):
        raise InvalidParameter(f"--kv-bits does not work with this MLX build on this device: {problem}",
                               hint="run it without --kv-bits")
    if swap is not None:
        for i in plain:
            cache[i] = swap()
    return cache


@functools.lru_cache(maxsize=None)
def quantized_attention_problem(head_dim: int, group_size: int, bits: int) -> str | None:
    """None when MLX runs attention over a quantized KV cache on the default device, else MLX's error (its first
    line). Checked once on tiny inputs, decode (1 query) and prefill (16): MLX 0.32.4's CUDA quantized_matmul has
    no implementation for these shapes (seen on an H200), which would otherwise fail mid-generation."""
    import mlx.core as mx
    from mlx_lm.models import base

    keys = mx.quantize(mx.zeros((1, 1, 33, head_dim), mx.float16), group_size=group_size, bits=bits)
    try:
        for queries in (1, 16):
            q = mx.zeros((1, 1, queries, head_dim), mx.float16)
            mx.eval(base.quantized_scaled_dot_product_attention(q, keys, keys, scale=1.0, mask=None,
                                                                group_size=group_size, bits=bits))
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def _head_dim(model: Any) -> int | None:
    """The keys' last dimension as mlx-lm's model args say it (None when they do not)."""
    args = getattr(model, "args", None)
    hd = getattr(args, "head_dim", None)
    if _is_int(hd) and hd > 0:
        return hd
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    return hidden // heads if _is_int(hidden) and _is_int(heads) and heads > 0 else None


def maybe_quantize(cache: list, opts: KVOptions | None) -> None:
    """Quantize (in place in the list) each plain layer cache holding ``opts.quantized_start`` tokens or more:
    mlx-lm's ``maybe_quantize_kv_cache`` limited to the layers ``make_cache`` would have swapped."""
    if opts is None or opts.bits is None or opts.quantized_start == 0:
        return
    for i, c in enumerate(cache):
        if _plain(c) and isinstance(c.offset, int) and c.offset >= opts.quantized_start:
            cache[i] = c.to_quantized(group_size=opts.group_size, bits=opts.bits)


def kernel_note(model: Any, opts: KVOptions | None) -> str | None:
    """One line for the kernel report when custom kernels run and ``opts`` changes what they do, else None:
    the one-op decoder layers step aside (they write a float cache in place) and who runs the attention."""
    if opts is None or not opts.active:
        return None
    from ..kernels import fused_block, layers

    modules = [m for _, m in model.named_modules()]
    provider = next((m.__dict__["_kernel_provider"] for m in modules if "_kernel_provider" in m.__dict__), None)
    if provider is None:
        return None  # MLX's built-in layers: nothing steps aside
    one_op = sum(1 for m in modules if fused_block.is_one_op(m))
    parts = [f"{one_op} one-op decoder layers step aside (they write a float cache in place)"] if one_op else []
    if opts.bits is not None:
        try:
            native = layers.caps_of(provider).quantized_sdpa
        except KeyError:
            native = False
        parts.append("attention by the native quantized kernel" if native
                     else "attention by MLX's built-in quantized attention")
    else:
        parts.append("attention native while no mask is needed, else MLX's built-in")
    return f"KV cache {opts.describe()}: " + ", ".join(parts)
