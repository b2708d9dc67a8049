"""A chat conversation kept warm across turns: messages, system prompt, settings and the model's KV cache.

Each turn renders the whole conversation with the chat template, keeps the longest prefix of tokens the cache
already holds (trimming the rest) and prefills only what is new, so turn N costs its own tokens, not the history.
/retry and /undo are the same move: change the messages, trim the cache to the new common prefix.
Nothing here prints; the UI iterates a ``Turn`` and reads its fields.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParameter, MlxinferError
from . import settings as _settings
from .kv_options import KVOptions, make_cache
from .loader import LoadedModel
from .prompts import chat_prompt, template_system_prompt
from .sampling import SamplingParams, repair_random_state
from .turn import CHAT_PREFILL_STEP, Cancelled, Turn  # noqa: F401 - the Turn of a session, importable from here

SESSION_FORMAT = "mlxinfer.session"
SESSION_VERSION = 1
THINK_MODES = ("on", "off", "hide")   # on: shown dimmed, hide: generated but not shown, off: asked not to think
MIN_CONTEXT = _settings.MIN_CONTEXT
# What ``/set NAME VALUE`` accepts: SamplingParams' fields ("temp" for temperature), the session's "context" and
# the KV-cache options (a change starts a new cache: the history is prefilled again on the next turn).
KV_SETTINGS = ("kv_bits", "max_kv_size")
SETTING_NAMES = _settings.setting_names() + KV_SETTINGS + ("think",)


class SessionError(MlxinferError):
    """A chat action that cannot be done now (nothing to retry, message too long, bad session file)."""


def _is_message(m: Any) -> bool:
    """A message a session holds, saves and loads: {role: user|assistant, content: text} (+ "interrupted")."""
    return isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)


def _check_arguments(loaded, params, messages) -> None:
    """A Session's arguments checked as the CLI's are (one line): a model from load(), SamplingParams, and messages
    its own save and load accept (a system message there, or a role 'robot', failed only at from_dict)."""
    if not (hasattr(loaded, "tokenizer") and hasattr(loaded, "context_length")):
        raise InvalidParameter(f"a Session needs a model from mlxinfer.load(...), not {type(loaded).__name__}")
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidParameter(f"params must be a SamplingParams, not {type(params).__name__}",
                               hint="e.g. SamplingParams(temperature=0)")
    if messages is None:
        return
    if not isinstance(messages, list):
        raise InvalidParameter(f"messages must be a list of {{'role', 'content'}} dicts, not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            raise InvalidParameter(f"message {i} is a system message", hint="pass it as Session(..., system=TEXT)")
        if not _is_message(m):
            raise InvalidParameter(f"message {i} must be {{'role': 'user' or 'assistant', 'content': text}}")


def _spec_defaults(loaded) -> dict:
    spec = getattr(loaded, "spec", None)
    return dict(getattr(spec, "defaults", None) or {})


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
        kv: KVOptions | None = None,
    ):
        _check_arguments(loaded, params, messages)
        self.loaded = loaded
        # Without params: the model's models.toml defaults (as chat uses them), sized to its context.
        self.params = (_settings.check_for_model(params, loaded) if params is not None
                       else _settings.resolve(_spec_defaults(loaded), loaded=loaded))
        self.system = system or None
        self._context: int | None = None
        if context is not None:
            self.set_context(context)
        self.think = "on"
        self.set_think(think)
        self.messages: list[dict] = [dict(m) for m in (messages or [])]
        self.kv = (kv or KVOptions()).validate(loaded.context_length)  # quantized / capped cache (kv_options)
        make_cache(loaded.model, self.kv)  # refused now, not at the first message, when the model cannot take it
        self._cache: list | None = None
        self._cache_tokens: list[int] = []
        # A message dropped before its reply began: the cache still holds what was read of it (reused when it is
        # sent again), which the conversation does not take.
        self._dropped_tail = False
        self._turn: Turn | None = None  # the latest turn started: an earlier one left unrun must not run later

    # ----- settings -----
    @property
    def context_limit(self) -> int:
        return self._context or self.loaded.context_length

    @property
    def context_used(self) -> int:
        """Tokens the conversation takes, as the next turn's prompt starts with it (without the next reply's
        header): the same number live, resumed, after /undo or a /system change (the cache's own count was short
        after a trim: 6 tokens for a 2-message chat once /system changed). Renders and tokenizes the history:
        milliseconds, once per turn and per /show."""
        if not self.messages:
            return 0 if self._dropped_tail else len(self._cache_tokens)
        try:
            return len(self.render(generation_prompt=False))
        except MlxinferError:
            return len(self._cache_tokens)

    def set_context(self, n: int) -> None:
        self._context = _settings.check_context(n, self.loaded)

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
        key = name.strip().lower().replace("-", "_")
        if key in KV_SETTINGS:
            return self._set_kv(key, value)
        if key == "think":  # /show lists it with the settings; /think is its own command too
            self.set_think(str(value).strip().lower())
            return "think"
        field = _settings.field_for(name)
        if field is None:
            import difflib

            near = difflib.get_close_matches(name, SETTING_NAMES, n=1, cutoff=0.5)
            hint = (f"did you mean '{near[0]}'? " if near else "") + f"settings: {', '.join(SETTING_NAMES)}"
            raise InvalidParameter(f"unknown setting '{name}'", hint=hint)
        from dataclasses import replace

        v = SamplingParams.coerce(field, value) if isinstance(value, str) else value
        self.params = _settings.check_for_model(replace(self.params, **{field: v}), self.loaded)
        return field

    def _set_kv(self, key: str, value: Any) -> str:
        from dataclasses import replace

        from .kv_options import pick

        if isinstance(value, str):
            text = value.strip().lower()
            try:
                value = None if text in ("off", "none", "0") else int(text)
            except ValueError:
                raise InvalidParameter(f"invalid {key} {value!r}: expected a whole number or 'off'") from None
        field = next(iter(pick({key: 0})))
        # Messages in the names /set takes (KV_SETTINGS), not the command-line flags.
        other = KV_SETTINGS[1] if field == "bits" else KV_SETTINGS[0]
        opts = replace(self.kv, **{field: value}).validate(self.loaded.context_length, names=KV_SETTINGS,
                                                           combine_hint=f"turn the other off first: /set {other} off")
        make_cache(self.loaded.model, opts)
        if opts != self.kv:
            self.kv = opts
            self.reset_cache()  # another kind of cache: the history is prefilled into a new one next turn
        return key

    def settings(self) -> dict[str, Any]:
        return {**self.params.as_dict(), "context": self.context_limit, "think": self.think,
                "system": self.system, **self.kv.as_dict()}

    # ----- rendering and the cache -----
    def template_messages(self, messages: list[dict] | None = None) -> list[dict[str, str]]:
        msgs = self.messages if messages is None else messages
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in msgs]

    def render(self, messages: list[dict] | None = None, *, generation_prompt: bool = True) -> list[int]:
        extra = {"enable_thinking": False} if self.think == "off" else {}
        return chat_prompt(self.loaded, self.template_messages(messages), add_generation_prompt=generation_prompt,
                           **extra)

    def _reuse(self, tokens: list[int]) -> int:
        """Trim the cache to its common prefix with ``tokens`` (leaving at least one token to feed)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        if self._cache is None:
            self._cache, self._cache_tokens = make_cache(self.loaded.model, self.kv), []
        self._dropped_tail = False
        n = min(common_prefix(self._cache_tokens, tokens), max(len(tokens) - 1, 0))
        if n < len(self._cache_tokens):
            if can_trim_prompt_cache(self._cache) and self._trim_layers(n):
                pass
            else:  # e.g. a rotated sliding-window cache (or --max-kv-size past its size): start over
                self._cache, n = make_cache(self.loaded.model, self.kv), 0
        self._cache_tokens = self._cache_tokens[:n]
        return n

    def _trim_layers(self, n: int) -> bool:
        """Trim every layer's cache to ``n`` tokens; False if a layer cannot say how much it holds."""
        offsets = [getattr(c, "offset", None) for c in self._cache]
        if any(not isinstance(o, int) for o in offsets):
            return False
        if any(off > n and hasattr(c, "is_trimmable") and not c.is_trimmable()
               for c, off in zip(self._cache, offsets)):
            return False  # a rotating cache that has dropped tokens cannot go back
        for c, off in zip(self._cache, offsets):
            if off > n:
                c.trim(off - n)
        return True

    def reset_cache(self) -> None:
        self._cache, self._cache_tokens, self._turn = None, [], None

    def sync(self) -> None:
        """Trim the cache to what the current messages still share with it (after /undo, /system, ...)."""
        self._turn = None  # a turn made before the change renders a conversation that is no longer there
        if self._cache is not None:
            self._reuse(self.render())

    def _fit(self) -> tuple[list[int], int]:
        """Render, dropping the oldest exchanges (never the system prompt or the newest message) until the prompt
        plus some room for the reply fits the context. Raises if the newest message alone does not fit."""
        limit = self.context_limit
        newest = self.render(self.messages[-1:])
        if len(newest) >= limit:  # checked first: a message that cannot fit must not cost the history
            raise SessionError(
                f"the message takes {len(newest)} tokens with the system prompt and chat template, which leaves "
                f"no room for a reply in a {limit}-token context",
                hint=self._shorten_hint() + (
                    ", or raise the limit with /set context" if limit < self.loaded.context_length else
                    f" ({limit} tokens is this model's whole context)"),
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

    def _shorten_hint(self) -> str:
        if self.system or not template_system_prompt(self.loaded):
            return "shorten it or the system prompt"
        return "shorten it, or replace the chat template's own system prompt with a shorter /system TEXT"

    def _start(self, before: list[dict]) -> Turn:
        """Start a turn on the current messages; ``before`` is the history to go back to if it fails."""
        try:
            tokens, dropped = self._fit()
        except BaseException:
            self.messages = before
            raise
        reused = self._reuse(tokens)
        left = self.context_limit - len(tokens)
        max_tokens = left if self.params.max_tokens <= 0 else min(self.params.max_tokens, left)
        turn = Turn(self, tokens, reused, dropped, max_tokens)
        turn.before = before
        self._turn = turn
        return turn

    def _undo_failed_turn(self, turn: Turn) -> None:
        """Back to before the turn: its messages gone, the cache trimmed to the prefix it had reused (checked by
        evaluating it; rebuilt on the next turn if that fails), MLX's random state usable again."""
        import mlx.core as mx

        self.messages = turn.before
        repair_random_state()
        try:
            offsets = [getattr(c, "offset", None) for c in self._cache or []]
            if not offsets or any(not isinstance(o, int) or o < turn.reused for o in offsets):
                raise ValueError("the cache does not hold the reused prefix")
            self._trim_layers(turn.reused)
            mx.eval([c.state for c in self._cache])
            self._cache_tokens = turn.tokens[:turn.reused]
        except Exception:  # noqa: BLE001 - whatever is wrong with it, a fresh cache is right
            self.reset_cache()

    def _finish_turn(self, turn: Turn, broken: bool) -> None:
        stats = turn.stats
        if turn.error is not None:
            self._undo_failed_turn(turn)
            return
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
        if turn.interrupted and (stats is None or stats.generation_tokens == 0) and not turn.terminated:
            # Cut off before the reply began: keep no half exchange (two user turns in a row break some templates).
            if turn.dropped:  # the turns dropped to make room for it come back with it gone
                self.messages = [dict(m) for m in turn.before]
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            if turn.dropped:
                self.sync()  # the cache held the shortened history: keep only what the restored one shares
            self._dropped_tail = True
            turn.discarded = True
            return
        reply = {"role": "assistant", "content": turn.text}
        if turn.interrupted:
            reply["interrupted"] = True
        self.messages.append(reply)

    # ----- conversation actions -----
    def send(self, text: str) -> Turn:
        """Add a user message and return the Turn that generates the reply (iterate it)."""
        if not isinstance(text, str):
            raise InvalidParameter(f"a message must be text, not {type(text).__name__}")
        if not text.strip():
            raise SessionError("empty message")
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()  # a turn that was never run
        before = [dict(m) for m in self.messages]
        self.messages.append({"role": "user", "content": text})
        return self._start(before)

    def retry(self) -> Turn:
        """Regenerate the last reply: the cache is trimmed back to the end of the last user message."""
        before = [dict(m) for m in self.messages]
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise SessionError("nothing to retry yet", hint="send a message first")
        return self._start(before)

    def undo(self) -> dict | None:
        """Drop the last exchange (reply and the message before it); returns the user message removed."""
        if not self.messages:
            return None
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        removed = self.messages.pop() if self.messages and self.messages[-1]["role"] == "user" else None
        self.sync()
        return removed

    def keep_unanswered(self) -> None:
        """The program is ending between a message and its reply (SIGTERM): keep the message, with an empty reply
        marked interrupted, so a saved session does not lose it (a trailing user message is dropped on resume)."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.append({"role": "assistant", "content": "", "interrupted": True})

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
        """Carry the conversation over to another model (its cache starts empty). Refuses, changing nothing, when
        a setting does not suit the new model (e.g. top_k above its vocabulary)."""
        _settings.check_for_model(self.params, loaded)
        make_cache(loaded.model, self.kv.validate(loaded.context_length))
        self.loaded = loaded
        if self._context and self._context > loaded.context_length:
            self._context = None
        self.reset_cache()

    # ----- persistence (the file handling is in store.py) -----
    def to_dict(self) -> dict:
        return {
            "format": SESSION_FORMAT, "version": SESSION_VERSION, "model": self.loaded.name,
            "system": self.system, "think": self.think,
            "settings": {**self.params.as_dict(), "context": self._context,
                         **{k: v for k, v in self.kv.as_dict().items() if k in KV_SETTINGS}},
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
        if not isinstance(msgs, list) or not all(_is_message(m) for m in msgs):
            raise SessionError("session messages must be a list of {role: user|assistant, content: text}")
        if not isinstance(data.get("settings", {}), dict):
            raise SessionError("session settings must be a table")
        if data.get("system") is not None and not isinstance(data["system"], str):  # every message failed later
            raise SessionError("the session's system prompt must be text or null")
        if data.get("think", "on") not in THINK_MODES:
            raise SessionError(f"the session's think mode must be one of {', '.join(THINK_MODES)}")
        return data

    @classmethod
    def from_dict(cls, data: dict, loaded: LoadedModel, params: SamplingParams | None = None,
                  kv: KVOptions | None = None) -> "Session":
        """A session from saved data; ``params`` / ``kv`` (e.g. saved settings with flags over them) replace the
        saved settings when given."""
        data = cls.check_dict(data)
        settings = dict(data.get("settings") or {})
        context = settings.pop("context", None)
        if params is None:
            try:
                params = _settings.resolve(saved=settings, loaded=loaded)
            except InvalidParameter as e:
                raise SessionError(f"the session's settings are invalid ({e})") from None
        if kv is None:
            try:
                kv = _settings.resolve_kv(saved=settings, loaded=loaded)
            except (InvalidParameter, TypeError) as e:
                raise SessionError(f"the session's KV-cache settings are invalid ({e})") from None
        if not isinstance(context, int) or isinstance(context, bool) or not (
                MIN_CONTEXT <= context <= loaded.context_length):
            context = None  # saved for a model with a longer context (or garbled): the model's own limit
        return cls(loaded, params, system=data.get("system"), context=context, think=data.get("think", "on"),
                   messages=data["messages"], kv=kv)
