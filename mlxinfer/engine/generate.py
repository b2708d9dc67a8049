"""Generation as layered generators: token step (``steps.token_steps``) -> ``stream_generate`` (text pieces,
stop strings, timing stats) -> ``generate`` (collected text). Chat, bench and tests consume the same stream."""

from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ..errors import InvalidParameter
from .kv_options import KVOptions, make_cache, maybe_quantize
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


LONG_PROMPT_CHARS = 100_000  # above this, tokenizing takes long enough to show progress and count first
TOKENIZE_CHUNK = 16_384      # characters per progress step while counting


def encode_prompt(loaded: LoadedModel, prompt: str) -> list[int]:
    """Tokenize raw text, adding BOS unless the text already starts with it (as mlx-lm does)."""
    tok = loaded.tokenizer
    add_special = tok.bos_token is None or not prompt.startswith(tok.bos_token)
    return _encode(tok, prompt, add_special)


def chat_prompt(loaded: LoadedModel, messages: list[dict[str, str]], **template_vars) -> list[int]:
    """Render messages with the model's chat template (sandboxed) and tokenize the result."""
    return _encode(loaded.tokenizer, chat_text(loaded, messages, **template_vars), False)


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode`` without transformers' 'sequence length is longer than the specified maximum' warning:
    the length is checked against the context by the callers, with one clear line of their own."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    warned = getattr(hf, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    with tokenizer_guard():
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


@contextlib.contextmanager
def tokenizer_guard():
    """A Rust panic inside the tokenizer (a tokenizer.json regex that blows up on some text) surfaces as pyo3's
    PanicException, a BaseException that every handler above would miss: it becomes one line about the model."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - only the panic is translated; everything else goes on up
        if type(e).__name__ != "PanicException":
            raise
        from ..errors import InvalidModel

        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise InvalidModel(f"the model's tokenizer crashed on this text ({first})",
                           hint="its tokenizer.json is broken: download or convert the model again") from None


def chat_text(loaded: LoadedModel, messages: list[dict[str, str]], **template_vars) -> str:
    """The prompt text the model's chat template (sandboxed, time- and size-limited) makes of ``messages``."""
    _check_messages(messages)
    return render(loaded.chat_template, messages, special_tokens=special_tokens_of(loaded.tokenizer), **template_vars)


_PROBE_SYSTEM, _PROBE_USER = "MLXINFER-PROBE-SYSTEM", "MLXINFER-PROBE-USER"


def template_system_prompt(loaded: LoadedModel) -> str | None:
    """The system prompt the chat template writes itself when the conversation has none (SmolLM2's "You are a
    helpful AI assistant named SmolLM...", Qwen2.5's "You are Qwen..."), so a chat can say what the model reads.
    Found by rendering once with a system message and once without: the text in the system message's place."""
    from ..errors import MlxinferError

    user = [{"role": "user", "content": _PROBE_USER}]
    try:
        bare = chat_text(loaded, user)
        with_system = chat_text(loaded, [{"role": "system", "content": _PROBE_SYSTEM}] + user)
    except MlxinferError:  # e.g. a template that refuses system messages
        return None
    if _PROBE_USER not in bare or _PROBE_SYSTEM not in with_system:
        return None
    head, _, rest = with_system.partition(_PROBE_SYSTEM)
    between = rest.partition(_PROBE_USER)[0]      # the system turn's end and the user turn's start
    before_user = bare.partition(_PROBE_USER)[0]  # = head + the template's own text + between, if it has one
    if not (before_user.startswith(head) and before_user.endswith(between)
            and len(before_user) > len(head) + len(between)):
        return None
    return before_user[len(head):len(before_user) - len(between)].strip() or None


