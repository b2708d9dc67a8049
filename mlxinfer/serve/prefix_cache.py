"""A prefix cache across requests: the KV caches of finished sequences, keyed by their tokens, bounded by bytes (LRU).

Clients resend the whole conversation every turn, so a new request usually starts with the tokens of an earlier
one; it then prefills only what follows the longest stored prefix. Entries hold their own copies of the keys and
values (never buffers a running sequence may still write in place), and ``lookup`` hands out fresh ``KVCache``
objects over them, so a hit is never changed by the request that reuses it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_MB = 512  # ``mlxinfer serve --prefix-cache-mb``'s default (and ``mlxinfer bench -b``'s engine)
MIN_REUSE = 4  # shorter matches (e.g. just the BOS and a role marker) are not worth a copy
SHARED_MIN = 16  # a start shared by prompts arriving together is prefilled once from this many tokens on


def _common_prefix(a: tuple, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_start(prompts: list[list[int]], min_len: int = SHARED_MIN) -> list[int]:
    """The longest start that two or more of ``prompts`` share, at least ``min_len`` tokens and each of them
    keeping a token of its own, else []: requests arriving together under one chat template and system prompt
    (~30 tokens for SmolLM2's), or about one document. Prompts are grouped by their first ``min_len`` tokens and
    the largest group wins."""
    groups: dict[tuple, list[list[int]]] = {}
    for p in prompts:
        if len(p) > min_len:
            groups.setdefault(tuple(p[:min_len]), []).append(p)
    best = max(groups.values(), key=len, default=[])
    if len(best) < 2:
        return []
    first = tuple(best[0])
    n = min(min(len(p) for p in best) - 1, *(_common_prefix(first, p) for p in best[1:]))
    return list(first[:n]) if n >= min_len else []


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, tuple[list, int]] = OrderedDict()  # tokens -> (per-layer (k, v), bytes)
        self._bytes = 0
        self._lock = threading.Lock()
        self.lookups = self.hits = self.reused_tokens = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, tokens: list[int], cache: list) -> None:
        """Keep a copy of ``cache`` (per-layer KVCache holding exactly ``tokens``)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        # Only caches holding every position (a sliding-window layer's rotating cache has dropped the oldest).
        if self.max_bytes <= 0 or len(tokens) < MIN_REUSE or any(not isinstance(c, KVCache) for c in cache):
            return
        n = len(tokens)
        if any(c.keys is None or c.offset < n for c in cache):
            return
        # Slicing then adding zero makes a new buffer, never an alias of a buffer the model writes in place.
        layers = [(c.keys[..., :n, :] + 0, c.values[..., :n, :] + 0) for c in cache]
        mx.eval(layers)
        size = sum(k.nbytes + v.nbytes for k, v in layers)
        if size > self.max_bytes:
            return
        key = tuple(tokens)
        with self._lock:
            for other in [k for k in self._entries if len(k) <= n and key[:len(k)] == k]:
                self._drop(other)  # the new entry covers every prefix of itself
            self._entries[key] = (layers, size)
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple) -> None:
        _, size = self._entries.pop(key)
        self._bytes -= size

    def lookup(self, tokens: list[int]) -> tuple[int, list | None]:
        """(n, cache): a fresh per-layer KVCache list holding the first n tokens of ``tokens`` (n < len(tokens), so
        at least one token is left to feed the model), or (0, None). Counted as a lookup (and a hit)."""
        return self._find(tokens, count=True)

    def peek(self, tokens: list[int]) -> tuple[int, list | None]:
        """``lookup`` without counting it: for the engine's own use (a shared start it prefills)."""
        return self._find(tokens, count=False)

    def _find(self, tokens: list[int], count: bool) -> tuple[int, list | None]:
        from mlx_lm.models.cache import KVCache

        with self._lock:
            self.lookups += count
            best, best_n = None, 0
            for key in self._entries:
                n = _common_prefix(key, tokens)
                if n > best_n:
                    best, best_n = key, n
            best_n = min(best_n, len(tokens) - 1)
            if best is None or best_n < MIN_REUSE:
                return 0, None
            self._entries.move_to_end(best)
            layers = self._entries[best][0]
            if count:
                self.hits += 1
                self.reused_tokens += best_n
        caches = []
        for k, v in layers:
            c = KVCache()
            c.keys, c.values, c.offset = k[..., :best_n, :], v[..., :best_n, :], best_n
            caches.append(c)
        return best_n, caches
