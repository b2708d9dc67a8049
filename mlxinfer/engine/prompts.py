"""Prompts as tokens: raw text (BOS added as mlx-lm does), chat messages through the model's sandboxed chat
template, long texts counted piece by piece before anything is prefilled, and the tokenizer's crashes as one line."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from ..errors import InvalidParameter
from .loader import LoadedModel
from .templates import render, special_tokens_of


LONG_PROMPT_CHARS = 100_000  # above this, tokenizing takes long enough to show progress and count first
TOKENIZE_CHUNK = 16_384      # characters per progress step while counting


def encode_prompt(loaded: LoadedModel, prompt: str) -> list[int]:
    """Tokenize raw text, adding BOS unless the text already starts with it (as mlx-lm does)."""
    tok = loaded.tokenizer
    add_special = tok.bos_token is None or not prompt.startswith(tok.bos_token)
    return _encode(tok, prompt, add_special)


def chat_prompt(loaded: LoadedModel, messages: list[dict[str, str]], **template_vars) -> list[int]:
    """Render messages with the model's chat template (sandboxed) and tokenize the result."""
    text = chat_text(loaded, messages, **template_vars)  # (checks ``loaded`` first)
    return _encode(loaded.tokenizer, text, False)


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
    if not (hasattr(loaded, "tokenizer") and hasattr(loaded, "chat_template")):
        raise InvalidParameter(f"a chat prompt needs a model from mlxinfer.load(...), not {type(loaded).__name__}")
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
