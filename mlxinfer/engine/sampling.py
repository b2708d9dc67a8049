"""Sampling settings: one validated dataclass shared by generate, chat and bench.

The samplers themselves are mlx-lm's (``make_sampler``, ``make_repetition_penalty``); this module only validates
values once, in one place, and turns them into mlx-lm's callables. Checks that need the model (vocabulary size,
context length) are in ``settings.check_for_model``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import InvalidParameter

SEED_MAX = 2**64 - 1   # mx.random.seed takes an unsigned 64-bit integer (measured: 2**64 raises TypeError)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are picked. temperature 0 is greedy; max_tokens -1 generates until EOS or the end of the
    context. ``validate()`` checks the ranges; the engine also checks top_k and max_tokens against the model."""

    temperature: float = 0.7
    top_p: float = 1.0          # 1.0 = off
    top_k: int = 0              # 0 = off
    min_p: float = 0.0          # 0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_context: int = 64    # how many recent tokens the repetition penalty looks at
    max_tokens: int = 512       # -1: as many as the context holds
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """Check every value's type and range (model-independent); one line naming the setting, its allowed
        range and the value."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "seed" and value is None:
                continue
            whole = "int" in str(f.type)
            ok = isinstance(value, int) if whole else isinstance(value, (int, float))
            if not ok or isinstance(value, bool):
                kind = "a whole number" if whole else "a number"
                raise InvalidParameter(f"invalid {f.name} {value!r}: expected {kind}")
        p = self
        checks = [
            ("temperature", math.isfinite(p.temperature) and p.temperature >= 0, "must be a finite number >= 0 (0 = greedy)"),
            ("top_p", 0 < p.top_p <= 1, "must be in (0, 1] (1 = off)"),
            ("top_k", p.top_k >= 0, "must be >= 0 (0 = off)"),
            ("min_p", 0 <= p.min_p <= 1, "must be in [0, 1] (0 = off)"),
            ("repeat_penalty", math.isfinite(p.repeat_penalty) and p.repeat_penalty > 0,
             "must be a finite number > 0 (1 = off)"),
            ("repeat_context", p.repeat_context > 0, "must be >= 1"),
            ("max_tokens", p.max_tokens > 0 or p.max_tokens == -1, "must be >= 1 (or -1: as many as the context holds)"),
            ("seed", p.seed is None or 0 <= p.seed <= SEED_MAX, f"must be between 0 and {SEED_MAX} (or none: random)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidParameter(f"invalid {name} {_shown(getattr(self, name))}: {rule}")
        return self

    def with_values(self, **changes: Any) -> "SamplingParams":
        """A copy with the non-None ``changes`` applied, validated."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None}).validate()

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def is_whole(cls, name: str) -> bool:
        return "int" in str({f.name: f.type for f in fields(cls)}[name])

    @classmethod
    def coerce(cls, name: str, text: str) -> Any:
        """Parse a user-typed value for ``name`` (e.g. from ``/set temp 0.5``)."""
        if name not in cls.names():
            raise InvalidParameter(f"unknown setting '{name}'", hint=f"settings: {', '.join(cls.names())}")
        text = text.strip()
        if name == "seed" and text.lower() in ("none", "random", "off"):
            return None
        try:
            return int(text) if cls.is_whole(name) else float(text)
        except ValueError:
            kind = "a whole number" if cls.is_whole(name) else "a number"
            raise InvalidParameter(f"invalid {name} {_shown(text)}: expected {kind}") from None


def _shown(value: Any) -> str:
    """The value as the error line shows it: at most 40 characters (a 10,000-digit seed is one line too)."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def make_sampler(params: SamplingParams):
    from mlx_lm.sample_utils import make_sampler as _make_sampler

    def build(top_k: int):
        return _make_sampler(temp=params.temperature, top_p=params.top_p if params.top_p < 1 else 0.0,
                             min_p=params.min_p, top_k=top_k)

    sampler = build(params.top_k)
    if params.top_k <= 0 or params.temperature == 0:
        return sampler
    everything = build(0)

    # top_k equal to the vocabulary keeps every token; mlx-lm refuses k >= vocabulary, so it means "off" there.
    def pick(logprobs):
        return sampler(logprobs) if params.top_k < logprobs.shape[-1] else everything(logprobs)

    return pick


def make_logits_processors(params: SamplingParams) -> list:
    if params.repeat_penalty == 1.0:
        return []
    from mlx_lm.sample_utils import make_repetition_penalty

    return [make_repetition_penalty(params.repeat_penalty, params.repeat_context)]


def repair_random_state() -> bool:
    """mlx-lm's samplers are compiled with MLX's random state as input and output: an exception (or Ctrl-C) while
    one is traced leaves a placeholder in ``mx.random.state`` and every later sampled token fails with "[eval]
    Attempting to eval an array without a primitive". Reseed if so; returns True when it had to."""
    import mlx.core as mx

    try:
        mx.eval(mx.random.state)
        return False
    except (RuntimeError, ValueError):
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        return True
