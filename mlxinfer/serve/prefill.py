"""The sequences not decoding yet: their prompts prefilled in rounds between two decode steps.

* Prompts that wait together are prefilled together (``PrefillGroup``), each from what its cache holds (a
  prefix-cache hit, e.g. a shared system prompt, or nothing): merged into one ``BatchKVCache`` and run as one
  forward per chunk (a burst of 8 arrivals pays one prefill, not 8 interleaved with decode steps; the batched
  forward also costs less CPU than the 8 single ones). A lone prompt prefills alone on a plain ``KVCache`` (the
  fast single-sequence path).
* A round's budget: while streams decode, at most ``chunk`` prompt tokens times the number of waiting prompts per
  decoding stream (7 prompts arriving while 1 stream decodes stall it once for all 7, not 7 times for the same
  work), capped at ``ROUND_MAX``; ``IDLE_PREFILL`` tokens per round when no stream decodes (cancellations and
  deadlines are answered between rounds).
* Single prompts take a round's budget shortest first: a short request is never kept waiting behind a long
  prompt's whole prefill; the long one goes on with what the round leaves.
* Prompts admitted together that start alike (one system prompt) first get that start prefilled once and stored
  in the prefix cache (``prefill_shared_start``), where their admissions then find it.
"""

from __future__ import annotations

from collections import deque

from .sequence import SeqState

# Prompt tokens per round while no stream decodes. The engine answers cancellations and deadlines between rounds,
# so a round is short (512 tokens: ~0.7 s for the bundled model on 2 cores, where a whole-prompt 2048 took up to
# 12 s); prefill's rate is the same from ~48 tokens per forward on (measured: 4096 tokens in 256 / 512 / 2048-token
# forwards within the run-to-run noise).
IDLE_PREFILL = 512
ROUND_MAX = 2048  # the most prompt tokens one round takes while streams decode (then a decode step)


