"""What to measure: lists of lengths in llama-bench syntax, expanded into test cases, and seeded prompt tokens.

Syntax of a length list (as in llama-bench): ``512``, ``128,256,512``, ``128-512`` (step 1), ``128-512+128``
(additive step), ``64-1024*2`` (multiplicative step); items may be mixed: ``16,64-256*2``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import InvalidParameter

_RANGE = re.compile(r"^(-?\d+)-(-?\d+)(?:([+*])(-?\d+))?$")
MAX_CASES = 10_000  # a range like 1-1000000 is almost surely a typo


def parse_int_list(text: str | int | Sequence[int], name: str, *, minimum: int = 1) -> list[int]:
    """Parse a llama-bench style list into distinct ints in the given order; raise InvalidParameter on bad input."""
    if isinstance(text, int):
        items = [str(text)]
    elif isinstance(text, str):
        items = [t.strip() for t in text.split(",")]
    else:
        items = [str(t) for t in text]
    out: list[int] = []
    for item in items:
        if not item:
            raise InvalidParameter(f"empty value in {name} {text!r}", hint="use e.g. 128,256 or 128-512+128")
        if re.fullmatch(r"-?\d+", item):
            values = [int(item)]
        else:
            m = _RANGE.match(item)
            if not m:
                raise InvalidParameter(
                    f"cannot read {name} value {item!r}",
                    hint="use numbers, lists (128,256) or ranges (128-512, 128-512+128, 64-1024*2)",
                )
            values = _expand_range(int(m[1]), int(m[2]), m[3] or "+", int(m[4] or 1), name, item)
        for v in values:
            if v < minimum:
                rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise InvalidParameter(f"invalid {name} {v}: must be {rule}")
            if v not in out:
                out.append(v)
    if len(out) > MAX_CASES:
        raise InvalidParameter(f"{name} expands to {len(out)} values", hint=f"use at most {MAX_CASES}")
    return out


def _expand_range(first: int, last: int, op: str, step: int, name: str, item: str) -> list[int]:
    if last < first:
        raise InvalidParameter(f"empty {name} range {item!r}: {last} < {first}")
    if (op == "+" and step <= 0) or (op == "*" and (step <= 1 or first <= 0)):
        raise InvalidParameter(f"{name} range {item!r} never advances", hint="use a step > 0 (+) or a factor > 1 (*)")
    values, v = [], first
    while v <= last:
        values.append(v)
        if len(values) > MAX_CASES:
            raise InvalidParameter(f"{name} range {item!r} has more than {MAX_CASES} values")
        v = v + step if op == "+" else v * step
    return values


@dataclass(frozen=True)
class Case:
    """One test: ``kind`` is "generate" (single stream: prompt then generation, one row), "pp" / "tg" (llama-bench's
    separate tests: a prompt with one token generated, or generation after a one-token prompt), "batch" (b streams
    through the server's scheduler; the mlx-lm peer's through its BatchGenerator) or "prefix" (TTFT with a cold
    cache vs a warm shared prefix of ``depth``)."""

    kind: str
    prompt: int     # new prompt tokens prefilled by the timed call
    gen: int        # tokens generated (EOS ignored)
    depth: int = 0  # tokens already in the KV cache before the timed call
    batch: int = 1

    @property
    def label(self) -> str:
        if self.kind == "prefix":
            return f"prefix{self.depth}+pp{self.prompt}"
        text = {"pp": f"pp{self.prompt}", "tg": f"tg{self.gen}"}.get(self.kind, f"pp{self.prompt}+tg{self.gen}")
        if self.depth:
            text += f" @ d{self.depth}"
        if self.kind == "batch":
            text += f" x b{self.batch}"
        return text

    def context_needed(self) -> int:
        return self.depth + self.prompt + self.gen


def expand_cases(
    prompts: Sequence[int], gens: Sequence[int], depths: Sequence[int] = (0,),
    batches: Sequence[int] | None = None, prefixes: Sequence[int] = (), split: bool = False,
) -> list[Case]:
    """Every combination of the lists: single-stream cases (or batch cases when ``batches`` is given), then one
    prefix-cache case per (prefix, prompt). ``split``: llama-bench's tests instead, ppP and tgN per depth
    (a length of 0 is skipped, as in llama-bench). More than MAX_CASES tests in all are refused before any is
    made (each list alone is capped, their product was not: -p 1-4000 -n 1-4000 was 16 million tests)."""
    if split:
        count = len(depths) * (sum(p > 0 for p in prompts) + sum(n > 0 for n in gens))
    else:
        count = len(depths) * len(prompts) * len(gens) * (1 if batches is None else len(batches))
    count += len(prefixes) * len(prompts)
    if count > MAX_CASES:
        raise InvalidParameter(f"the lists make {count:,} tests (every combination of -p, -n, -d, -b)",
                               hint=f"use at most {MAX_CASES:,}: shorter lists or coarser ranges")
    cases: list[Case] = []
    for d in depths:
        if split:
            cases.extend(Case("pp", p, 1, d) for p in prompts if p > 0)
            cases.extend(Case("tg", 1, n, d) for n in gens if n > 0)
            continue
        for p in prompts:
            for n in gens:
                if batches is None:
                    cases.append(Case("generate", p, n, d))
                else:
                    cases.extend(Case("batch", p, n, d, b) for b in batches)
    cases.extend(Case("prefix", p, 1, pre) for pre in prefixes for p in prompts)
    return cases


def random_tokens(vocab_size: int, count: int, seed: int, stream: int = 0) -> list[int]:
    """``count`` token ids drawn uniformly from [0, vocab_size), reproducible from (seed, stream)."""
    import numpy as np

    rng = np.random.default_rng([seed, stream])
    return rng.integers(0, vocab_size, size=count).tolist()


class PromptSource:
    """Prompt tokens for the tests: seeded random ids by default, or the tokens of a text file (cycled when the
    file is shorter than needed). ``take(count, stream)`` gives the same tokens for the same arguments."""

    def __init__(self, vocab_size: int, seed: int = 0, file_tokens: Sequence[int] | None = None, label: str = ""):
        self.vocab_size = vocab_size
        self.seed = seed
        self.file_tokens = list(file_tokens) if file_tokens is not None else None
        if self.file_tokens is not None and not self.file_tokens:
            raise InvalidParameter("the prompt file has no tokens", hint="give a file with some text")
        self.label = label or (f"file ({len(self.file_tokens)} tokens)" if self.file_tokens else f"random, seed {seed}")

    def take(self, count: int, stream: int = 0) -> list[int]:
        if self.file_tokens is None:
            return random_tokens(self.vocab_size, count, self.seed, stream)
        # Different streams start at different offsets so batch rows and depth/prompt parts differ.
        toks, start = self.file_tokens, (stream * 7919) % len(self.file_tokens)
        return [toks[(start + i) % len(toks)] for i in range(count)]
