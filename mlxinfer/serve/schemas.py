"""Request validation for the OpenAI routes: JSON in, a checked ``Job`` out, or an ``ApiError`` in OpenAI's shape.

Anything a request asks for that the engine does not do (n > 1, tools, images, echo, ...) is refused with a 400
naming the field, never silently ignored. Sampling values go through the engine's one precedence rule
(``engine.settings.resolve``: registry defaults < request < server flags) and its checks against the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..engine.sampling import SamplingParams
from ..errors import InvalidParameter

MAX_STOP = 4
MAX_STOP_CHARS = 1000
TEMPERATURE_MAX = 2.0  # OpenAI's range: 0 to 2
MAX_TOP_LOGPROBS = 20

# Request fields -> SamplingParams fields (the extensions keep their llama.cpp / vLLM names).
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repeat_penalty", "repeat_penalty": "repeat_penalty", "seed": "seed"}
_COMMON = {"model", "max_tokens", "stream", "stream_options", "stop", "n", "user", "logprobs",
           "presence_penalty", "frequency_penalty", "logit_bias", "metadata", "store", *_SAMPLING}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                         "function_call", "parallel_tool_calls", "response_format", "modalities", "audio"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


class ApiError(Exception):
    """An HTTP error with OpenAI's JSON body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
             404: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class Job:
    """What the scheduler runs for one request."""

    kind: str                       # "chat" | "completion"
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None     # None: off; else how many alternatives per token (0 = the chosen token only)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False        # generate exactly max_tokens (``mlxinfer bench -b``; no HTTP field sets it)


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body nests JSON too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    return data


def _check_fields(data: dict, allowed: set[str]) -> None:
    for key in data:
        if key not in allowed:
            raise bad(f"unsupported field '{key}'", param=key, code="unsupported_field")


def _refuse(data: dict, key: str, ok, why: str) -> None:
    if key in data and data[key] is not None and not ok(data[key]):
        raise bad(f"'{key}' {why}", param=key, code="unsupported_value")


