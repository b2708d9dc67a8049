"""Chat templates rendered in jinja2's immutable sandbox.

Templates come from model repos and GGUF files, i.e. from strangers: they must not reach Python internals
(``__class__``, ``__globals__``...). The sandbox refuses that; we turn the refusal into one clear error.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any

from ..errors import InvalidModel

# Used when a model ships no template (base models): plain role-prefixed turns.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise(message: str):
    raise InvalidModel(f"chat template error: {message}")


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidModel(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None


def render(
    template: str | None,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` ([{"role", "content"}]) to the prompt text the model expects."""
    from jinja2.exceptions import SecurityError, UndefinedError

    compiled = _compile(template or FALLBACK_TEMPLATE)
    try:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **(special_tokens or {}), **extra
        )
    except SecurityError as e:
        raise InvalidModel(f"chat template refused: it tried to reach Python internals ({e})") from None
    except (UndefinedError, TypeError) as e:
        raise InvalidModel(f"chat template failed to render: {e}") from None


def special_tokens_of(tokenizer) -> dict[str, str]:
    """bos_token/eos_token/... strings that templates reference."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, key, None)
        if isinstance(value, str):
            out[key] = value
    return out
