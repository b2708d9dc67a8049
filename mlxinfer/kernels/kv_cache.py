"""The KV cache the one-op decoder layers write in place: mlx-lm's ``KVCache`` plus the ownership of its buffers.

MLX arrays are values; ``decoder_layer`` (``kernels.fused_block``) writes this step's keys and values into the
two buffers it is given, at ``[offset, offset + L)``. :class:`InPlaceKVCache` says when that is safe:

* only into buffers that ``kv_reserve`` allocated for this cache (fresh memory: never a view of another array,
  never a buffer donated by one), recognised by MLX descriptor identity (``array_id``): mlx-lm's own update
  (``keys[...] = k`` rebinds the Python object to a new array) or ``cache.state = ...`` hands the cache other
  arrays, and the next call copies them into a fresh buffer instead;
* only at or past the high-water mark of what the cache ever held in that buffer: whoever took the buffer
  (``cache.state``) or a slice of it reads below the offset of that moment. After ``trim`` the next call copies
  into a fresh buffer first, so positions a holder may still read are never overwritten.

Everything else is mlx-lm's ``KVCache`` (``update_and_fetch``, ``state``, ``trim``, ``offset``, merging into a
``BatchKVCache``), so code written for mlx-lm's prompt caches keeps working. Like it, the buffers grow in steps
of ``step`` positions; they hold float16 unless ``MLXINFER_KV_DTYPE=float32`` (:func:`kv_dtype`).

:class:`InPlaceRotatingKVCache` is the same for a sliding-window layer on mlx-lm's ``RotatingKVCache``: it holds
O(window) positions under the same rules (its writes move forward in the buffer; a full one is copied).

:class:`NativeBatchKVCache` is mlx-lm's left-padded ``BatchKVCache`` (batched decode: ``mlxinfer serve``,
``bench -b``). A one-op layer writes its buffers in place under the same rules (``writable``/``written``: every row
at the shared index, each from its own ``left_padding``); a per-op layer's update is the provider's ``kv_append``
at that index, so that a batched step runs RoPE, the KV update and attention natively either way.
"""

from __future__ import annotations

import copy
import os
import weakref
from typing import Any, Callable, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlxinfer.errors import InvalidParameter

KV_DTYPE_ENV = "MLXINFER_KV_DTYPE"


def kv_dtype() -> mx.Dtype:
    """The one-op layers' KV-cache dtype: float16 (as llama.cpp's default: half the memory and half of what decode
    reads at depth; attention still computes in float32), or float32 with ``MLXINFER_KV_DTYPE=float32``."""
    name = os.environ.get(KV_DTYPE_ENV, "float16").strip().lower() or "float16"
    if name not in ("float16", "float32"):
        raise InvalidParameter(f"{KV_DTYPE_ENV}={name!r} is not a KV-cache dtype",
                               hint=f"set {KV_DTYPE_ENV} to float16 (the default) or float32")
    return mx.float16 if name == "float16" else mx.float32


class _OwnedBuffers:
    """The ownership rules of the module doc, shared by both in-place caches: which k/v buffers are the cache's own
    (kv_reserve'd for it, recognised by descriptor identity) and the buffer index writes must stay at or past."""

    # Class defaults, so that caches made by mlx-lm's ``from_state`` (no __init__) start with nothing owned.
    _owned: Optional[Tuple[mx.array, mx.array, int, int]] = None  # own handles + descriptor ids of k/v buffers
    _high_water: int = 0  # buffer index: every write so far ended here; the op writes only at or past it

    def _owns_buffers(self, provider: Any, start: int, end: int) -> bool:
        """Whether the op may write buffer indexes [start, end) of the cache's current buffers in place."""
        keys, values, owned = self.keys, self.values, self._owned
        return (owned is not None and keys is not None and start >= self._high_water and end <= keys.shape[2]
                and provider.array_id(keys) == owned[2] and provider.array_id(values) == owned[3])

    def _own(self, provider: Any, end: int) -> None:
        # Own handles keep the compared descriptor identities from being reused by other arrays.
        k, v = self.keys, self.values
        self._owned = (provider.array_handle(k), provider.array_handle(v), provider.array_id(k), provider.array_id(v))
        self._high_water = end

    def _fresh_buffers(self, provider: Any, shape: Tuple[int, int, int, int], sources: tuple, valid: int,
                       dtype: mx.Dtype) -> Optional[Tuple[mx.array, mx.array]]:
        """Fresh kv_reserve buffers ``shape`` holding the first ``valid`` positions of ``sources`` (k, v; None:
        nothing to copy), installed as the cache's own from ``valid`` on; None when the provider cannot make them
        (e.g. a cache another model filled: other shapes or dtype)."""
        try:
            k, v = (provider.kv_reserve(shape, src, valid=valid if src is not None else 0, dtype=dtype)
                    for src in sources)
        except (ValueError, TypeError):
            return None
        self.keys, self.values = k, v
        self._own(provider, valid)  # a fresh buffer starts with what it copied
        return k, v


