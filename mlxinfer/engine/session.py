"""A chat conversation kept warm across turns: messages, system prompt, settings and the model's KV cache.

Each turn renders the whole conversation with the chat template, keeps the longest prefix of tokens the cache
already holds (trimming the rest) and prefills only what is new, so turn N costs its own tokens, not the history.
/retry and /undo are the same move: change the messages, trim the cache to the new common prefix.
Nothing here prints; the UI iterates a ``Turn`` and reads its fields.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import InvalidParameter, MlxinferError
from .generate import Response, chat_prompt, stream_generate
from .loader import LoadedModel
from .sampling import SamplingParams

SESSION_FORMAT = "mlxinfer.session"
SESSION_VERSION = 1
THINK_MODES = ("on", "off", "hide")   # on: shown dimmed, hide: generated but not shown, off: asked not to think
# Prefill in small chunks in chat so a cancel lands within a few seconds even on a slow CPU prefill.
CHAT_PREFILL_STEP = 128
MIN_CONTEXT = 32
# User-facing setting names (``/set NAME VALUE``) -> SamplingParams fields; "context" is the session's own.
SETTING_ALIASES = {
    "temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repeat_penalty": "repeat_penalty", "repeat_context": "repeat_context", "max_tokens": "max_tokens",
    "seed": "seed",
}
SETTING_NAMES = ("temp", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_context", "max_tokens", "seed",
                 "context")


class SessionError(MlxinferError):
    """A chat action that cannot be done now (nothing to retry, message too long, bad session file)."""


class Cancelled(Exception):
    """Raised inside the prefill progress callback to stop a cancelled turn at a chunk boundary."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Turn:
    """One reply being generated. Iterate it for ``Response`` pieces; ``cancel()`` (e.g. from a SIGINT handler)
    stops it at the next token or prefill chunk. When iteration ends, however it ends, the reply is in the
    session's history (``interrupted`` if cut short) and the cache is re-synced to the tokens it really holds."""

    def __init__(self, session: "Session", tokens: list[int], reused: int, dropped: int, max_tokens: int):
        self.session = session
        self.tokens = tokens            # the full rendered prompt (history + generation prompt)
        self.reused = reused            # of which the cache already held this many
        self.dropped = dropped          # messages dropped from the start of the history to fit the context
        self.max_tokens = max_tokens    # this turn's limit (the setting, capped by the room left in the context)
        self.text = ""
        self.stats = None
        self.interrupted = False
        self.discarded = False          # cancelled before the first token: the exchange was removed
        self.on_prefill = None          # optional callback(done, total) while the prompt is prefilled
        self._cancel = False
        self._started = False

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.reused

    def cancel(self) -> None:
        self._cancel = True

    def _progress(self, done: int, total: int) -> None:
        if self.on_prefill is not None:
            self.on_prefill(done, total)  # may cancel (the UI polls for Ctrl-C here)
        if self._cancel and done < total:
            raise Cancelled  # the chunks done so far are complete in the cache and stay usable

    def __iter__(self) -> Iterator[Response]:
        if self._started:
            raise RuntimeError("a Turn can be iterated once")
        self._started = True
        s = self.session
        params = s.params.with_values(max_tokens=self.max_tokens)
        stream = stream_generate(
            s.loaded, self.tokens[self.reused:], params, cache=s._cache, prompt_progress=self._progress,
            prefill_step_size=CHAT_PREFILL_STEP,
        )
        broken = False
        try:
            while not self._cancel:
                try:
                    r = next(stream)
                except StopIteration:
                    break
                except Cancelled:
                    self._cancel = True
                    break
                except BaseException:
                    # Raised inside the model call (KeyboardInterrupt, an MLX error): a layer's cache may be
                    # half-updated, so it cannot be trusted.
                    broken = self._cancel = True
                    raise
                self.text += r.text
                self.stats = r.stats
                yield r
        finally:
            # Read before close(): closing a suspended stream marks its stats "interrupted" itself.
            complete = self.stats is not None and self.stats.finish_reason in ("stop", "length")
            stream.close()
            self.interrupted = not complete
            if self.stats is not None and self.interrupted:
                self.stats.finish_reason = "interrupted"
            s._finish_turn(self, broken)


