"""Continuous batching: one engine thread owns the model; requests join and leave the running batch at token
boundaries.

* A new request takes the longest stored prefix from the prefix cache, then prefills the rest alone (a plain
  ``KVCache``, the fast single-sequence path) in chunks, one chunk between two decode steps so running streams
  keep flowing.
* Prefilled sequences join the decode batch. Below ``batch_from`` sequences each decodes on its own plain
  ``KVCache`` (the native one-op-per-layer path; their steps are evaluated together); from ``batch_from`` on they
  share a left-padded ``BatchKVCache`` (mlx-lm's ``merge``/``extend``/``filter``/``extract``: one forward pass
  for all, the weights read once), and when the batch shrinks below it again the caches are extracted. Why the
  threshold: one sequence runs fastest as the one-op layers (one int offset); the batched forward runs per op
  (RoPE, KV update and attention native with per-row positions, ``kernels.kv_cache.NativeBatchKVCache``) and
  from 2 sequences on costs less than their single steps (SmolLM2, CPU time per step: 1 seq 20 ms, batched 2 /
  4 / 8 28 / 40 / 73-87 ms; before the native batched path 2 seqs were slower batched).
* Each sequence keeps its own sampler, logits processors, random state (a ``seed`` reproduces its output whatever
  else runs), stop strings, token budget and logprobs setting.
* A cancelled (client gone) or timed-out request leaves the batch before the next step; a finished one leaves
  its KV cache to the prefix cache.

Results go back to the HTTP side through ``Ticket.push`` (thread-safe, onto the request's asyncio queue).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from ..engine.generate import _holdback
from ..engine.sampling import repair_random_state
from .prefix_cache import PrefixCache
from .schemas import ApiError
from .sequence import Ticket, SeqState


class Engine:
    def __init__(self, loaded, metrics, *, parallel: int = 8, queue_size: int = 32, prefix_cache_bytes: int = 0,
                 prefill_chunk: int = 256, timeout: float | None = None, batch_from: int = 2):
        self.loaded, self.model, self.metrics = loaded, loaded.model, metrics
        self.parallel, self.queue_size, self.prefill_chunk, self.timeout = parallel, queue_size, prefill_chunk, timeout
        self.batch_from = max(1, batch_from)
        self.prefix = PrefixCache(prefix_cache_bytes)
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._prefilling: deque[SeqState] = deque()
        self._batch: list[SeqState] = []
        self._bcache: list | None = None   # BatchKVCache per layer when batched, else None (each seq has its own)
        self._stopping = False
        self._peak = 0
        self.draining = False
        self._thread = threading.Thread(target=self._run, name="mlxinfer-engine", daemon=True)

    # ---- the HTTP side ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        if self.timeout:
            ticket.deadline = ticket.arrival + self.timeout
        with self._cond:
            if self.draining or self._stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            busy = len(self._prefilling) + len(self._batch)
            if busy >= self.parallel and len(self._waiting) >= self.queue_size:
                raise ApiError(429, f"the server is busy ({busy} sequences running, {len(self._waiting)} requests "
                               "queued); retry later", code="queue_full")
            self._waiting.append(ticket)
            self.metrics.queue_depth.set(len(self._waiting))
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
                t.push(("error", ApiError(503, "the request timed out in the queue", code="timeout")))
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
            if t.cancelled or (t.deadline is not None and now > t.deadline):
                self._waiting.remove(t)
                if not t.cancelled:
                    out.append(t)
        return out

    def _admit(self, ticket: Ticket) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        if ticket.cancelled:
            return
        job = ticket.job
        n, cache = self.prefix.lookup(job.prompt)
        m = self.metrics
        m.prefix_lookups.inc()
        if n:
            m.prefix_hits.inc()
            m.prefix_tokens.inc(n)
        m.prompt_tokens.inc(len(job.prompt))
        m.prefill_tokens.inc(len(job.prompt) - n)
        seq = SeqState(ticket, cache or make_prompt_cache(self.model), n, self.loaded.tokenizer)
        self._prefilling.append(seq)
        self._update_gauges()

    def _reap(self) -> None:
        """Cancelled and timed-out requests leave (a cancelled one within a token of its client going away)."""
        now = time.perf_counter()

        def gone(s: SeqState) -> bool:
            return s.ticket.cancelled or (s.ticket.deadline is not None and now > s.ticket.deadline)

        for s in [s for s in self._prefilling if gone(s)]:
            self._prefilling.remove(s)
            self._finish(s, None)
        leaving = [i for i, s in enumerate(self._batch) if gone(s)]
        if leaving:
            self._leave(leaving, {i: None for i in leaving})

    def _prefill_step(self) -> None:
        """Up to ``prefill_chunk`` prompt tokens between two decode steps, over as many waiting sequences as they
        cover (eight short prompts arriving together start within a step or two, not eight)."""
        import mlx.core as mx

        budget = self.prefill_chunk
        while self._prefilling and budget > 0:
            seq = self._prefilling[0]
            chunk, seq.todo = seq.todo[:budget], seq.todo[budget:]
            if chunk:
                self.model(mx.array([chunk]), cache=seq.cache)
                mx.eval([c.state for c in seq.cache])
                budget -= len(chunk)
            if not seq.todo:
                self._prefilling.popleft()
                self._join(seq)

    def _join(self, seq: SeqState) -> None:
        from mlx_lm.models.cache import BatchKVCache

        self._batch.append(seq)
        if self._bcache is not None:
            for bc, c in zip(self._bcache, seq.cache):
                bc.extend(BatchKVCache.merge([c]))
            seq.cache = None
        elif len(self._batch) >= self.batch_from:
            layers = zip(*(s.cache for s in self._batch))
            self._bcache = [BatchKVCache.merge(list(caches)) for caches in layers]
            for s in self._batch:
                s.cache = None
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
        keep = [i for i in range(len(batch)) if i not in set(leaving)]
        self._batch = [batch[i] for i in keep]
        if caches is not None and len(keep) < self.batch_from:
            for i, s in zip(keep, self._batch):  # back to one fast single-sequence cache each
                s.cache = [bc.extract(i) for bc in caches]
            self._bcache = None
        elif caches is not None and len(keep) < len(batch):
            for bc in caches:
                bc.filter(keep)
        self._update_gauges()

    def _decode_step(self) -> None:
        import mlx.core as mx

        batch = self._batch
        if self._bcache is not None:
            inputs = mx.array([[s.next_input] for s in batch])
            logits = self.model(inputs, cache=self._bcache)[:, -1, :]
        else:  # one graph per sequence, evaluated together below
            logits = mx.concatenate([self.model(mx.array([[s.next_input]]), cache=s.cache)[:, -1, :]
                                     for s in batch], axis=0)
        if any(s.processors for s in batch):
            rows = []
            for i, s in enumerate(batch):
                row = logits[i:i + 1]
                if s.processors:
                    context = mx.array(s.history[-s.job.params.repeat_context:])
                    for p in s.processors:
                        row = p(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(s.greedy for s in batch):
            sampled = mx.argmax(logprobs, axis=-1)
        else:
            sampled = mx.concatenate([s.sample(logprobs[i:i + 1]) for i, s in enumerate(batch)], axis=0)
        mx.eval(sampled)
        tokens = sampled.tolist()
        entries = self._logprob_entries(logprobs, tokens)
        now = time.perf_counter()
        self.metrics.batch_size.set(len(batch))
        if len(batch) > self._peak:
            self._peak = len(batch)
            self.metrics.batch_peak.set(self._peak)
        reasons = {}
        for i, (s, tok) in enumerate(zip(batch, tokens)):
            reason = self._on_token(s, tok, entries.get(i), now)
            if reason is not None:
                reasons[i] = reason
        if reasons:
            self._leave(sorted(reasons), reasons)

    def _logprob_entries(self, logprobs, tokens: list[int]) -> dict[int, dict]:
        import mlx.core as mx

        want = [(i, s.job.logprobs) for i, s in enumerate(self._batch) if s.job.logprobs is not None]
        if not want:
            return {}
        tok = self.loaded.tokenizer
        rows = [logprobs[i] for i, _ in want]
        tops = [mx.argpartition(-r, k - 1)[:k] if k else None for r, (_, k) in zip(rows, want)]
        mx.eval(rows, [t for t in tops if t is not None])
        out = {}
        for (i, k), r, top in zip(want, rows, tops):
            alts = []
            if top is not None:
                ids = top.tolist()
                vals = r[top].tolist()
                alts = sorted(((t, tok.decode([t]), v) for t, v in zip(ids, vals)), key=lambda a: -a[2])
            out[i] = {"id": tokens[i], "token": tok.decode([tokens[i]]), "logprob": r[tokens[i]].item(), "top": alts}
        return out

    def _on_token(self, s: SeqState, tok: int, entry: dict | None, now: float) -> str | None:
        """Account one sampled token; emit text; returns the finish reason when the sequence is done."""
        m = self.metrics
        if s.generated == 0:
            m.ttft.observe(now - s.ticket.arrival)
        else:
            m.itl.observe(now - s.last)
        s.last = now
        s.generated += 1
        m.generation_tokens.inc()
        s.history.append(tok)
        s.next_input = tok
        if tok in self.loaded.eos_token_ids:
            return "stop"
        if entry is not None:
            s.pending_lp.append(entry)
        s.detok.add_token(tok)
        s.text += s.detok.last_segment
        stops = s.job.stop
        if stops:
            found = min((p for p in (s.text.find(x, max(0, s.emitted - len(x))) for x in stops) if p >= 0),
                        default=-1)
            if found >= 0:
                self._emit(s, s.text[s.emitted:found])
                s.emitted, s.stopped_by_string = len(s.text), True
                return "stop"
        safe = len(s.text) - _holdback(s.text, stops)
        if safe > s.emitted or s.pending_lp:
            self._emit(s, s.text[s.emitted:safe])
            s.emitted = max(safe, s.emitted)
        return "length" if s.generated >= s.job.max_tokens else None

    def _emit(self, s: SeqState, piece: str) -> None:
        s.ticket.push(("text", piece, s.pending_lp))
        s.pending_lp = []

    def _finish(self, s: SeqState, reason: str | None) -> None:
        """reason None: cancelled (nothing to say) or timed out (an error the client may still read)."""
        if reason is None:
            if not s.ticket.cancelled:
                s.ticket.push(("error", ApiError(503, "the request timed out", code="timeout")))
            return
        if not s.stopped_by_string:  # the held-back tail and the detokenizer's last bytes belong to the reply
            s.detok.finalize()
            s.text += s.detok.last_segment
            if len(s.text) > s.emitted or s.pending_lp:
                self._emit(s, s.text[s.emitted:])
                s.emitted = len(s.text)
        usage = {"prompt_tokens": len(s.job.prompt), "completion_tokens": s.generated,
                 "total_tokens": len(s.job.prompt) + s.generated, "cached_tokens": s.reused}
        s.ticket.push(("done", reason, usage))

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
        self._prefilling.clear()
        self._batch, self._bcache = [], None
        if error is not None:
            repair_random_state()
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self._prefilling) + len(self._batch))
        own = [c for s in [*self._prefilling, *self._batch] if s.cache is not None for c in s.cache]
        kv = sum(c.nbytes for c in [*(self._bcache or []), *own] if getattr(c, "keys", None) is not None)
        m.kv_bytes.set(kv)
        m.prefix_bytes.set(self.prefix.nbytes)

    def snapshot(self) -> dict[str, Any]:
        return {"running": len(self._prefilling) + len(self._batch), "queued": len(self._waiting),
                "prefix_cache_entries": len(self.prefix), "prefix_cache_bytes": self.prefix.nbytes}
