"""Generation as layered generators: token step (``steps.token_steps``) -> ``stream_generate`` (text pieces,
stop strings, timing stats) -> ``generate`` (collected text). Chat, bench and tests consume the same stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .kv_options import KVOptions, make_cache, maybe_quantize
from .loader import LoadedModel
from .prompts import chat_prompt, encode_prompt  # noqa: F401 - chat_prompt is part of the API (mlxinfer.chat_prompt)
from .sampling import SamplingParams, make_logits_processors, make_sampler


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


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _checked_request(loaded, prompt, params, stop) -> tuple[SamplingParams, list[int], tuple[str, ...]]:
    """The API's arguments checked as the CLI's are (InvalidParameter, one line), not left to fail deep inside:
    a model from ``load``, SamplingParams, a non-empty text or token ids in the vocabulary, stop strings."""
    from ..errors import InvalidParameter
    from .settings import bad_token, vocab_size

    if not (hasattr(loaded, "tokenizer") and hasattr(loaded, "model")) or loaded.model is None:
        raise InvalidParameter("generation needs a model from mlxinfer.load(...)",
                               hint=f"got {type(loaded).__name__}" + (" whose model was freed" if
                                                                       hasattr(loaded, "model") else ""))
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidParameter(f"params must be a SamplingParams, not {type(params).__name__}",
                               hint="e.g. SamplingParams(temperature=0, max_tokens=64)")
    from .settings import check_for_model

    params = check_for_model((params or SamplingParams()).validate(), loaded)  # top_k within the vocabulary, ...
    if isinstance(prompt, str):
        tokens = encode_prompt(loaded, prompt) if prompt.strip() else []
    elif isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):  # (an mx / NumPy array of ids too)
        tokens = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        vocab = vocab_size(loaded)
        bad = bad_token(tokens, vocab)
        if bad is not None:
            raise InvalidParameter(f"prompt token {bad!r} is not a token id of this model "
                                   f"(0 to {vocab - 1 if vocab else '?'})", hint="pass text, or ids from its tokenizer")
    else:
        raise InvalidParameter(f"the prompt must be text or a list of token ids, not {type(prompt).__name__}")
    if not tokens:
        raise InvalidParameter("the prompt is empty", hint="pass some text or at least one token id")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())  # one string is one stop, not its letters
    if any(not isinstance(s_, str) or not s_ for s_ in stops):
        raise InvalidParameter("stop strings must be non-empty strings")
    return params, tokens, stops


def _fit_context(loaded, prompt_tokens: int, params: SamplingParams, held: int = 0) -> SamplingParams:
    """A prompt must leave room for one token in the model's context; the reply stops at the context's end."""
    from ..errors import InvalidParameter
    from .settings import context_length

    context = context_length(loaded)
    if prompt_tokens >= context:
        what = (f"the cache holds {held} tokens, the prompt has {prompt_tokens - held}," if held else
                f"the prompt has {prompt_tokens} tokens and")
        raise InvalidParameter(f"{what} the model's context holds {context}",
                               hint="shorten the prompt" + (" or start a new cache" if held else ""))
    room = context - prompt_tokens
    if params.max_tokens == -1 or params.max_tokens > room:
        params = params.with_values(max_tokens=room)
    return params


def reply_detokenizer(tokenizer, *, completion: bool):
    """mlx-lm's streaming detokenizer, reset. Its SPM and BPE kinds drop the first space of a text: right for a
    chat reply (after "assistant\n"), wrong for a raw completion, where prompt + completion must be the text
    ("The capital of France is" + " Paris")."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    detok = tokenizer.detokenizer
    detok.reset()
    if completion:
        if hasattr(detok, "trim_space"):  # SPMStreamingDetokenizer
            detok.trim_space = False
        elif isinstance(detok, BPEStreamingDetokenizer):  # (mlx-lm 0.32: its one place that trims)
            detok._maybe_trim_space = lambda text: text
    return detok


def _cache_offset(cache, prefill_step_size) -> int | None:
    """Tokens a given prompt cache holds (0 for none); None for a window cache that drops old tokens. Also checks
    the two arguments, which went unchecked into the native kernels (a step of -1 wrote past the KV buffers)."""
    from ..errors import InvalidParameter

    if isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        raise InvalidParameter(f"prefill_step_size must be a whole number >= 1, not {prefill_step_size!r}")
    if cache is None:
        return 0
    if not isinstance(cache, (list, tuple)) or not cache or not all(hasattr(c, "state") for c in cache):
        raise InvalidParameter(f"cache must be a prompt cache (a list with one mlx-lm cache per layer), not "
                               f"{type(cache).__name__}", hint="make one with mlx_lm.models.cache.make_prompt_cache")
    offsets = [c.offset for c in cache if isinstance(getattr(c, "offset", None), int)]
    if not offsets or any(getattr(c, "max_size", None) for c in cache):  # (a hybrid model's state caches: no count)
        return None
    return max(offsets)


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
    kv: KVOptions | None = None,
    completion: bool | None = None,
) -> Iterator[Response]:
    """Yield the reply piece by piece. A text ``prompt`` is continued as it is (a raw completion, no chat
    template): for an assistant's answer pass ``chat_prompt(loaded, messages)``, or use a ``Session``. Without
    ``params``, SamplingParams' defaults (temperature 0.7), not the model's models.toml defaults (a Session
    takes those). ``cache`` (an mlx-lm prompt cache) is extended in place: pass the tokens
    it does not hold yet as ``prompt``. After the stream ends the cache holds prompt + ``stats.tokens``.
    ``kv``: the KV-cache options (quantized or capped) a new cache is made with and a given one kept by.
    ``completion``: the reply continues the prompt's text and keeps its leading space (default: when the prompt
    is text, not token ids)."""
    import mlx.core as mx

    from .steps import token_steps

    params, tokens, stop = _checked_request(loaded, prompt, params, stop)
    held = _cache_offset(cache, prefill_step_size)
    if held is not None and not (kv is not None and kv.max_size):  # a whole-context cache: what it holds and the
        params = _fit_context(loaded, held + len(tokens), params, held)  # prompt must fit (unchecked before)
    if params.seed is not None:
        mx.random.seed(params.seed)
    stats = GenerationStats(prompt_tokens=len(tokens))
    detok = reply_detokenizer(loaded.tokenizer, completion=isinstance(prompt, str) if completion is None
                              else completion)
    eos = set() if ignore_eos else loaded.eos_token_ids
    text, emitted = "", 0

    mx.reset_peak_memory()
    start = last = time.perf_counter()
    steps = token_steps(
        loaded.model, tokens, cache=cache if cache is not None else make_cache(loaded.model, kv),
        sampler=make_sampler(params), greedy=params.temperature == 0,
        logits_processors=make_logits_processors(params), max_tokens=params.max_tokens,
        prefill_step_size=prefill_step_size, prompt_progress=prompt_progress,
        after_call=(lambda c: maybe_quantize(c, kv)) if kv is not None and kv.quantized_start else None,
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
