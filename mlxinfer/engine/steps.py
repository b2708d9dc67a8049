"""The token step: prefill the prompt in chunks, then one sampled token per model call.

It keeps mlx-lm's ``generate_step`` contract (``model(x, cache=cache)``, the cache extended in place, the next
step's graph built while the current one evaluates, the cache holding every yielded token) but yields token ids
only and never normalises the logits: the samplers are shift-invariant, so greedy decoding takes the raw logits
and the others the logits minus their max. ``generate_step`` computes ``logits - logsumexp(logits)`` every step,
which on MLX's CPU build costs ~0.6 ms for a 49k vocabulary: 5-7% of a SmolLM2 decode step.

The LM head runs only where logits are used: the prompt's chunks evaluate only the cache (MLX is lazy, so their
logits are built but never computed) and the first token comes from the last prompt position alone; a 262k-token
vocabulary is multiplied once per prompt (tests/unit/test_prefill_head.py). Keep it so: never evaluate a chunk's
output.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence


def prefill(model, cache: list, tokens: Sequence[int], step: int = 512) -> None:
    """Run ``tokens`` through the model into ``cache`` in chunks of ``step``, evaluating only the cache (the
    logits are never computed, see the module doc)."""
    import mlx.core as mx

    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i:i + step])[None], cache=cache)  # (1, chunk) -> logits discarded
        mx.eval([c.state for c in cache])


def token_steps(
    model,
    prompt: Sequence[int],
    *,
    cache: list,
    sampler: Callable,
    greedy: bool,
    logits_processors: Sequence[Callable] = (),
    max_tokens: int = 256,
    prefill_step_size: int = 512,
    prompt_progress: Optional[Callable[[int, int], None]] = None,
    after_call: Optional[Callable[[list], None]] = None,
) -> Iterator[int]:
    """Yield up to ``max_tokens`` (-1: no limit) token ids continuing ``prompt`` (at least one token), which
    ``cache`` (an mlx-lm prompt cache) does not hold yet. ``after_call(cache)`` runs after every model call (e.g.
    ``kv_options.maybe_quantize``, which may replace layer caches in the list)."""
    import mlx.core as mx

    from ..errors import InvalidModel

    progress = prompt_progress or (lambda done, total: None)
    total = len(prompt)
    rest = mx.array(list(prompt))
    history = rest if logits_processors else None  # every token so far, for the logits processors
    progress(0, total)
    done = 0
    while total - done > 1:  # all but the last prompt token, in chunks: (1, n) -> cache
        n = min(prefill_step_size, total - done - 1)
        model(rest[:n][None], cache=cache)
        if after_call is not None:
            after_call(cache)
        mx.eval([c.state for c in cache])
        done += n
        progress(done, total)
        rest = rest[n:]
        mx.clear_cache()

    finite = None  # the first logits' check: corrupt weights (NaN/inf scales) give no tokens, not an empty reply

    def step(tokens: mx.array, extend: bool) -> mx.array:
        nonlocal history, finite
        logits = model(tokens[None], cache=cache)[:, -1, :]  # (1, vocab)
        if finite is None:
            finite = mx.isfinite(logits).all()
        if after_call is not None:
            after_call(cache)
        if logits_processors:
            if extend:
                history = mx.concatenate([history, tokens])
            for processor in logits_processors:
                logits = processor(history, logits)
        if not greedy:
            logits = logits - mx.max(logits, axis=-1, keepdims=True)
        return sampler(logits)  # (1,)

    y = step(rest, extend=False)
    mx.async_eval(y, finite)
    n = 0
    while True:
        if n != max_tokens:
            next_y = step(y, extend=True)
            mx.async_eval(next_y)
        if n == 0:
            mx.eval(y, finite)
            if not finite.item():
                raise InvalidModel("the model's output is not finite (NaN or inf): its weights are corrupt",
                                   hint="download or convert the model again")
            progress(total, total)
        if n == max_tokens:
            break
        yield y.item()
        if n % 256 == 0:
            mx.clear_cache()
        y = next_y
        n += 1