def _int(data: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = data.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(f"'{key}' must be a whole number {rng}, got {json.dumps(v)[:40]}", param=key)
    return v


def _bool(data: dict, key: str) -> bool:
    v = data.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false", param=key)
    return v


def _common(data: dict) -> None:
    _refuse(data, "n", lambda v: v == 1, "must be 1: one choice per request is supported")
    _refuse(data, "best_of", lambda v: v == 1, "must be 1")
    for key in ("presence_penalty", "frequency_penalty"):
        _refuse(data, key, lambda v: v == 0, "is not supported (use repetition_penalty)")
    _refuse(data, "logit_bias", lambda v: v == {}, "is not supported")
    _refuse(data, "user", lambda v: isinstance(v, str), "must be a string")
    if "model" in data and data["model"] is not None and not isinstance(data["model"], str):
        raise bad("'model' must be a string", param="model")


def _stop(data: dict) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
    if any(len(x) > MAX_STOP_CHARS for x in stop):  # each token looks back this far for a stop across pieces
        raise bad(f"each 'stop' string may have at most {MAX_STOP_CHARS} characters", param="stop")
    for x in stop:
        _check_unicode(x, "stop")
    return stop


# Message fields OpenAI's SDK may send back empty with an assistant message it received: fine while empty.
_EMPTY_OK = ("tool_calls", "function_call", "audio", "refusal", "annotations")


def _message_text(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object with 'role' and 'content'", param=f"messages[{i}]")
    role = m.get("role")
    for key in ("tool_calls", "function_call", "audio"):
        if m.get(key):
            raise bad(f"messages[{i}].{key}: tool and audio messages are not supported", param=f"messages[{i}]")
    for key, value in m.items():
        if key not in ("role", "content") and not (key in _EMPTY_OK and not value):
            what = "participant names are not supported" if key == "name" else "unsupported field"
            raise bad(f"messages[{i}].{key[:40]}: {what}", param=f"messages[{i}].{key[:40]}",
                      code="unsupported_field")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in ("system", "user", "assistant"):
        raise bad(f"messages[{i}].role {json.dumps(role)[:40]} is not supported (system, user or assistant)",
                  param=f"messages[{i}].role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported (got {json.dumps(kind)[:40]}); "
                          "this model takes no images or audio", param=f"messages[{i}].content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")
    _check_unicode(content, f"messages[{i}].content")
    return {"role": role, "content": content}


def _check_unicode(text: str, param: str) -> None:
    """JSON's \\ud800 escapes give lone surrogates, which no tokenizer takes: named here, not deep inside it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{param}' is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start} "
                  "(send whole characters)", param=param) from None


def chat_messages(data: dict) -> list[dict[str, str]]:
    _check_fields(data, CHAT_FIELDS)
    _common(data)
    for key in ("tools", "functions"):
        _refuse(data, key, lambda v: v == [], "(tool calling) is not supported")
    for key in ("tool_choice", "function_call"):
        _refuse(data, key, lambda v: v == "none", "(tool calling) is not supported")
    _refuse(data, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
            "is not supported (only {\"type\": \"text\"})")
    _refuse(data, "modalities", lambda v: v == ["text"], "must be [\"text\"]")
    _refuse(data, "audio", lambda v: False, "is not supported")
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", param="messages")
    return [_message_text(i, m) for i, m in enumerate(msgs)]


def completion_prompt(data: dict) -> str | list[int]:
    _check_fields(data, COMPLETION_FIELDS)
    _common(data)
    _refuse(data, "echo", lambda v: v is False, "is not supported")
    _refuse(data, "suffix", lambda v: False, "is not supported")
    p = data.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list; several would be n > 1
    if isinstance(p, str) and p:
        _check_unicode(p, "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p  # ids outside the vocabulary, negative ones too, are named where the vocabulary is known (app)
    raise bad("'prompt' must be a non-empty string or token list (one prompt per request)", param="prompt")


def sampling_values(data: dict) -> dict[str, Any]:
    """The request's sampling values under SamplingParams' names (type checks happen in SamplingParams)."""
    out: dict[str, Any] = {}
    if data.get("repetition_penalty") is not None and data.get("repeat_penalty") is not None:
        raise bad("give 'repetition_penalty' or 'repeat_penalty', not both (two names for one setting)",
                  param="repeat_penalty")
    for key, name in _SAMPLING.items():
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad(f"'{key}' must be a number", param=key)
        out[name] = v
    t = out.get("temperature")
    if t is not None and not 0 <= t <= TEMPERATURE_MAX:
        raise bad(f"'temperature' must be between 0 and {TEMPERATURE_MAX:g}, got {t!r:.40}", param="temperature")
    seed = out.get("seed")
    if isinstance(seed, int) and -(2**63) <= seed < 0:
        out["seed"] = seed % 2**64  # OpenAI's seed is a signed 64-bit integer; the sampler's is unsigned
    return out


def resolve_params(data: dict, loaded, flags: dict, registry_defaults: dict) -> SamplingParams:
    from ..engine.settings import resolve

    values = sampling_values(data)
    try:
        return resolve(registry_defaults, values, flags, loaded=loaded)
    except InvalidParameter as e:
        name = str(e).split(" ")[1] if str(e).startswith("invalid ") else None
        raise bad(str(e), param={"repeat_penalty": "repetition_penalty"}.get(name, name)) from None


def max_tokens(data: dict, kind: str, prompt_len: int, context: int, default: int) -> int:
    """The request's token budget: its own max_tokens (checked against the context, as OpenAI does), else the
    default capped by the room left in the context."""
    key = "max_completion_tokens" if kind == "chat" and data.get("max_completion_tokens") is not None \
        else "max_tokens"
    if key != "max_tokens":
        _int(data, "max_tokens", 1)  # its type is checked too, though max_completion_tokens (OpenAI's newer) counts
    asked = _int(data, key, 1)
    if prompt_len >= context:
        raise bad(f"the prompt is {prompt_len} tokens, the model's context is {context}: shorten the prompt",
                  param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    room = context - prompt_len
    if asked is not None and asked > room:
        raise bad(f"the prompt ({prompt_len} tokens) plus {key} ({asked}) exceed the model's context of {context} "
                  f"tokens: ask for at most {room}", param=key, code="context_length_exceeded")
    if asked is not None:
        return asked
    return room if default == -1 else min(default, room)


def logprobs_setting(data: dict, kind: str) -> int | None:
    if kind == "chat":
        on = _bool(data, "logprobs")
        top = _int(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if on else None
    return _int(data, "logprobs", 0, 5)


def stream_settings(data: dict) -> tuple[bool, bool]:
    stream = _bool(data, "stream")
    opts = data.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict) or any(k not in ("include_usage",) for k in opts):
        raise bad("'stream_options' supports only include_usage", param="stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", param="stream_options")
    return stream, _bool(opts, "include_usage")
