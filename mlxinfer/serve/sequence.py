"""One request inside the engine: its ``Ticket`` (what the HTTP side holds) and its decoding state (``SeqState``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

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
