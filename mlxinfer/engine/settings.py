"""Where sampling settings come from and whether they suit the model: one place for chat, generate, bench and a
server.

Precedence, lowest first: SamplingParams' built-in defaults < the model's registry defaults (models.toml) < a
saved session's or a request's values < command-line flags (or ``/set``). ``resolve`` applies it; then
``check_for_model`` checks what needs the model (top_k against the vocabulary, max_tokens and the context
against the context length). The setting names users type are derived from ``SamplingParams``' fields.
The KV-cache options (``--kv-bits``, ``--max-kv-size``: ``kv_options.KVOptions``) follow the same precedence
(``resolve_kv``).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import InvalidParameter
from .sampling import SamplingParams, _shown

MIN_CONTEXT = 32
# The short names people type (``/set temp``, ``--temp``); every other field is typed as it is spelled.
SHORT_NAMES = {"temperature": "temp"}


def setting_names() -> tuple[str, ...]:
    """The names ``/set`` accepts, in SamplingParams' order, plus the session's own ``context``."""
    return tuple(SHORT_NAMES.get(n, n) for n in SamplingParams.names()) + ("context",)


def field_for(name: str) -> str | None:
    """The SamplingParams field a user-typed name (``temp``, ``top-k``, ``temperature``) means, or None."""
    key = name.strip().lower().replace("-", "_")
    long = {v: k for k, v in SHORT_NAMES.items()}.get(key, key)
    return long if long in SamplingParams.names() else None


def pick(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling settings in ``values`` (user names or field names), None values left out."""
    out: dict[str, Any] = {}
    for k, v in (values or {}).items():
        f = field_for(k)
        if f is not None and v is not None:
            out[f] = v
    return out


def resolve(registry_defaults: Mapping[str, Any] | None = None, saved: Mapping[str, Any] | None = None,
            flags: Mapping[str, Any] | None = None, loaded=None) -> SamplingParams:
    """SamplingParams from registry defaults < saved session/request values < flags (None = not given). With
    ``loaded`` the result is also checked against the model, and the built-in max_tokens default is capped at
    the model's context (a 128-token model still chats without a flag)."""
    base: dict[str, Any] = {}
    if loaded is not None:
        base["max_tokens"] = min(SamplingParams.max_tokens, context_length(loaded))
    merged = {**base, **pick(registry_defaults), **pick(saved), **pick(flags)}
    try:
        params = SamplingParams(**merged)
    except TypeError as e:  # not reachable through pick(); kept so a bad call names the problem
        raise InvalidParameter(f"invalid sampling settings: {e}") from None
    params.validate()
    return check_for_model(params, loaded) if loaded is not None else params


def resolve_kv(registry_defaults: Mapping[str, Any] | None = None, saved: Mapping[str, Any] | None = None,
               flags: Mapping[str, Any] | None = None, loaded=None):
    """KVOptions from registry defaults < saved session values < flags (kv_bits, max_kv_size; None = not given),
    validated, against the model's context with ``loaded``."""
    from .kv_options import resolve as _resolve

    return _resolve(registry_defaults, saved, flags, context_length=context_length(loaded) if loaded else None)


def vocab_size(loaded) -> int | None:
    """How many logits the model produces (what top_k ranks), or None when nothing says."""
    cfg = getattr(loaded, "config", None) or {}
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int) and c["vocab_size"] > 0:
            return c["vocab_size"]
    args = getattr(getattr(loaded, "model", None), "args", None)
    if isinstance(getattr(args, "vocab_size", None), int):
        return args.vocab_size
    tok = getattr(loaded, "tokenizer", None)
    n = getattr(tok, "vocab_size", None)
    return n if isinstance(n, int) and n > 0 else None


def bad_token(tokens, vocab: int | None):
    """The first of ``tokens`` that is not a token id of a ``vocab``-sized vocabulary (not an int, a bool, negative,
    or past its end), else None; the API and the server both refuse prompts with one."""
    return next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or t < 0
                 or (vocab is not None and t >= vocab)), None)


def context_length(loaded) -> int:
    return int(loaded.context_length)


def check_for_model(params: SamplingParams, loaded, context: int | None = None) -> SamplingParams:
    """``params`` validated against the model: top_k <= vocabulary, max_tokens and repeat_context <= the context,
    and ``context`` (a requested limit, if any) within the model's. Returns ``params``; raises InvalidParameter
    with one line naming the setting, its allowed range and the value."""
    params.validate()
    vocab = vocab_size(loaded)
    if vocab is not None and params.top_k > vocab:
        raise InvalidParameter(f"invalid top_k {_shown(params.top_k)}: must be between 0 and {vocab} "
                               "(the model's vocabulary size; 0 = off)")
    top = context_length(loaded)
    if context is not None:
        check_context(context, loaded)
    if params.max_tokens > top:
        raise InvalidParameter(f"invalid max_tokens {_shown(params.max_tokens)}: must be between 1 and {top} "
                               "(the model's context; -1 = as many as fit)")
    if params.repeat_context > top:
        raise InvalidParameter(f"invalid repeat_context {_shown(params.repeat_context)}: must be between 1 and "
                               f"{top} (the model's context)")
    return params


def check_context(n: Any, loaded) -> int:
    top = context_length(loaded)
    if not isinstance(n, int) or isinstance(n, bool) or not MIN_CONTEXT <= n <= top:
        raise InvalidParameter(f"invalid context {_shown(n)}: must be between {MIN_CONTEXT} and {top} "
                               "(the model's limit)")
    return n