class Session:
    """Messages ({"role", "content"[, "interrupted"]}) + settings + the KV cache that mirrors them."""

    def __init__(
        self,
        loaded: LoadedModel,
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        context: int | None = None,
        think: str = "on",
        messages: list[dict] | None = None,
    ):
        self.loaded = loaded
        self.params = (params or SamplingParams()).validate()
        self.system = system or None
        self._context: int | None = None
        if context is not None:
            self.set_context(context)
        self.think = "on"
        self.set_think(think)
        self.messages: list[dict] = [dict(m) for m in (messages or [])]
        self._cache: list | None = None
        self._cache_tokens: list[int] = []

    # ----- settings -----
    @property
    def context_limit(self) -> int:
        return self._context or self.loaded.context_length

    @property
    def context_used(self) -> int:
        """Tokens the KV cache holds now (history + last reply)."""
        return len(self._cache_tokens)

    def set_context(self, n: int) -> None:
        top = self.loaded.context_length
        if not MIN_CONTEXT <= n <= top:
            raise InvalidParameter(f"invalid context {n}: must be between {MIN_CONTEXT} and {top} (the model's limit)")
        self._context = n

    def set_think(self, mode: str) -> None:
        if mode not in THINK_MODES:
            raise InvalidParameter(f"invalid think mode {mode!r}: use one of {', '.join(THINK_MODES)}")
        self.think = mode

    def set(self, name: str, value: Any) -> str:
        """Change one setting from user text (``/set temp 0.5``); returns the canonical name. Validates."""
        if name == "context":
            try:
                self.set_context(int(value))
            except ValueError:
                raise InvalidParameter(f"invalid context {value!r}: expected a whole number") from None
            return "context"
        field = SETTING_ALIASES.get(name)
        if field is None:
            raise InvalidParameter(f"unknown setting '{name}'", hint=f"settings: {', '.join(SETTING_NAMES)}")
        from dataclasses import replace

        v = SamplingParams.coerce(field, value) if isinstance(value, str) else value
        self.params = replace(self.params, **{field: v}).validate()
        return field

    def settings(self) -> dict[str, Any]:
        return {**self.params.as_dict(), "context": self.context_limit, "think": self.think,
                "system": self.system}

    # ----- rendering and the cache -----
    def template_messages(self, messages: list[dict] | None = None) -> list[dict[str, str]]:
        msgs = self.messages if messages is None else messages
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in msgs]

    def render(self, messages: list[dict] | None = None) -> list[int]:
        extra = {"enable_thinking": False} if self.think == "off" else {}
        return chat_prompt(self.loaded, self.template_messages(messages), **extra)

    def _reuse(self, tokens: list[int]) -> int:
        """Trim the cache to its common prefix with ``tokens`` (leaving at least one token to feed)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        if self._cache is None:
            self._cache, self._cache_tokens = make_prompt_cache(self.loaded.model), []
        n = min(common_prefix(self._cache_tokens, tokens), max(len(tokens) - 1, 0))
        if n < len(self._cache_tokens):
            if can_trim_prompt_cache(self._cache) and self._trim_layers(n):
                pass
            else:  # e.g. a rotated sliding-window cache: start over
                self._cache, n = make_prompt_cache(self.loaded.model), 0
        self._cache_tokens = self._cache_tokens[:n]
        return n

    def _trim_layers(self, n: int) -> bool:
        """Trim every layer's cache to ``n`` tokens; False if a layer cannot say how much it holds."""
        offsets = [getattr(c, "offset", None) for c in self._cache]
        if any(not isinstance(o, int) for o in offsets):
            return False
        for c, off in zip(self._cache, offsets):
            if off > n:
                c.trim(off - n)
        return True

    def reset_cache(self) -> None:
        self._cache, self._cache_tokens = None, []

    def sync(self) -> None:
        """Trim the cache to what the current messages still share with it (after /undo, /system, ...)."""
        if self._cache is not None:
            self._reuse(self.render())

    def _fit(self) -> tuple[list[int], int]:
        """Render, dropping the oldest exchanges (never the system prompt or the newest message) until the prompt
        plus some room for the reply fits the context. Raises if the newest message alone does not fit."""
        limit = self.context_limit
        newest = self.render(self.messages[-1:])
        if len(newest) >= limit:  # checked first: a message that cannot fit must not cost the history
            raise SessionError(
                f"the message needs {len(newest)} tokens but the context holds {limit}",
                hint="shorten it, shorten the system prompt, or raise the limit with /set context",
            )
        want = self.params.max_tokens if self.params.max_tokens > 0 else limit
        room = max(1, min(want, limit // 4))
        tokens, dropped = self.render(), 0
        while len(tokens) + room > limit and len(self.messages) > 1:
            self.messages.pop(0)
            dropped += 1
            while len(self.messages) > 1 and self.messages[0]["role"] != "user":
                self.messages.pop(0)
                dropped += 1
            tokens = self.render()
        return tokens, dropped

    def _start(self) -> Turn:
        try:
            tokens, dropped = self._fit()
        except Exception:
            self.messages.pop()
            raise
        reused = self._reuse(tokens)
        left = self.context_limit - len(tokens)
        max_tokens = left if self.params.max_tokens <= 0 else min(self.params.max_tokens, left)
        return Turn(self, tokens, reused, dropped, max_tokens)

    def _finish_turn(self, turn: Turn, broken: bool) -> None:
        stats = turn.stats
        if broken or self._cache is None:
            self.reset_cache()
        else:
            known = turn.tokens + (list(stats.tokens) if stats else [])
            offsets = [getattr(c, "offset", None) for c in self._cache]
            if any(not isinstance(o, int) for o in offsets):
                self.reset_cache()
            else:
                n = min(min(offsets), len(known))
                if self._trim_layers(n):
                    self._cache_tokens = known[:n]
                else:
                    self.reset_cache()
        if turn.interrupted and (stats is None or stats.generation_tokens == 0):
            # Cut off before the reply began: keep no half exchange (two user turns in a row break some templates).
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            turn.discarded = True
            return
        reply = {"role": "assistant", "content": turn.text}
        if turn.interrupted:
            reply["interrupted"] = True
        self.messages.append(reply)

    # ----- conversation actions -----
    def send(self, text: str) -> Turn:
        """Add a user message and return the Turn that generates the reply (iterate it)."""
        if not text.strip():
            raise SessionError("empty message")
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()  # a turn that was never run
        self.messages.append({"role": "user", "content": text})
        return self._start()

    def retry(self) -> Turn:
        """Regenerate the last reply: the cache is trimmed back to the end of the last user message."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise SessionError("nothing to retry yet", hint="send a message first")
        return self._start()

    def undo(self) -> dict | None:
        """Drop the last exchange (reply and the message before it); returns the user message removed."""
        if not self.messages:
            return None
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        removed = self.messages.pop() if self.messages and self.messages[-1]["role"] == "user" else None
        self.sync()
        return removed

    def clear(self) -> None:
        """A new conversation: history and cache gone; system prompt and settings stay."""
        self.messages = []
        self.reset_cache()

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self.sync()

    def last_reply(self) -> str | None:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None

    def switch_model(self, loaded: LoadedModel) -> None:
        """Carry the conversation over to another model (its cache starts empty)."""
        self.loaded = loaded
        if self._context and self._context > loaded.context_length:
            self._context = None
        self.reset_cache()

    # ----- persistence (the file handling is in store.py) -----
    def to_dict(self) -> dict:
        return {
            "format": SESSION_FORMAT, "version": SESSION_VERSION, "model": self.loaded.name,
            "system": self.system, "think": self.think,
            "settings": {**self.params.as_dict(), "context": self._context},
            "messages": [dict(m) for m in self.messages],
        }

    @staticmethod
    def check_dict(data: Any) -> dict:
        """Validate a saved session's structure; returns it. Raises SessionError with what is wrong."""
        if not isinstance(data, dict) or data.get("format") != SESSION_FORMAT:
            raise SessionError("not an mlxinfer session file")
        if data.get("version") != SESSION_VERSION:
            raise SessionError(f"session format version {data.get('version')} is not supported (expected 1)")
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            for m in msgs
        ):
            raise SessionError("session messages must be a list of {role: user|assistant, content: text}")
        if not isinstance(data.get("settings", {}), dict):
            raise SessionError("session settings must be a table")
        return data

    @classmethod
    def from_dict(cls, data: dict, loaded: LoadedModel) -> "Session":
        data = cls.check_dict(data)
        settings = dict(data.get("settings") or {})
        context = settings.pop("context", None)
        known = set(SamplingParams.names())
        try:
            params = SamplingParams(**{k: v for k, v in settings.items() if k in known}).validate()
        except (TypeError, ValueError) as e:
            raise SessionError(f"the session's settings are invalid ({e})") from None
        if isinstance(context, int) and context > loaded.context_length:
            context = None
        return cls(loaded, params, system=data.get("system"), context=context, think=data.get("think", "on"),
                   messages=data["messages"])
