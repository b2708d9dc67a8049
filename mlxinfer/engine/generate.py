"""Generation as layered generators: token step (``steps.token_steps``) -> ``stream_generate`` (text pieces,
stop strings, timing stats) -> ``generate`` (collected text). Chat, bench and tests consume the same stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .loader import LoadedModel
from .sampling import SamplingParams, make_logits_processors, make_sampler
from .templates import render, special_tokens_of


@dataclass
class GenerationStats:
    """What one generation cost. Times in seconds, memory in bytes."""

    prompt_tokens: int = 0          # tokens prefilled by this call (new tokens only when a cache is reused)
    ttft: float = 0.0               # call start -> first token sampled (prefill + first step)
    generation_tokens: int = 0      # tokens sampled, including an EOS that ended the reply
    generation_time: float = 0.0    # first token -> last token
    peak_memory: int = 0
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "interrupted"
    token_latencies: list[float] = field(default_factory=list)  # inter-token gaps, len = generation_tokens - 1
    tokens: list[int] = field(default_factory=list)              # sampled token ids, in order

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.ttft if self.ttft > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        """Decode rate: tokens after the first over the time they took (the first one is part of TTFT)."""
        n = self.generation_tokens - 1
        return n / self.generation_time if n > 0 and self.generation_time > 0 else 0.0


@dataclass
class Response:
    """One streamed piece: new text (may be empty), the token that produced it, running stats."""

    text: str
    token: int | None
    stats: GenerationStats
    finish_reason: str | None = None


def encode_prompt(loaded: LoadedModel, prompt: str) -> list[int]:
    """Tokenize raw text, adding BOS unless the text already starts with it (as mlx-lm does)."""
    tok = loaded.tokenizer
    add_special = tok.bos_token is None or not prompt.startswith(tok.bos_token)
    return list(tok.encode(prompt, add_special_tokens=add_special))


def chat_prompt(loaded: LoadedModel, messages: list[dict[str, str]], **template_vars) -> list[int]:
    """Render messages with the model's chat template (sandboxed) and tokenize the result."""
    text = render(loaded.chat_template, messages, special_tokens=special_tokens_of(loaded.tokenizer), **template_vars)
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def stream_generate(
    loaded: LoadedModel,
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    *,
    cache: list | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    prompt_progress: Callable[[int, int], None] | None = None,
    prefill_step_size: int = 512,
) -> Iterator[Response]:
    """Yield the reply piece by piece. ``cache`` (an mlx-lm prompt cache) is extended in place: pass the tokens
    it does not hold yet as ``prompt``. After the stream ends the cache holds prompt + ``stats.tokens``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .steps import token_steps

    params = (params or SamplingParams()).validate()
    tokens = encode_prompt(loaded, prompt) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise ValueError("stream_generate needs at least one prompt token")
    if params.seed is not None:
        mx.random.seed(params.seed)
    stats = GenerationStats(prompt_tokens=len(tokens))
    detok = loaded.tokenizer.detokenizer
    detok.reset()
    eos = set() if ignore_eos else loaded.eos_token_ids
    text, emitted = "", 0

    mx.reset_peak_memory()
    start = last = time.perf_counter()
    steps = token_steps(
        loaded.model, tokens, cache=cache if cache is not None else make_prompt_cache(loaded.model),
        sampler=make_sampler(params), greedy=params.temperature == 0,
        logits_processors=make_logits_processors(params), max_tokens=params.max_tokens,
        prefill_step_size=prefill_step_size, prompt_progress=prompt_progress,
    )
    finish, stopped_by_string = "length", False
    try:
        for token in steps:
            now = time.perf_counter()
            if stats.generation_tokens == 0:
                stats.ttft = now - start
            else:
                stats.token_latencies.append(now - last)
                stats.generation_time = now - start - stats.ttft
            last = now
            stats.generation_tokens += 1
            stats.tokens.append(token)
            if token in eos:
                finish = "stop"
                break
            detok.add_token(token)
            text += detok.last_segment
            found = min((p for p in (text.find(s, max(0, emitted - len(s))) for s in stop) if p >= 0), default=-1)
            if found >= 0:
                piece, emitted, finish, stopped_by_string = text[emitted:found], found, "stop", True
                if piece:
                    yield Response(piece, token, stats)
                break
            safe = len(text) - _holdback(text, stop)
            if safe > emitted:
                yield Response(text[emitted:safe], token, stats)
                emitted = safe
            else:
                yield Response("", token, stats)
        if not stopped_by_string:
            detok.finalize()
            text += detok.last_segment
            if len(text) > emitted:
                yield Response(text[emitted:], None, stats)
    except GeneratorExit:
        stats.finish_reason = "interrupted"
        raise
    finally:
        steps.close()
        stats.peak_memory = int(mx.get_peak_memory())
    stats.finish_reason = finish
    yield Response("", None, stats, finish_reason=finish)


def generate(loaded: LoadedModel, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> str:
    """The whole reply as one string (see ``stream_generate`` for the arguments)."""
    return "".join(r.text for r in stream_generate(loaded, prompt, params, **kwargs))
