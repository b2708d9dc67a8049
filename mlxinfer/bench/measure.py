"""Timed primitives shared by both engines: prefill a context, one timed stream, one timed batch, and the bytes a
decode step reads (weights actually touched + KV cache), which turns tok/s into an effective memory bandwidth.

Timing is taken where a token id reaches Python: mlx-lm's generate loops call ``.item()`` on each token, which
waits for MLX's evaluation, so every timestamp is synchronised with the computation that produced it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..engine.steps import prefill

PREFILL_STEP = 512


@dataclass
class Sample:
    """One timed call. ``token_times`` are seconds from the call's start to each token's arrival (for a batch:
    to each decode step, which yields one token per sequence)."""

    prompt_tokens: int                # new prompt tokens (all sequences)
    token_times: list[float] = field(default_factory=list)
    tokens_per_step: int = 1          # batch size
    peak_memory: int = 0
    kv_per_token: int = 0             # KV-cache bytes one token of context takes (all layers, one sequence)
    kv_capacity: list[int] | None = None  # per-layer token capacity (sliding windows), None = unbounded

    @property
    def ttft(self) -> float:
        return self.token_times[0] if self.token_times else 0.0

    @property
    def e2e(self) -> float:
        return self.token_times[-1] if self.token_times else 0.0

    @property
    def latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft if self.ttft > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first step over the time they took (same definition as GenerationStats)."""
        steps = len(self.token_times) - 1
        span = self.e2e - self.ttft
        return steps * self.tokens_per_step / span if steps > 0 and span > 0 else 0.0


def new_cache(model, context: Sequence[int] = (), kv=None) -> list:
    """The model's prompt cache (quantized or capped per ``kv``, an ``engine.kv_options.KVOptions``), prefilled
    with ``context``."""
    from ..engine.kv_options import make_cache

    cache = make_cache(model, kv)
    if context:
        prefill(model, cache, context, PREFILL_STEP)
    return cache


def kv_layout(cache: list) -> tuple[int, list[int] | None]:
    """(bytes per token of context for one sequence, per-layer capacities or None) measured on a used cache."""
    per_token, caps, bounded = 0, [], False
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is None:
            caps.append(0)
            continue
        parts = [*(keys if isinstance(keys, tuple) else (keys,)), *(values if isinstance(values, tuple) else (values,))]
        first = parts[0]  # (B, n_kv_heads, allocated, D) or a quantized triple of such
        per_token += sum(p.nbytes for p in parts) // (first.shape[0] * first.shape[-2])
        cap = getattr(c, "max_size", None)
        bounded |= cap is not None
        caps.append(cap or 0)
    return per_token, (caps if bounded else None)


def kv_bytes(per_token: int, capacity: list[int] | None, tokens: float, n_layers: int) -> float:
    """KV bytes held for ``tokens`` of context (sliding-window layers stop growing at their window)."""
    if not capacity:
        return per_token * tokens
    per_layer = per_token / max(n_layers, 1)
    return sum(per_layer * (min(tokens, cap) if cap else tokens) for cap in capacity)


def weights_read_per_token(model, config: dict) -> int:
    """Weight bytes one decode step reads: all parameters, except that an untied input embedding table is only
    read at one row (a tied table is read in full as the output projection)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    embeddings = [m for _, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    if not embeddings:
        return total
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    if tied is None:
        tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = not any(k.startswith("lm_head.") or ".lm_head." in k for k, _ in tree_flatten(model.parameters()))
    for emb in embeddings:
        table = sum(v.nbytes for _, v in tree_flatten(emb.parameters()))
        rows = emb["weight"].shape[0]
        total -= 0 if tied else table - table // rows
    return total


Timed = Callable[[Sequence[int], int, list], "tuple[list[float], int]"]  # (prompt, gen, cache) -> (times, peak)


def run_stream(timed: Timed, model, prompt: Sequence[int], gen: int, context: Sequence[int] = (), kv=None) -> Sample:
    """Prefill ``context`` (untimed) into a cache made per ``kv``, then ``timed(prompt, gen, cache)``: one
    engine's generation, returning each token's arrival time from the call's start and the peak memory."""
    cache = new_cache(model, context, kv)
    times, peak = timed(prompt, gen, cache)
    sample = Sample(prompt_tokens=len(prompt), token_times=list(times), peak_memory=int(peak))
    sample.kv_per_token, sample.kv_capacity = kv_layout(cache)
    return sample


def mlxinfer_timed(loaded, kv=None) -> Timed:
    """mlxinfer's own stream (the one chat uses), greedy with EOS ignored; times come from its GenerationStats.
    ``kv``: the KV-cache options the given caches were made with (kept by the stream)."""
    from ..engine.generate import stream_generate
    from ..engine.sampling import SamplingParams

    def timed(prompt, gen, cache):
        last = None
        for last in stream_generate(loaded, list(prompt), SamplingParams(temperature=0.0, max_tokens=gen),
                                    cache=cache, ignore_eos=True, kv=kv):
            pass
        s = last.stats
        times = [s.ttft]
        for gap in s.token_latencies:
            times.append(times[-1] + gap)
        return times, s.peak_memory

    return timed