class Prefiller:
    """The engine's prefilling sequences (``seqs``, in admission order; a group's rows too) and their group."""

    def __init__(self, model, chunk: int, on_tokens=None):
        self.model, self.chunk = model, chunk
        self.on_tokens = on_tokens  # prompt tokens (padding not included) each forward ran: /metrics' prefill count
        self.seqs: deque[SeqState] = deque()
        self.group: PrefillGroup | None = None  # fresh prompts prefilled together
        self._groupable: bool | None = None

    def clear(self) -> None:
        self.seqs.clear()
        self.group = None

    def round(self, decoding: int) -> list[tuple[list[SeqState], list | None]]:
        """One round of prompt tokens (``decoding``: streams decoding meanwhile), the group first, then single
        prompts. Returns the sequences whose prompts are done, in order, each list with its batched cache (a
        group's rows) or None (each its own)."""
        import mlx.core as mx

        done: list[tuple[list[SeqState], list | None]] = []
        if decoding:
            budget = max(self.chunk, min(self.chunk * max(1, len(self.seqs) // decoding), ROUND_MAX))
        else:
            budget = max(self.chunk, IDLE_PREFILL)
        if self.group is None:
            self._form_group()
        if self.group is not None:
            budget -= self._group_step(budget, done)
        grouped = self.group.rows if self.group is not None else ()
        # Shortest first (ties in admission order): a short request arriving while a long prompt prefills is read
        # in the next round, not after all of it (an editor's "hi" behind a 5574-token prompt waited 19 s).
        for seq in sorted(self.seqs, key=lambda q: len(q.todo)):
            if budget <= 0:
                break
            if seq in grouped:
                continue
            chunk, seq.todo = seq.todo[:budget], seq.todo[budget:]
            if chunk:
                seq.started = True
                self.model(mx.array([chunk]), cache=seq.cache)
                mx.eval([c.state for c in seq.cache])
                budget -= len(chunk)
                self._ran(len(chunk))
            if not seq.todo:
                self.seqs.remove(seq)
                done.append(([seq], None))
        return done

    def _ran(self, tokens: int) -> None:
        if self.on_tokens is not None and tokens:
            self.on_tokens(tokens)

    def _form_group(self) -> None:
        """Prompts waiting together (two or more, not prefilling alone already) become one batched prefill."""
        waiting = [s for s in self.seqs if not s.started and s.todo]
        if len(waiting) >= 2 and self._can_group(waiting[0].cache):
            self.group = PrefillGroup(waiting)

    def _can_group(self, cache: list) -> bool:
        """Only plain KV caches batch (not rotating or quantized ones): checked once (a prefix-cache hit's caches
        are plain ones too: only those are stored)."""
        from mlx_lm.models.cache import KVCache

        if self._groupable is None:
            from ..kernels.kv_cache import InPlaceKVCache

            self._groupable = all(type(c) in (KVCache, InPlaceKVCache) for c in cache)
        return self._groupable

    def _group_step(self, budget: int, done: list) -> int:
        """The group's next forward; when it is done its rows still here (not reaped) are done."""
        group = self.group
        before = group.real_done()
        used = group.step(self.model, budget)
        self._ran(group.real_done() - before)
        if group.done:
            self.group = None
            keep = [i for i, s in enumerate(group.rows) if s in self.seqs]
            for i in keep:
                self.seqs.remove(group.rows[i])
            if keep:
                done.append(([group.rows[i] for i in keep], group.rows_cache(keep)))
        return used


class PrefillGroup:
    """Prompts prefilled together, whatever their caches hold already (nothing, a prefix-cache hit, what a lone
    prefill did so far): the caches merged by mlx-lm into one left-padded ``BatchKVCache`` per layer, the tokens
    still to prefill right-padded to one width (mlx-lm's ``BatchGenerator`` way: ``prepare(right_padding=)``, then
    ``finalize`` rolls each row's padding to its left; causal attention keeps a row's real tokens from seeing
    its padding meanwhile), run a few columns per forward. The rows' last prompt tokens are fed by their first
    decode step."""

    def __init__(self, rows: list[SeqState]):
        width = max(len(s.todo) for s in rows)
        pads = [width - len(s.todo) for s in rows]
        self.rows, self.done_cols, self.padded = rows, 0, any(pads)
        self.lengths = [len(s.todo) for s in rows]
        self.tokens = [s.todo + [0] * p for p, s in zip(pads, rows)]
        self.cache = [layer[0].merge(list(layer)) for layer in zip(*(s.cache for s in rows))]
        if self.padded:
            for c in self.cache:
                c.prepare(right_padding=pads)
        for s in rows:
            s.cache, s.todo, s.started = None, [], True

    @property
    def done(self) -> bool:
        return self.done_cols >= len(self.tokens[0])

    def real_done(self) -> int:
        """The rows' own tokens run so far (not their padding)."""
        return sum(min(n, self.done_cols) for n in self.lengths)

    def step(self, model, budget: int) -> int:
        """The next columns (at least one; ``budget`` tokens over all rows) through ``model``: tokens used."""
        import mlx.core as mx

        done = self.done_cols
        cols = max(1, budget // len(self.rows))
        chunk = [t[done:done + cols] for t in self.tokens]
        model(mx.array(chunk), cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.done_cols = done + len(chunk[0])
        if self.done and self.padded:
            for c in self.cache:
                c.finalize()
            mx.eval([c.state for c in self.cache])
        return len(self.rows) * len(chunk[0])

    def rows_cache(self, keep: list[int]) -> list:
        """The cache of rows ``keep`` (all of them, or the ones still wanted once done)."""
        if len(keep) < len(self.rows):
            for c in self.cache:
                c.filter(keep)
        return self.cache


def prefill_shared_start(model, prefix, prompts: list[list[int]], step: int = 2048) -> int:
    """Prompts admitted together that start alike (``prefix_cache.shared_start``: one chat template and system
    prompt) get that start prefilled once, continuing from what ``prefix`` holds of it, and stored there: a cold
    burst of 8 then pays for the start once instead of 8 times. Returns the tokens run through ``model`` (0 when
    nothing is shared, all of it is stored already, or the model's caches are ones the prefix cache does not
    keep: rotating or quantized)."""
    from mlx_lm.models.cache import KVCache

    from ..engine.steps import prefill
    from ..kernels.kv_cache import whole_caches
    from .prefix_cache import shared_start

    start = shared_start(prompts)
    if not start:
        return 0
    n, cache = prefix.peek(start + [-1])  # what is stored of the whole start (one token past it never matches)
    if n >= len(start):
        return 0
    cache = cache or whole_caches(model)
    if any(not isinstance(c, KVCache) for c in cache):
        return 0
    prefill(model, cache, start[n:], step)
    prefix.store(start, cache)
    return len(start) - n
