"""Continuous batching: one engine thread owns the model; requests join and leave the running batch at token
boundaries.

* A new request takes the longest stored prefix from the prefix cache; prompts admitted together that start alike
  (one system prompt) first get that start prefilled once and stored there. Prompts are then prefilled in rounds
  between two decode steps (``serve.prefill``: prompts waiting together as one batched forward per chunk, a
  round's budget scaled by the prompts waiting per decoding stream), so that decoding streams keep flowing.
* Prefilled sequences join the decode batch. Below ``batch_from`` sequences each decodes on its own plain
  ``KVCache`` (the native one-op-per-layer path; their steps are evaluated together); from ``batch_from`` on they
  share a left-padded ``BatchKVCache`` (mlx-lm's ``merge``/``extend``/``filter``/``extract``: one forward pass
  for all, the weights read once), and when the batch shrinks below it again the caches are extracted. Why the
  threshold: one sequence runs fastest on its own cache (one int offset); the batched forward runs the same
  one-op layers with each row's first key and position (``kernels.kv_cache.NativeBatchKVCache``) and from 2
  sequences on costs less than their single steps.
* Decode is pipelined: step N+1's graph is built on step N's sampled tokens (still lazy) while step N evaluates,
  then step N's tokens are read back, detokenised and pushed, then step N+1 goes to ``mx.async_eval``. (mlx-lm's
  ``generate_step`` starts N+1 before reading N back; on the CPU ``async_eval`` returns only when at most ~10 ops
  are left to run, so that order would hold every token back by most of a step.) A sequence that ends on EOS or a
  stop string has a row in the graph already built (dropped; no step runs once every row has left); one that
  ends by its token budget is read back before the next graph is built.
* Each sequence keeps its own sampler, logits processors, random state (a ``seed`` reproduces its output whatever
  else runs), stop strings, token budget and logprobs setting. ``logsumexp`` runs only when a row wants logprobs
  (the samplers are shift-invariant: they get the logits minus their max, as ``engine.steps`` does).
* A cancelled (client gone) or timed-out request leaves the batch before the next step; a finished one leaves
  its KV cache to the prefix cache.

Results go back to the HTTP side through ``Ticket.push`` (thread-safe, onto the request's asyncio queue).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from ..engine.backend import release_thread_state
from ..engine.sampling import repair_random_state
from .prefill import Prefiller, prefill_shared_start
from .prefix_cache import PrefixCache
from .schemas import ApiError
from .sequence import SeqState, Ticket, logprob_entries


class _Step:
    """A dispatched decode step: its rows (the batch then) and their sampled tokens (and logprobs), still lazy."""

    __slots__ = ("rows", "sampled", "logprobs")

    def __init__(self, rows: list, sampled, logprobs):
        self.rows, self.sampled, self.logprobs = rows, sampled, logprobs


class Engine:
    def __init__(self, loaded, metrics, *, parallel: int = 8, queue_size: int = 32, prefix_cache_bytes: int = 0,
                 prefill_chunk: int = 256, timeout: float | None = None, batch_from: int = 2,
                 on_step: Callable[[int, float], None] | None = None,
                 on_warning: Callable[[str], None] | None = None):
        self.loaded, self.model, self.metrics = loaded, loaded.model, metrics
        self.on_step = on_step  # (rows, perf_counter) after each decode step is read back: bench's clock
        self.on_warning = on_warning  # one line for the operator, the first time a recovered error of a kind occurs
        self._warned: set[str] = set()
        self.parallel, self.queue_size, self.prefill_chunk, self.timeout = parallel, queue_size, prefill_chunk, timeout
        self.batch_from = max(1, batch_from)
        self.prefix = PrefixCache(prefix_cache_bytes)
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self.prefill = Prefiller(self.model, prefill_chunk, on_tokens=metrics.prefill_tokens.inc)
        self._prefilling = self.prefill.seqs   # every sequence not yet decoding (a prefill group's rows too)
        self._batch: list[SeqState] = []
        self._bcache: list | None = None   # BatchKVCache per layer when batched, else None (each seq has its own)
        self._step: _Step | None = None    # the decode step dispatched and not read back yet
        self._stopping = False
        self._peak = 0
        self.draining = False
        self._end_all_at: float | None = None  # shutting down: requests still running then end with a 503
        self._thread = threading.Thread(target=self._thread_main, name="mlxinfer-engine", daemon=True)

    # ---- the HTTP side ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it ends only when stopped, or on a bug outside a step)."""
        return self._thread.is_alive()

    def submit(self, ticket: Ticket) -> None:
        if self.timeout:
            ticket.deadline = ticket.arrival + self.timeout
        with self._cond:
            if self.draining or self._stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            busy = len(self._prefilling) + len(self._batch)
            # --parallel run and --queue-size wait: counted together, so a burst that arrives before the engine
            # thread admits any (all of it still waiting) is bounded too.
            if busy + len(self._waiting) >= self.parallel + self.queue_size:
                queued = len(self._waiting)
                raise ApiError(429, f"the server is busy ({busy} sequence{'s' * (busy != 1)} running, {queued} "
                               f"request{'s' * (queued != 1)} queued); retry later", code="queue_full")
            self._waiting.append(ticket)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def end_all_at(self, when: float) -> None:
        """At ``when`` (perf_counter), whatever still runs or waits ends with 'the server is shutting down'."""
        with self._cond:
            self._end_all_at = when
            self._cond.notify()

    def cancel(self, ticket: Ticket) -> None:
        with self._cond:
            ticket.cancelled = True
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            self._run()
        finally:
            release_thread_state()  # else the thread's exit can abort a process that is already finalizing

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._prefilling or self._batch):
                    self._cond.wait()
                if self._stopping:
                    break
                new = []
                while self._waiting and len(self._prefilling) + len(self._batch) + len(new) < self.parallel:
                    new.append(self._waiting.popleft())
                expired = self._expired_waiting()
                self.metrics.queue_depth.set(len(self._waiting))
            for t in expired:
                t.push(("error", self._ended_error(queued=True)))
            try:
                self._prefill_shared_start(new)
            except Exception as e:  # noqa: BLE001 - an optimisation only: each request then prefills all its prompt
                self._recovered("shared_start", f"the shared-start prefill failed ({type(e).__name__}: {e}); "
                                "requests admitted together prefill their whole prompts")
            for t in new:
                try:
                    self._admit(t)
                except Exception as e:  # noqa: BLE001 - e.g. a cache the model cannot make: this request fails
                    t.push(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}")))
            try:
                self._reap()
                if self._prefilling:
                    self._prefill_step()
                if self._batch:
                    self._decode_step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                self._fail_all(e)
        self._fail_all(None)

    def _expired_waiting(self) -> list[Ticket]:
        now, out = time.perf_counter(), []
        for t in list(self._waiting):
            if t.cancelled or (t.deadline is not None and now > t.deadline) or self._ending(now):
                self._waiting.remove(t)
                if not t.cancelled:
                    out.append(t)
        return out

    def _recovered(self, stage: str, line: str) -> None:
        """An error the engine went on from: counted in /metrics, and told through on_warning once per stage."""
        self.metrics.engine_errors.labels(stage=stage).inc()
        if self.on_warning is not None and stage not in self._warned:
            self._warned.add(stage)
            self.on_warning(line)

    def _prefill_shared_start(self, tickets: list[Ticket]) -> None:
        """A start shared by prompts admitted together, prefilled once into the prefix cache (``sequence.
        prefill_shared_start``), where their admissions then find it."""
        if self.prefix.max_bytes > 0 and len(tickets) >= 2:
            done = prefill_shared_start(self.model, self.prefix, [t.job.prompt for t in tickets if not t.cancelled])
            self.metrics.prefill_tokens.inc(done)

    def _admit(self, ticket: Ticket) -> None:
        from ..kernels.kv_cache import whole_caches

        if ticket.cancelled:
            return
        job = ticket.job
        n, cache = self.prefix.lookup(job.prompt)
        m = self.metrics
        m.prefix_lookups.inc()
        if n:
            m.prefix_hits.inc()
            m.prefix_tokens.inc(n)
        m.prompt_tokens.inc(len(job.prompt))  # prefill_tokens: counted as the forwards run them (Prefiller, _join)
        # Whole caches (a one-op sliding layer's too): they batch, merge and go to the prefix cache.
        seq = SeqState(ticket, cache or whole_caches(self.model), n, self.loaded.tokenizer)
        self._prefilling.append(seq)
        self._update_gauges()

    def _gone(self, s: SeqState, now: float) -> bool:
        """The client went away, the request's deadline passed, or the shutdown's did."""
        return s.ticket.cancelled or (s.ticket.deadline is not None and now > s.ticket.deadline) or \
            self._ending(now)

    def _ending(self, now: float) -> bool:
        return self._end_all_at is not None and now >= self._end_all_at

    def _reap(self) -> None:
        """Cancelled and timed-out requests leave (a cancelled one within a token of its client going away). A row
        of a batched prefill is answered now and dropped from its group's cache when the group is done (only
        here, at the start of a round: under ``mlx.launch`` every rank must drop the same rows)."""
        now = time.perf_counter()
        for s in [s for s in self._prefilling if self._gone(s, now)]:
            self._prefilling.remove(s)
            self._finish(s, None)
        leaving = [i for i, s in enumerate(self._batch) if self._gone(s, now)]
        if leaving:
            self._leave(leaving, {i: None for i in leaving})

    # ---- prefill --------------------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        """One round of prompt tokens between two decode steps (``Prefiller.round``); finished prompts join."""
        for seqs, gcache in self.prefill.round(len(self._batch)):
            self._join(seqs, gcache)

    # ---- the decode batch -------------------------------------------------------------------------------------
    def _join(self, seqs: list[SeqState], gcache: list | None = None) -> None:
        """Prefilled sequences join the batch: each with its own cache, or the rows of a batched ``gcache``."""
        def merged(group: list[SeqState]) -> list:  # mlx-lm's merge per cache type (rotating: BatchRotatingKVCache)
            return [caches[0].merge(list(caches)) for caches in zip(*(s.cache for s in group))]

        if len(self._batch) + len(seqs) < self.batch_from:
            if gcache is not None:  # too few to batch: each row its own fast single-sequence cache
                for i, s in enumerate(seqs):
                    s.cache = [c.extract(i) for c in gcache]
        else:
            new = gcache if gcache is not None else merged(seqs)
            if self._bcache is None and self._batch:
                self._bcache = merged(self._batch)
            if self._bcache is None:
                self._bcache = new
            else:
                for bc, c in zip(self._bcache, new):
                    bc.extend(c)
            for s in [*self._batch, *seqs]:
                s.cache = None
        self._batch += seqs
        self.metrics.prefill_tokens.inc(len(seqs))  # each one's last prompt token goes in with its first step
        self._update_gauges()

    def _leave(self, leaving: list[int], reasons: dict[int, str | None]) -> None:
        """Remove batch rows ``leaving``; rows with a finish reason leave their KV cache to the prefix cache."""
        batch, caches = self._batch, self._bcache
        for i in leaving:
            seq = batch[i]
            if reasons[i] is not None and self.prefix.max_bytes > 0:
                own = seq.cache if caches is None else [bc.extract(i) for bc in caches]
                self.prefix.store(seq.history[:-1], own)
            self._finish(seq, reasons[i])
            seq.cache = None
        out = set(leaving)
        keep = [i for i in range(len(batch)) if i not in out]
        self._batch = [batch[i] for i in keep]
        if self._step is not None and not any(s in self._batch for s in self._step.rows):
            self._step = None  # nothing it computed is wanted any more
        if caches is not None and len(keep) < self.batch_from:
            for i, s in zip(keep, self._batch):  # back to one fast single-sequence cache each
                s.cache = [bc.extract(i) for bc in caches]
            self._bcache = None
        elif caches is not None and len(keep) < len(batch):
            for bc in caches:
                bc.filter(keep)
        self._update_gauges()

    def _decode_step(self) -> None:
        """Build the next step on the previous one's (lazy) tokens, read the previous one back, start the next."""
        import mlx.core as mx

        step = self._step
        if step is not None and any(s.generated + 1 >= s.job.max_tokens for s in step.rows):
            self._collect()  # a row ends by its budget with these tokens: no step past it
            step = None
            if not self._batch:
                return
        self._step = self._dispatch(step)
        if step is not None:
            self._collect(step)  # may drop self._step when every row has left
        if self._step is not None:
            mx.async_eval(self._step.sampled, *([self._step.logprobs] if self._step.logprobs is not None else []))

    def _dispatch(self, prev: _Step | None) -> _Step:
        """The next step's graph (not evaluated yet) for the batch as it is now."""
        import mlx.core as mx

        batch = self._batch
        lazy: list[int] = []  # rows whose input is prev's sampled token (they come first: joins append)
        if prev is not None:
            where = {id(s): j for j, s in enumerate(prev.rows)}
            lazy = [where[id(s)] for s in batch if id(s) in where]
        known = [s.next_input for s in batch[len(lazy):]]
        parts = []
        if lazy:
            parts.append(prev.sampled if lazy == list(range(len(prev.rows))) else prev.sampled[mx.array(lazy)])
        if known:
            parts.append(mx.array(known, dtype=mx.uint32))  # the samplers' dtype
        inputs = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        if self._bcache is not None:
            logits = self.model(inputs[:, None], cache=self._bcache)[:, -1, :]
        else:  # one graph per sequence, evaluated together below
            logits = mx.concatenate([self.model(inputs[i:i + 1][None], cache=s.cache)[:, -1, :]
                                     for i, s in enumerate(batch)], axis=0)
        if any(s.processors for s in batch):
            rows = []
            for i, s in enumerate(batch):
                row = logits[i:i + 1]
                if s.processors:
                    n = s.job.params.repeat_context
                    if i >= len(lazy):
                        context = mx.array(s.history[-n:], dtype=mx.uint32)
                    elif n > 1:  # the history so far and the token still being computed
                        context = mx.concatenate([mx.array(s.history[-(n - 1):], dtype=mx.uint32), inputs[i:i + 1]])
                    else:
                        context = inputs[i:i + 1]
                    for p in s.processors:
                        row = p(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = None
        if any(s.job.logprobs is not None for s in batch):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(s.greedy for s in batch):
            sampled = mx.argmax(logits, axis=-1)
        else:
            shifted = logits - mx.max(logits, axis=-1, keepdims=True)
            sampled = mx.concatenate([mx.argmax(shifted[i:i + 1], axis=-1) if s.greedy else s.sample(shifted[i:i + 1])
                                      for i, s in enumerate(batch)], axis=0)
        return _Step(list(batch), sampled, logprobs)

    def _collect(self, step: _Step | None = None) -> None:
        """Read a dispatched step's tokens back: account, detokenise, push; finished rows leave."""
        if step is None:
            step, self._step = self._step, None
        tokens = step.sampled.tolist()
        now = time.perf_counter()
        n = len(step.rows)
        if self.on_step is not None:
            self.on_step(n, now)
        entries = logprob_entries(step.rows, step.logprobs, tokens, self.loaded.tokenizer)
        self.metrics.batch_size.set(n)
        if n > self._peak:
            self._peak = n
            self.metrics.batch_peak.set(n)
        index = {id(s): i for i, s in enumerate(self._batch)}
        reasons = {}
        for j, (s, tok) in enumerate(zip(step.rows, tokens)):
            i = index.get(id(s))
            if i is None:  # it left meanwhile (cancelled)
                continue
            reason = self._on_token(s, tok, entries.get(j), now)
            if reason is not None:
                reasons[i] = reason
        if reasons:
            self._leave(sorted(reasons), reasons)

    def _on_token(self, s: SeqState, tok: int, entry: dict | None, now: float) -> str | None:
        """Account one sampled token and hand it to its sequence; returns the finish reason when it is done."""
        m = self.metrics
        if s.generated == 0:
            m.ttft.observe(now - s.ticket.arrival)
        else:
            m.itl.observe(now - s.last)
        s.last = now
        m.generation_tokens.inc()
        return s.add(tok, entry, self.loaded.eos_token_ids)

    def _finish(self, s: SeqState, reason: str | None) -> None:
        """reason None: cancelled (nothing to say) or timed out (an error the client may still read)."""
        if reason is None:
            if not s.ticket.cancelled:
                s.ticket.push(("error", self._ended_error()))
            return
        s.close(reason)

    def _ended_error(self, queued: bool = False) -> ApiError:
        if self._ending(time.perf_counter()):
            return ApiError(503, "the server is shutting down before this request finished (its --grace ran out)",
                            code="shutting_down")
        return ApiError(503, "the request timed out" + (" in the queue" if queued else "") +
                        (f" (the server's --timeout is {self.timeout:g} s)" if self.timeout else ""), code="timeout")

    def _fail_all(self, error: Exception | None) -> None:
        """An exception in a step (or the engine stopping) ends every request it holds with a 500/503."""
        err = ApiError(500, f"internal error: {type(error).__name__}: {error}") if error is not None else \
            ApiError(503, "the server is shutting down", code="shutting_down")
        seqs = list(self._prefilling) + self._batch
        with self._cond:
            waiting = list(self._waiting) if error is None else []
            if error is None:
                self._waiting.clear()
        for s in seqs:
            s.ticket.push(("error", err))
        for t in waiting:
            t.push(("error", err))
        self.prefill.clear()
        self._batch, self._bcache, self._step = [], None, None
        if error is not None:
            repair_random_state()
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self._prefilling) + len(self._batch))
        own = [c for s in [*self._prefilling, *self._batch] if s.cache is not None for c in s.cache]
        group = self.prefill.group.cache if self.prefill.group else []
        kv = sum(c.nbytes for c in [*(self._bcache or []), *group, *own] if getattr(c, "keys", None) is not None)
        m.kv_bytes.set(kv)
        m.prefix_bytes.set(self.prefix.nbytes)

    def snapshot(self) -> dict[str, Any]:
        return {"running": len(self._prefilling) + len(self._batch), "queued": len(self._waiting),
                "prefix_cache_entries": len(self.prefix), "prefix_cache_bytes": self.prefix.nbytes}
