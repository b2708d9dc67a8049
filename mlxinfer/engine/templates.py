"""Chat templates rendered in jinja2's immutable sandbox, with a time and an output-size limit.

Templates come from model repos and GGUF files, i.e. from strangers: they must not reach Python internals
(``__class__``, ``__globals__``...), and must not hang or exhaust memory (nested loops, ``'x' * 10**8``,
``10**10**10``, self-calling macros). The sandbox refuses the first; the hooks below bound sizes before anything
big is built, and a timer stops a render that runs past its deadline. Every failure is one line.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from datetime import datetime
from functools import lru_cache
from typing import Any

from ..errors import InvalidModel

# Used when a model ships no template (base models): plain role-prefixed turns.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
TIME_LIMIT_S = 2.0             # a real template renders a long history in milliseconds
BASE_OUTPUT_CHARS = 1_000_000  # on top of a few times the size of the messages themselves
MAX_INT_BITS = 4096            # no chat template needs numbers beyond this
MAX_JSON_INDENT = 64
HINT = "the model's chat template is broken: fix chat_template in its tokenizer_config.json, or use generate --raw"


class TemplateLimit(BaseException):
    """A limit was hit inside the render. A BaseException so no ``except Exception`` in jinja swallows it."""


def _one_line(text: Any, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _raise(message: Any = ""):
    raise InvalidModel(f"chat template error: {_one_line(message)}", hint="the template refused these messages")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    """transformers' tojson: no HTML escaping (tool-calling templates emit raw JSON), UTF-8 kept, indent allowed."""
    if (isinstance(indent, int) and indent > MAX_JSON_INDENT) or (isinstance(indent, str) and len(indent) > 64):
        raise TemplateLimit(f"tojson indent {_one_line(indent, 20)} is over the limit of {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Limits(threading.local):
    """The size limit of the render in progress on this thread (a server renders on several)."""

    max_chars = BASE_OUTPUT_CHARS

    def check_size(self, n: float, what: str) -> None:
        if n > self.max_chars:
            raise TemplateLimit(f"{what} would be {int(n):,} characters, over the output limit of "
                                f"{self.max_chars:,}")


_limits = _Limits()


def _sized(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


_WIDTH = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(fmt: str, args) -> None:
    """``'%0100000000d' % 1`` or ``'%*d' % (10**8, 1)`` would build a huge string: check widths first."""
    numbers = args if isinstance(args, tuple) else (args,)
    for m in _WIDTH.finditer(fmt):
        for part in m.groups():
            if part and part.isdigit():
                _limits.check_size(int(part), "a %-format width")
    if "*" in fmt:
        for a in numbers:
            if isinstance(a, int) and not isinstance(a, bool):
                _limits.check_size(abs(a), "a %-format width")


def _check_binop(op: str, left, right) -> None:
    if op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = right * math.log2(abs(left))
            if bits > MAX_INT_BITS:
                raise TemplateLimit(f"{_one_line(left, 20)} ** {_one_line(right, 20)} is a number of about "
                                    f"{bits:,.0f} bits, over the limit of {MAX_INT_BITS}")
    elif op == "*":
        for a, b in ((left, right), (right, left)):
            n = _sized(a)
            if n is not None and isinstance(b, int):
                _limits.check_size(n * b, "a repeated string or list")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product over the limit of {MAX_INT_BITS} bits")
    elif op == "+":
        if _sized(left) is not None and _sized(right) is not None:
            _limits.check_size(_sized(left) + _sized(right), "a concatenation")
    elif op == "%" and isinstance(left, str):
        _check_percent(left, right)


def _check_join(sep: str, items) -> None:
    """A join's size before it is built: the separator is repeated between every two items."""
    if isinstance(items, (list, tuple)):
        _limits.check_size(max(len(items) - 1, 0) * len(sep) + sum(len(str(x)) for x in items), "a join")


def _check_call(obj, args, kwargs) -> None:
    """str methods that build big strings (ljust, center, zfill, replace, expandtabs, format)."""
    # The sandbox hands out str.format wrapped (functools.wraps keeps the bound method in __wrapped__).
    owner = getattr(obj, "__self__", None) or getattr(getattr(obj, "__wrapped__", None), "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    numbers = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if name in ("ljust", "rjust", "center", "zfill"):
        for n in numbers:
            _limits.check_size(n, f"str.{name}")
    elif name == "expandtabs":
        for n in numbers:
            _limits.check_size(len(owner) + owner.count("\t") * n, "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _limits.check_size(len(owner) + count * (len(args[1]) - len(args[0])), "str.replace")
    elif name in ("format", "format_map"):
        if re.search(r"\d{7,}", owner):
            raise TemplateLimit("a str.format width is over the output limit")
        for n in numbers:  # a nested width: '{:>{}}'.format('x', 10**9)
            _limits.check_size(abs(n), "a str.format argument used as a width")
    elif name == "join" and len(args) == 1 and isinstance(args[0], (list, tuple)):
        _check_join(owner, args[0])


@lru_cache(maxsize=1)
def _environment_class():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # ``a ~ b``: jinja's string join, size-checked
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Environment(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset(("**", "*", "+", "%"))

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        @staticmethod
        def checked_concat(parts):
            text = "".join(str(p) for p in parts)
            _limits.check_size(len(text), "a ~ concatenation")
            return text

    return Environment


def _wrapped_filters(filters: dict) -> dict:
    """Filters whose argument sets the size of what they build."""
    def center(value, width=80):
        _limits.check_size(width, "the center filter")
        return filters["center"](value, width)

    def indent(s, width=4, first=False, blank=False):
        n = width if isinstance(width, int) else len(str(width))
        _limits.check_size(len(str(s)) + (str(s).count("\n") + 1) * n, "the indent filter")
        return filters["indent"](s, width, first, blank)

    def batch(value, linecount, fill_with=None):
        _limits.check_size(linecount, "the batch filter")
        return filters["batch"](value, linecount, fill_with)

    def fmt(value, *args, **kwargs):
        if isinstance(value, str):
            _check_percent(value, tuple(args) or kwargs)
        return filters["format"](value, *args, **kwargs)

    def replace(eval_ctx, s, old, new, count=None):
        _check_call(str(s).replace, (str(old), str(new)), {})
        return filters["replace"](eval_ctx, s, old, new, count)

    replace.jinja_pass_arg = filters["replace"].jinja_pass_arg  # type: ignore[attr-defined]

    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        _limits.check_size(max(len(items) - 1, 0) * len(str(d)), "the join filter's separators")
        if attribute is None:
            _check_join(str(d), items)
        return filters["join"](eval_ctx, items, d, attribute)

    join.jinja_pass_arg = filters["join"].jinja_pass_arg  # type: ignore[attr-defined]

    def slice_(eval_ctx, value, slices, fill_with=None):
        if isinstance(slices, int):
            _limits.check_size(slices, "the slice filter")
        return filters["slice"](eval_ctx, value, slices, fill_with)

    slice_.jinja_pass_arg = filters["slice"].jinja_pass_arg  # type: ignore[attr-defined]

    def sum_(environment, iterable, attribute=None, start=0):
        # sum(start=[]) concatenates lists in C, in quadratic time no deadline can interrupt: numbers only.
        if isinstance(start, bool) or not isinstance(start, (int, float)):
            raise TemplateLimit("the sum filter adds numbers only")
        return filters["sum"](environment, iterable, attribute, start)

    sum_.jinja_pass_arg = filters["sum"].jinja_pass_arg  # type: ignore[attr-defined]
    return {"center": center, "indent": indent, "batch": batch, "format": fmt, "replace": replace, "tojson": _tojson,
            "join": join, "slice": slice_, "sum": sum_}


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters.update(_wrapped_filters(dict(env.filters)))
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidModel(f"chat template has a syntax error on line {e.lineno}: {_one_line(e.message)}",
                           hint=HINT) from None
    except TemplateLimit as e:  # jinja folds constant expressions while compiling: the limits apply there too
        raise InvalidModel(f"chat template stopped: {e}", hint=HINT) from None
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as e:
        raise InvalidModel(f"chat template cannot be compiled: {_one_line(e) or type(e).__name__}",
                           hint=HINT) from None


class TemplateTimeout(TemplateLimit):
    """Raised asynchronously in the rendering thread when the render runs past its deadline."""


class _Deadline:
    """Raise TemplateTimeout in this thread after ``seconds`` (PyThreadState_SetAsyncExc, the mechanism behind
    Ctrl-C: it stops loops that emit nothing, and costs nothing while the render is on time)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.lock = threading.Lock()
        self.thread_id = threading.get_ident()
        self.active = self.fired = False

    def _fire(self) -> None:
        with self.lock:
            if self.active:
                self.fired = True
                _set_async_exc(self.thread_id, TemplateTimeout)

    def __enter__(self):
        self.active = True
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        with self.lock:
            self.active = False
            if self.fired:  # fired but maybe not delivered yet: it must not surface in the caller's code later
                _set_async_exc(self.thread_id, None)


def _set_async_exc(thread_id: int, exc) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def time_limit() -> float:
    """Seconds one render may take (MLXINFER_TEMPLATE_TIMEOUT overrides the default)."""
    try:
        value = float(os.environ.get("MLXINFER_TEMPLATE_TIMEOUT", TIME_LIMIT_S))
    except ValueError:
        value = TIME_LIMIT_S
    return value if math.isfinite(value) and value > 0 else TIME_LIMIT_S


def _input_chars(messages, extra) -> int:
    try:
        return len(json.dumps([messages, extra], default=str, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return 0


def render(
    template: str | None,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` ([{"role", "content"}]) to the prompt text the model expects. Raises InvalidModel
    (one line) when the template fails, refuses the messages, renders nothing, or breaks a limit."""
    from jinja2.exceptions import SecurityError, TemplateError

    limit_s = time_limit()
    _limits.max_chars = BASE_OUTPUT_CHARS + 4 * _input_chars(messages, extra)
    pieces, size = [], 0
    try:
        with _Deadline(limit_s):
            # Compiling runs template code too (jinja folds constant expressions): under the same deadline.
            compiled = _compile(template or FALLBACK_TEMPLATE)
            for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **(special_tokens or {}), **extra):
                pieces.append(piece)
                size += len(piece)
                _limits.check_size(size, "the rendered prompt")
    except TemplateTimeout:
        raise InvalidModel(f"chat template stopped: rendering took longer than the limit of {limit_s:g} s",
                           hint=HINT) from None
    except TemplateLimit as e:
        raise InvalidModel(f"chat template stopped: {e}", hint=HINT) from None
    except InvalidModel:
        raise
    except SecurityError as e:
        raise InvalidModel(f"chat template refused: it tried to reach Python internals ({_one_line(e)})") from None
    except RecursionError:
        raise InvalidModel("chat template failed to render: it recurses without end", hint=HINT) from None
    except MemoryError:
        raise InvalidModel("chat template failed to render: out of memory", hint=HINT) from None
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as e:
        detail = _one_line(e) or type(e).__name__
        if isinstance(e, ArithmeticError):
            detail = f"{type(e).__name__}: {detail}"
        raise InvalidModel(f"chat template failed to render: {detail}", hint=HINT) from None
    text = "".join(pieces)
    if not text.strip() and messages:  # with no messages at all, nothing is a fair answer
        raise InvalidModel("chat template rendered nothing for these messages", hint=HINT)
    return text


def special_tokens_of(tokenizer) -> dict[str, str]:
    """bos_token/eos_token/... strings that templates reference."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, key, None)
        if isinstance(value, str):
            out[key] = value
    return out