class InPlaceKVCache(KVCache, _OwnedBuffers):
    """mlx-lm's ``KVCache`` whose buffers a one-op layer may write in place (rules in the module doc)."""

    @classmethod
    def adopt(cls, cache: Any) -> Optional["InPlaceKVCache"]:
        """``cache`` as an InPlaceKVCache: itself, or a plain mlx-lm ``KVCache`` made elsewhere (e.g. a server's
        prefix-cache copy) turned into one, owning nothing yet (so the first write copies); None otherwise."""
        if isinstance(cache, cls):
            return cache
        if type(cache) is KVCache:
            cache.__class__ = cls
            return cache
        return None

    def writable(self, provider: Any, head_shape: Tuple[int, int, int],
                 L: int) -> Optional[Tuple[mx.array, mx.array, int, int]]:
        """(k_buf, v_buf, write, first) for ``decoder_layer``, as InPlaceRotatingKVCache's: the buffers (installed in
        the cache: its own when they qualify, else fresh copies with room), this step's keys written at ``offset``
        and every key attended (first 0); None when the provider cannot make buffers."""
        keys, values, offset = self.keys, self.values, self.offset
        if self._owns_buffers(provider, offset, offset + L):
            return keys, values, offset, 0
        B, H, D = head_shape
        capacity = (offset + L + self.step - 1) // self.step * self.step
        keep = keys is not None and offset > 0
        fresh = self._fresh_buffers(provider, (B, H, capacity, D), (keys, values) if keep else (None, None), offset,
                                    kv_dtype())
        return None if fresh is None else (*fresh, offset, 0)

    def written(self, provider: Any, k: mx.array, v: mx.array, write: int, first: int, n: int) -> None:
        """After ``decoder_layer`` wrote n positions at ``write`` (= the offset here; ``first`` is always 0): hold
        its outputs (the same memory; evaluating them runs the op, as mlx-lm's ``mx.eval(cache.state)`` does) and
        move the offset and high-water mark."""
        self.keys, self.values = k, v
        self.offset += n
        self._own(provider, self.offset)


