"""Sampling settings: one validated dataclass shared by generate, chat and bench.

The samplers themselves are mlx-lm's (``make_sampler``, ``make_repetition_penalty``); this module only validates
values once, in one place, and turns them into mlx-lm's callables.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import InvalidParameter


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0          # 1.0 = off
    top_k: int = 0              # 0 = off
    min_p: float = 0.0          # 0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_context: int = 64    # how many recent tokens the repetition penalty looks at
    max_tokens: int = 512
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be >= 0 (0 = greedy)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("min_p", 0 <= self.min_p < 1, "must be in [0, 1)"),
            ("repeat_penalty", math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0, "must be > 0 (1 = off)"),
            ("repeat_context", self.repeat_context > 0, "must be > 0"),
            ("max_tokens", self.max_tokens > 0 or self.max_tokens == -1, "must be > 0 (or -1 for no limit)"),
            ("seed", self.seed is None or self.seed >= 0, "must be >= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidParameter(f"invalid {name} {getattr(self, name)!r}: {rule}")
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
    def coerce(cls, name: str, text: str) -> Any:
        """Parse a user-typed value for ``name`` (e.g. from ``/set temp 0.5``)."""
        kinds = {f.name: f.type for f in fields(cls)}
        if name not in kinds:
            raise InvalidParameter(f"unknown setting '{name}'", hint=f"settings: {', '.join(cls.names())}")
        try:
            if name == "seed" and text.lower() in ("none", "random", "off"):
                return None
            return int(text) if "int" in str(kinds[name]) else float(text)
        except ValueError:
            raise InvalidParameter(f"invalid {name} {text!r}: expected a number") from None


def make_sampler(params: SamplingParams):
    from mlx_lm.sample_utils import make_sampler as _make_sampler

    return _make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1 else 0.0,
        min_p=params.min_p,
        top_k=params.top_k,
    )


def make_logits_processors(params: SamplingParams) -> list:
    if params.repeat_penalty == 1.0:
        return []
    from mlx_lm.sample_utils import make_repetition_penalty

    return [make_repetition_penalty(params.repeat_penalty, params.repeat_context)]