def _check_messages(messages) -> None:
    """The caller's mistakes named as such: a message without role or text content failed inside the template and
    was reported as the model's broken chat template."""
    from ..errors import InvalidParameter

    if not isinstance(messages, (list, tuple)):  # (empty is fine: a chat renders its system prompt alone)
        raise InvalidParameter("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidParameter(f"message {i} must be a dict with 'role' and 'content', not {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidParameter(f"message {i} has no 'role' (user, assistant or system)")
        if not isinstance(m.get("content"), str):
            raise InvalidParameter(f"message {i} ({m['role']}): 'content' must be text, "
                                   f"not {type(m.get('content')).__name__}")


def _chunks(text: str, size: int) -> Iterator[str]:
    """Pieces of about ``size`` characters that end before whitespace, so few tokens straddle two pieces."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def _piece_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Tokens of a piece: the Rust tokenizer directly when there is one (fast, and without transformers'
    'sequence length is longer than the maximum' warning on stderr)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    def encode(piece: str) -> list[int]:
        with tokenizer_guard():
            if backend is not None:
                return backend.encode(piece, add_special_tokens=False).ids
            return list(hf.encode(piece, add_special_tokens=False))

    return encode


def _count_encoder(tokenizer) -> Callable[[str], int]:
    encode = _piece_encoder(tokenizer)
    return lambda piece: len(encode(piece))


def encode_pieces(tokenizer, text: str, *, stop_after: int | None = None) -> list[int]:
    """Tokens of a long text piece by piece (a token or two may differ at piece boundaries), stopping once
    ``stop_after`` are there: for benchmark prompts, where a big file need not be tokenized whole."""
    encode, out = _piece_encoder(tokenizer), []
    for piece in _chunks(text, TOKENIZE_CHUNK):
        out.extend(encode(piece))
        if stop_after is not None and len(out) >= stop_after:
            break
    return out


def estimate_tokens(loaded: LoadedModel, text: str, *, stop_above: int | None = None,
                    progress: Callable[[str, int, int], None] | None = None) -> tuple[int, float]:
    """(tokens, share of the text counted) for a long text, counted piece by piece with ``progress("tokenize",
    chars done, chars total)``; piece boundaries may shift a token or two each. Stops once the count passes
    ``stop_above`` and extrapolates from the part counted."""
    count, done, n = _count_encoder(loaded.tokenizer), 0, 0
    if progress:
        progress("tokenize", 0, len(text))
    for piece in _chunks(text, TOKENIZE_CHUNK):
        n += count(piece)
        done += len(piece)
        if progress:
            progress("tokenize", done, len(text))
        if stop_above is not None and n > stop_above and done < len(text):
            return int(n * len(text) / done), done / len(text)
    return n, 1.0


def prompt_tokens(loaded: LoadedModel, prompt: str, *, raw: bool = False, system: str | None = None,
                  max_tokens: int = -1, fixed_max_tokens: bool = False,
                  progress: Callable[[str, int, int], None] | None = None) -> tuple[list[int], int]:
    """The prompt's tokens (raw text, or a user message through the chat template) checked against the context
    before anything is prefilled, and the max_tokens to generate with. ``fixed_max_tokens``: the user asked for
    ``max_tokens`` and the prompt must leave room for it; otherwise it is capped to the room left. A long prompt
    is counted piece by piece first (reporting progress), so an oversized one is refused after a small part."""
    if not prompt.strip():
        raise InvalidParameter("the prompt is empty", hint="give some text with -p, or pipe it with -p -")
    if raw:
        text = prompt
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = chat_text(loaded, messages)
    fixed = fixed_max_tokens and max_tokens > 0
    room = max_tokens if fixed else 1
    limit = loaded.context_length - room  # prompt tokens that fit
    if len(text) > LONG_PROMPT_CHARS:
        slack = 2 * (len(text) // TOKENIZE_CHUNK + 1)
        n, share = estimate_tokens(loaded, text, stop_above=limit + slack, progress=progress)
        if n > limit + slack:
            _too_long(loaded, n, share, room, fixed)
    tokens = encode_prompt(loaded, text) if raw else _encode(loaded.tokenizer, text, False)
    if progress:
        progress("tokenize", len(text), len(text))
    if len(tokens) > limit:
        _too_long(loaded, len(tokens), None, room, fixed)
    left = loaded.context_length - len(tokens)
    return tokens, (left if max_tokens <= 0 else min(max_tokens, left))


def _too_long(loaded: LoadedModel, n: int, share: float | None, room: int, fixed: bool) -> None:
    if share is None:
        size = f"{n:,} tokens"
    elif share < 1:
        size = f"about {n:,} tokens (estimated from its first {share:.0%})"
    else:
        size = f"about {n:,} tokens"
    need = f" + {room:,} to generate (--max-tokens)" if fixed else ""
    raise InvalidParameter(
        f"the prompt is {size}{need} but the context of {loaded.name} holds {loaded.context_length:,}",
        hint="shorten the prompt or lower --max-tokens" if fixed else "shorten the prompt",
    )


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
    params = (params or SamplingParams()).validate()
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


def _fit_context(loaded, prompt_tokens: int, params: SamplingParams) -> SamplingParams:
    """A prompt must leave room for one token in the model's context; the reply stops at the context's end."""
    from ..errors import InvalidParameter
    from .settings import context_length

    context = context_length(loaded)
    if prompt_tokens >= context:
        raise InvalidParameter(f"the prompt has {prompt_tokens} tokens and the model's context holds {context}",
                               hint="shorten the prompt")
    room = context - prompt_tokens
    if params.max_tokens == -1 or params.max_tokens > room:
        params = params.with_values(max_tokens=room)
    return params


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
) -> Iterator[Response]:
    """Yield the reply piece by piece. ``cache`` (an mlx-lm prompt cache) is extended in place: pass the tokens
    it does not hold yet as ``prompt``. After the stream ends the cache holds prompt + ``stats.tokens``.
    ``kv``: the KV-cache options (quantized or capped) a new cache is made with and a given one kept by."""
    import mlx.core as mx

    from .steps import token_steps

    params, tokens, stop = _checked_request(loaded, prompt, params, stop)
    if cache is None and not (kv is not None and kv.max_size):  # a fresh, whole-context cache: it must fit
        params = _fit_context(loaded, len(tokens), params)
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