class InPlaceRotatingKVCache(RotatingKVCache, _OwnedBuffers):
    """mlx-lm's ``RotatingKVCache`` (``keep`` 0) of a one-op sliding-window layer: it holds O(window) positions,
    and its buffers the op writes in place under the module doc's rules (writes only past the high-water mark).

    Layout: ``keys``/``values`` are whole kv_reserve buffers whose valid entries, in temporal order, are
    ``[_first, _first + _idx)``. Each step keeps the last ``max_size - 1`` of them and appends L, as mlx-lm's
    ``_update_concat`` does (its decode ring holds the same keys in another order; attention does not care), so
    the oldest kept entry moves forward in the buffer; when the buffer is full the kept entries go to a fresh
    one with room for ``max_size // 4`` more steps (one copy of the window every window/4 decode steps).
    ``state`` is mlx-lm's (temporal order, ``_idx`` entries), so ``trim``, ``make_mask``, ``size``, merging into
    a ``BatchRotatingKVCache`` and mlx-lm's own update (when the op declines a call) keep working."""

    _first: int = 0  # buffer index of the oldest valid entry

    @classmethod
    def adopt(cls, cache: Any, window: int) -> Optional["InPlaceRotatingKVCache"]:
        """``cache`` as an InPlaceRotatingKVCache of ``window`` positions: itself, or mlx-lm's own (e.g. one
        ``BatchRotatingKVCache.extract`` made) turned into one, owning nothing yet; None otherwise."""
        if type(cache) is RotatingKVCache and cache.keep == 0 and cache.max_size == window:
            state = cache.state
            cache.__class__ = cls
            cache.state = state  # its layout (perhaps rotated) into temporal order
        if isinstance(cache, cls) and cache.keep == 0 and cache.max_size == window:
            return cache
        return None

    def _temporal_order(self, v: mx.array) -> mx.array:
        return v[..., self._first:self._first + self._idx, :]

    def keys_and_values(self) -> Tuple[mx.array, mx.array]:
        return self._temporal_order(self.keys), self._temporal_order(self.values)

    @property
    def state(self):
        if self.keys is None:
            return None, None, self.offset, self.keep, self.max_size, self._idx
        k, v = self.keys_and_values()
        return k, v, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v
        self._first, self._owned = 0, None
        if self.keys is not None:  # mlx-lm's layout (perhaps rotated) -> temporal order from 0
            self.keys = RotatingKVCache._temporal_order(self, self.keys)
            self.values = RotatingKVCache._temporal_order(self, self.values)
            self._idx = self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """mlx-lm's update for a call the op does not take: its concatenating update (for L = 1 too: the same
        keys as its ring, in temporal order), which leaves the layout above with ``_first`` 0."""
        self._owned = None
        out = self._update_concat(keys, values)
        self._first = 0
        return out

    def writable(self, provider: Any, head_shape: Tuple[int, int, int],
                 L: int) -> Optional[Tuple[mx.array, mx.array, int, int]]:
        """(k_buf, v_buf, write, first) for ``decoder_layer``: the buffers (installed in the cache), the buffer index
        of this step's first key and of the oldest key to attend; None when the provider cannot make buffers."""
        keys, values, n = self.keys, self.values, self._idx if self.keys is not None else 0
        kept = min(n, self.max_size - 1)
        end = self._first + n
        if self._owns_buffers(provider, end, end + L):
            return keys, values, end, end - kept
        B, H, D = head_shape
        need, window = kept + L, self.max_size
        limit = window + max(window // 4, 1)  # the most a decode step keeps: the window and room for window/4
        capacity = max(need, limit) if need >= window else min((need + self.step - 1) // self.step * self.step,
                                                                limit)
        src = (self._temporal_order(keys)[..., n - kept:, :], self._temporal_order(values)[..., n - kept:, :]) \
            if kept else (None, None)
        fresh = self._fresh_buffers(provider, (B, H, capacity, D), src, kept, kv_dtype())
        if fresh is None:
            return None
        self._first, self._idx = 0, kept
        return (*fresh, kept, 0)

    def written(self, provider: Any, k: mx.array, v: mx.array, write: int, first: int, n: int) -> None:
        """After ``decoder_layer`` wrote n keys at ``write``: hold its outputs (see InPlaceKVCache.written), the
        kept entries now ``[first, write + n)``."""
        self.keys, self.values = k, v
        self._first, self._idx = first, write + n - first
        self.offset += n
        self._own(provider, write + n)


class NativeBatchKVCache(BatchKVCache, _OwnedBuffers):
    """mlx-lm's ``BatchKVCache`` updated natively: by a one-op layer in place (``writable``/``written``, the
    module doc's rules) or by one native op per buffer (``append``: ``kv_append`` writes in place only when
    nothing else holds them). ``merge``, ``extend``, ``filter``, ``extract``, ``trim`` and ``state`` are mlx-lm's:
    each rebinds the buffers (or moves the index back), so the next in-place write copies into fresh ones."""

    _provider: Any = None  # set by adopt(); a cache made by merge() (cls(...)) runs mlx-lm's update until then

    @classmethod
    def adopt(cls, cache: Any, provider: Any) -> Optional["NativeBatchKVCache"]:
        """``cache`` (a plain mlx-lm ``BatchKVCache`` or one of ours) as a NativeBatchKVCache updated through
        ``provider``; None for anything else."""
        if type(cache) is BatchKVCache:
            cache.__class__ = cls
        elif not isinstance(cache, cls):
            return None
        cache._provider = provider
        return cache

    def __deepcopy__(self, memo: dict) -> "NativeBatchKVCache":
        """mlx-lm's ``BatchGenerator.split`` deep-copies its caches: the arrays are copied, the provider (it holds
        the native module, which cannot be copied) is shared."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_owned":  # the copy owns nothing: its first in-place write copies
                continue
            new.__dict__[key] = value if key == "_provider" else copy.deepcopy(value, memo)
        return new

    def writable(self, provider: Any, head_shape: Tuple[int, int, int],
                 L: int) -> Optional[Tuple[mx.array, mx.array, int]]:
        """(k_buf, v_buf, write) for a batched ``decoder_layer``: the buffers (installed in the cache: its own when
        they qualify, else fresh copies with room) and the shared index every row writes this step's keys at
        (row b attends from ``left_padding[b]``); None when the provider cannot make buffers. A right-padded
        prefill (mlx-lm's ``prepare(right_padding=)``) is taken too: attention is causal, so a row's real tokens
        never see its padding, which ``finalize`` then rolls to the row's left (a new buffer)."""
        keys, values, prev = self.keys, self.values, self._idx
        if self._owns_buffers(provider, prev, prev + L):
            return keys, values, prev
        B, H, D = head_shape
        capacity = (prev + L + self.step - 1) // self.step * self.step
        keep = keys is not None and prev > 0
        dtype = keys.dtype if keys is not None and keys.dtype in (mx.float16, mx.float32) else kv_dtype()
        fresh = self._fresh_buffers(provider, (B, H, capacity, D), (keys, values) if keep else (None, None), prev,
                                    dtype)
        return None if fresh is None else (*fresh, prev)

    def written(self, provider: Any, k: mx.array, v: mx.array, n: int) -> None:
        """After ``decoder_layer`` wrote n positions of every row at ``_idx``: hold its outputs (see
        InPlaceKVCache.written), move the index, the per-row offsets and the high-water mark."""
        self.keys, self.values = k, v
        self.offset = self.offset + n
        self._idx += n
        self._own(provider, self._idx)

    def append(self, keys: mx.array, values: mx.array) -> Optional[Tuple[mx.array, mx.array, int]]:
        """Write keys/values (B, H, L, D) at the shared index ``_idx`` (every row's next position; rows are
        left-padded) as ``update_and_fetch`` does: (k_buf, v_buf, valid length), the buffers whole, or None when
        the provider declines (nothing changed then)."""
        provider, prev, n = self._provider, self._idx, keys.shape[2]
        if provider is None or self._right_padding is not None:
            return None
        k_buf, v_buf = self.keys, self.values
        # Not _fresh_buffers: it owns the buffers (keeps handles on them), and a handle held here would stop
        # kv_append from writing in place (it does so only when nothing else holds them) and keep a stale copy.
        try:
            if k_buf is None or prev + n > k_buf.shape[2]:  # grow (mlx-lm: zeros + concatenate) as one copy each
                capacity = (prev + n + self.step - 1) // self.step * self.step
                dtype = k_buf.dtype if k_buf is not None else kv_dtype()
                keep = k_buf is not None and prev > 0
                k_buf = provider.kv_reserve((*keys.shape[:2], capacity, keys.shape[3]), k_buf if keep else None,
                                            valid=prev if keep else 0, dtype=dtype)
                v_buf = provider.kv_reserve((*values.shape[:2], capacity, values.shape[3]),
                                            v_buf if keep else None, valid=prev if keep else 0, dtype=dtype)
        except (ValueError, TypeError):
            return None
        out = provider.kv_append(k_buf, v_buf, keys, values, prev)
        if out is None:
            return None
        self.keys, self.values = out
        self.offset = self.offset + n
        self._idx = prev + n
        return out[0], out[1], self._idx

    def attention_start(self, mask: Any, L: int, S: int) -> Optional[mx.array]:
        """``left_padding`` (each row's first real key) when ``mask`` is this cache's ``make_mask`` for L queries
        over its S keys (then attention with it is causal + that start per row), else None."""
        if (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[1] == 1
                and mask.shape[2] == L and mask.shape[3] == S == self._idx and self._right_padding is None):
            return self.left_padding
        return None

    def update_and_fetch(self, keys, values):
        got = self.append(keys, values)
        if got is None:
            return super().update_and_fetch(keys, values)
        k, v, n = got
        return k[..., :n, :], v[..., :n, :]


def whole_caches(model: Any) -> list:
    """``make_prompt_cache(model)`` with each one-op sliding-window layer's InPlaceRotatingKVCache replaced by an
    InPlaceKVCache that keeps every position (the op, and mlx-lm's code with the model's window mask, attend only
    the window either way): what a server needs to batch such a model's requests (mlx-lm merges, extends,
    filters and extracts plain caches; prefix-cache entries hold every position). The cost is memory: those
    layers hold the whole context instead of the window."""
    from mlx_lm.models.cache import make_prompt_cache

    return [InPlaceKVCache() if type(c) is InPlaceRotatingKVCache and c.keys is None else c
            for c in make_prompt_cache(model)]


def own_make_cache(model: Any) -> Optional[Callable[[Any], list]]:
    """The model's own cache factory, called with the model: its class' ``make_cache``, or for a multimodal
    wrapper without one (mlx-lm's ``mistral3`` around ``ministral3``) its text model's, when that model's layers
    are the wrapper's. mlx-lm's ``make_prompt_cache`` gives such a wrapper a plain ``KVCache`` per layer, so its
    sliding-window layers would hold the whole context instead of the window (the mask keeps the maths right)."""
    own = getattr(type(model), "make_cache", None)
    if own is not None:
        return own
    text = getattr(model, "language_model", None)
    text_own = getattr(type(text), "make_cache", None) if text is not None else None
    outer, inner = list(getattr(model, "layers", None) or []), list(getattr(text, "layers", None) or [])
    if text_own is None or not outer or len(outer) != len(inner) or any(a is not b for a, b in zip(outer, inner)):
        return None
    return lambda m: text_own(m.language_model)


def prompt_caches(model: Any) -> list:
    """A fresh prompt cache: mlx-lm's ``make_prompt_cache`` (the model's ``make_cache`` when it has one, the one
    ``cache_maker`` set included), or for a wrapper without one its text model's (:func:`own_make_cache`:
    window-sized caches for sliding layers)."""
    from mlx_lm.models.cache import make_prompt_cache

    own = None if hasattr(model, "make_cache") else own_make_cache(model)
    return own(model) if own is not None else make_prompt_cache(model)


def cache_maker(model: Any, windowed: frozenset = frozenset()) -> Callable[[], list]:
    """A ``make_cache`` for ``model``: what its own factory makes (:func:`own_make_cache`; without one, what
    mlx-lm's ``make_prompt_cache`` makes: a ``KVCache`` per layer), each plain ``KVCache`` an InPlaceKVCache; so are the
    ``RotatingKVCache``s of the layers in ``windowed`` (one-op sliding-window layers) InPlaceRotatingKVCaches
    of the same size. It holds the model weakly, so that setting it on the model
    makes no reference cycle (the weights go with the model)."""
    own = own_make_cache(model)
    ref = weakref.ref(model)

    def make_cache() -> list:
        model = ref()
        caches = own(model) if own is not None else [KVCache() for _ in model.layers]
        return [InPlaceRotatingKVCache(c.max_size) if i in windowed and type(c) is RotatingKVCache and c.keep == 0
                else InPlaceKVCache.adopt(c) or c for i, c in enumerate(caches)]

    return make_cache
