"""One request inside the engine: its ``Ticket`` (what the HTTP side holds) and its decoding state (``SeqState``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..engine.generate import _holdback
from ..engine.sampling import make_logits_processors, make_sampler
from .schemas import Job


@dataclass
class Ticket:
    """One request's handle: the job, where its events go, and whether the client still wants them.

    Events: ("text", piece, [logprob entries]), ("done", finish_reason, usage), ("error", ApiError)."""

    job: Job
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    deadline: float | None = None
    cancelled: bool = False

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class SeqState:
    def __init__(self, ticket: Ticket, cache: list, reused: int, tokenizer):
        import mlx.core as mx

        job = ticket.job
        self.ticket, self.job, self.cache, self.reused = ticket, job, cache, reused
        self.todo = job.prompt[reused:-1]           # prompt tokens still to prefill (the last one is fed by decode)
        self.started = False                        # its prompt is in a batched prefill or prefilling alone
        self.next_input = job.prompt[-1]
        self.history = list(job.prompt)             # prompt + generated: what the repetition penalty looks at
        self.generated = 0
        self.sampler = make_sampler(job.params)
        self.greedy = job.params.temperature == 0
        self.processors = make_logits_processors(job.params)
        self.rng = mx.random.key(job.params.seed) if job.params.seed is not None and not self.greedy else None
        self.detok = tokenizer.detokenizer
        self.text, self.emitted, self.last = "", 0, 0.0
        self.pending_lp: list[dict] = []
        self.stopped_by_string = False

    def add(self, tok: int, entry: dict | None, eos: set) -> str | None:
        """Take one sampled token: emit the text that is safe to show (not a possible stop-string start);
        returns the finish reason when the sequence is done."""
        self.generated += 1
        self.history.append(tok)
        self.next_input = tok
        if tok in eos and not self.job.ignore_eos:
            return "stop"
        if entry is not None:
            self.pending_lp.append(entry)
        self.detok.add_token(tok)
        self.text += self.detok.last_segment
        stops = self.job.stop
        if stops:
            found = min((p for p in (self.text.find(x, max(0, self.emitted - len(x))) for x in stops) if p >= 0),
                        default=-1)
            if found >= 0:
                self.emit(self.text[self.emitted:found])
                self.emitted, self.stopped_by_string = len(self.text), True
                return "stop"
            safe = len(self.text) - _holdback(self.text, stops)
        else:
            safe = len(self.text)
        if safe > self.emitted or self.pending_lp:
            self.emit(self.text[self.emitted:safe])
            self.emitted = max(safe, self.emitted)
        return "length" if self.generated >= self.job.max_tokens else None

    def emit(self, piece: str) -> None:
        self.ticket.push(("text", piece, self.pending_lp))
        self.pending_lp = []

    def close(self, reason: str) -> None:
        """The held-back tail and the detokenizer's last bytes belong to the reply; then the usage."""
        if not self.stopped_by_string:
            self.detok.finalize()
            self.text += self.detok.last_segment
            if len(self.text) > self.emitted or self.pending_lp:
                self.emit(self.text[self.emitted:])
                self.emitted = len(self.text)
        prompt = len(self.job.prompt)
        usage = {"prompt_tokens": prompt, "completion_tokens": self.generated,
                 "total_tokens": prompt + self.generated, "cached_tokens": self.reused}
        self.ticket.push(("done", reason, usage))

    def sample(self, logprobs):
        """This sequence's sampler on its row. With a seed it draws from its own key (mlx-lm's samplers use the
        global random state, which other sequences advance), through the same filters."""
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        if self.rng is None:
            return self.sampler(logprobs)
        p = self.job.params
        self.rng, key = mx.random.split(self.rng)
        x = logprobs
        if 0 < p.top_p < 1:
            x = apply_top_p(x, p.top_p)
        if p.min_p > 0:
            x = apply_min_p(x, p.min_p)
        if 0 < p.top_k < x.shape[-1]:
            x = apply_top_k(x, p.top_k)
        return mx.random.categorical(x * (1 / p.temperature), key=key)


def logprob_entries(rows: list[SeqState], logprobs, tokens: list[int], tokenizer) -> dict[int, dict]:
    """Per row that asked for logprobs: its token's logprob and its top alternatives (OpenAI's fields)."""
    import mlx.core as mx

    want = [(j, s.job.logprobs) for j, s in enumerate(rows) if s.job.logprobs is not None]
    if not want:
        return {}
    lps = [logprobs[j] for j, _ in want]
    tops = [mx.argpartition(-r, k - 1)[:k] if k else None for r, (_, k) in zip(lps, want)]
    mx.eval(lps, [t for t in tops if t is not None])
    out = {}
    for (j, k), r, top in zip(want, lps, tops):
        alts = []
        if top is not None:
            alts = sorted(((t, tokenizer.decode([t]), v) for t, v in zip(top.tolist(), r[top].tolist())),
                          key=lambda a: -a[2])
        out[j] = {"id": tokens[j], "token": tokenizer.decode([tokens[j]]), "logprob": r[tokens[j]].item(),
                  "top": alts}
    return out