def mlx_lm_timed(model, tokenizer) -> Timed:
    """mlx-lm's ``stream_generate`` (its default greedy sampler), EOS disabled as ``mlx_lm.benchmark`` does."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    tokenizer._eos_token_ids = set()

    def timed(prompt, gen, cache):
        mx.reset_peak_memory()
        times, start = [], time.perf_counter()
        for _ in stream_generate(model, tokenizer, list(prompt), max_tokens=gen, prompt_cache=cache):
            times.append(time.perf_counter() - start)
        return times, int(mx.get_peak_memory())

    return timed


def batch_cache(model, context: Sequence[int] = ()) -> list:
    """One sequence's cache for a batch, as ``mlxinfer serve`` makes them (``kernels.kv_cache.whole_caches``: a
    one-op sliding layer's too keeps every position, so that mlx-lm merges it into a plain batch cache the
    one-op layers take), prefilled with ``context``."""
    from ..kernels.kv_cache import whole_caches

    cache = whole_caches(model)
    if context:
        prefill(model, cache, context, PREFILL_STEP)
    return cache


Batch = Callable[[list, int, "list | None"], Sample]  # (prompts, gen, contexts or None) -> one timed batch


def mlxinfer_batch(loaded) -> Batch:
    """Batches as ``mlxinfer serve`` decodes them: :func:`run_served_batch` on ``loaded``."""
    return lambda prompts, gen, contexts=None: run_served_batch(loaded, prompts, gen, contexts)


def mlx_lm_batch(model) -> Batch:
    """Batches as mlx-lm decodes them: :func:`run_batch` (its ``BatchGenerator``)."""
    return lambda prompts, gen, contexts=None: run_batch(model, prompts, gen, contexts)


def run_served_batch(loaded, prompts: list[list[int]], gen: int, contexts: list[list[int]] | None = None) -> Sample:
    """Time ``len(prompts)`` sequences through the server's scheduler (``serve.scheduler.Engine``), in process and
    without HTTP, with ``mlxinfer serve``'s default prefix cache: all admitted in one round, prefilled together,
    decoded as one batch (its pipelining, caches and kernels), greedy, ``gen`` tokens each (EOS ignored).
    ``contexts``: each sequence's tokens already in the KV cache, put into the engine's prefix cache first (where a
    request resending them finds them). A timestamp per decode step read back (one token per sequence)."""
    import threading

    import mlx.core as mx

    from ..engine.sampling import SamplingParams
    from ..serve.metrics import Metrics
    from ..serve.prefix_cache import DEFAULT_MB, MIN_REUSE
    from ..serve.scheduler import Engine
    from ..serve.schemas import Job
    from ..serve.sequence import Ticket

    class _Quiet(Ticket):  # no client: only the end of each request matters
        def push(self, event: tuple) -> None:
            if event[0] == "error":
                errors.append(event[1])
            if event[0] in ("done", "error"):
                ended.release()

    b, contexts = len(prompts), contexts or [[] for _ in prompts]
    # A context shorter than the prefix cache's minimum match is not kept there: the timed call prefills it.
    caches = [batch_cache(loaded.model, c) if len(c) >= MIN_REUSE else None for c in contexts]
    held = sum(c.nbytes for cache in caches if cache for c in cache)
    times: list[float] = []
    engine = Engine(loaded, Metrics(), parallel=b, queue_size=b, prefix_cache_bytes=max(DEFAULT_MB << 20, 2 * held),
                    on_step=lambda rows, now: times.append(now - start))
    for context, cache in zip(contexts, caches):
        if cache:
            engine.prefix.store(list(context), cache)
    errors: list = []
    ended = threading.Semaphore(0)
    params = SamplingParams(temperature=0.0, max_tokens=gen)
    tickets = [_Quiet(Job("completion", [*c, *p], params, gen, ignore_eos=True), None, None)
               for c, p in zip(contexts, prompts)]
    mx.reset_peak_memory()
    start = time.perf_counter()
    for t in tickets:  # before the engine runs: one admission round, one prefill group
        engine.submit(t)
    engine.start()
    try:
        left = len(tickets)
        while left:
            if ended.acquire(timeout=1.0):
                left -= 1
            elif not engine.alive:  # a bug that ended the engine's thread: fail, do not wait forever
                raise RuntimeError("the serving engine stopped before answering every request")
    finally:
        engine.stop()
    if errors:
        raise RuntimeError(f"the serving engine failed a request: {errors[0]}")
    fresh = sum(len(p) + (len(c) if cache is None else 0) for p, c, cache in zip(prompts, contexts, caches))
    sample = Sample(prompt_tokens=fresh, token_times=times, tokens_per_step=b,
                    peak_memory=int(mx.get_peak_memory()))
    probe = caches[0] or batch_cache(loaded.model, prompts[0][:2])
    sample.kv_per_token, sample.kv_capacity = kv_layout(probe)
    return sample


def run_batch(model, prompts: list[list[int]], gen: int, contexts: list[list[int]] | None = None) -> Sample:
    """Time ``len(prompts)`` sequences decoded together by mlx-lm's ``BatchGenerator`` (greedy, no stop tokens),
    on the caches the server gives (:func:`batch_cache`): the mlx-lm peer's batches."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    b = len(prompts)
    caches = [batch_cache(model, c) for c in (contexts or [()] * b)]
    per_token, capacity = kv_layout(caches[0]) if contexts else (0, None)
    gen_ = BatchGenerator(model, max_tokens=gen, stop_tokens=None, sampler=make_sampler(0.0),
                          completion_batch_size=b, prefill_batch_size=b, prefill_step_size=PREFILL_STEP)
    mx.reset_peak_memory()
    sample = Sample(prompt_tokens=sum(len(p) for p in prompts), tokens_per_step=b)
    try:
        start = time.perf_counter()
        gen_.insert(prompts, [gen] * b, caches=caches)
        while responses := gen_.next_generated():
            sample.token_times.append(time.perf_counter() - start)
            if all(r.finish_reason is not None for r in responses) and len(responses) == b:
                break
    finally:
        gen_.close()
    sample.peak_memory = int(mx.get_peak_memory())
    if not per_token:
        probe = batch_cache(model, prompts[0][:2])
        per_token, capacity = kv_layout(probe)
    sample.kv_per_token, sample.kv_capacity = per_token, capacity
    return sample
