"""Convert keeps quality by default: a quantized source keeps its format unless asked, and re-quantizing one to as
few bits or fewer (dequantize, then round again: both errors add up) needs ``--requantize`` and is told its cost.

Only headers are read (config.json, or the GGUF's tensor table): the check runs before any work.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import InvalidParameter
from .recipes import FIXED_MODES, Recipe
from .source import SourceInfo

_FLOAT_KINDS = {"F32", "F16", "BF16", "F64"}


@dataclass
class SourceQuant:
    label: str                # e.g. "Q4_1" or "4-bit affine, group 64"
    bits: int                 # the narrowest width its weights use
    bits_per_weight: float    # weights plus scales/biases


def source_quantization(info: SourceInfo) -> SourceQuant | None:
    """How ``info``'s weights are quantized, or None for float weights."""
    if info.is_gguf:
        return _gguf_quant(info)
    try:
        config = json.loads((info.path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization") if isinstance(config, dict) else None
    if not isinstance(q, dict) or not isinstance(q.get("bits"), int) or not isinstance(q.get("group_size"), int):
        return None
    widths = [q["bits"]] + [v["bits"] for v in q.values() if isinstance(v, dict) and isinstance(v.get("bits"), int)]
    mode = q.get("mode", "affine")
    overhead = (8 if mode in FIXED_MODES else 32) / max(q["group_size"], 1)  # one scale (+ a bias) per group
    return SourceQuant(f"{q['bits']}-bit {mode}, group {q['group_size']}", min(widths), q["bits"] + overhead)


def _gguf_quant(info: SourceInfo) -> SourceQuant | None:
    from ..sources.gguf_file import read_gguf

    g = read_gguf(info.path)
    matrices = [t for t in g.tensors if len(t.shape) > 1 and t.data is not None]
    quantized = [t for t in matrices if t.kind not in _FLOAT_KINDS]
    if not quantized:
        return None
    widths = [int(m.group(1)) for t in quantized if (m := re.search(r"(\d+)", t.kind))]
    elements = sum(_numel(t.shape) for t in matrices)
    bpw = sum(int(t.data.nbytes) for t in matrices) * 8 / max(elements, 1)
    kinds = sorted({t.kind for t in quantized}, key=lambda k: -sum(1 for t in quantized if t.kind == k))
    return SourceQuant("GGUF " + "/".join(kinds[:3]), min(widths) if widths else 8, bpw)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def check_requantize(info: SourceInfo, recipe: Recipe | None, allowed: bool) -> str | None:
    """Refuse a lossy re-quantization without ``allowed``; returns the note for the model card otherwise."""
    if recipe is None:
        return None
    src = source_quantization(info)
    if src is None:
        return None
    d = recipe.default
    target_bpw = d.bits + (8 if d.mode in FIXED_MODES else 32) / d.group_size
    # Both rates are the matrices' (weights, scales, biases): the convert report's is the whole file's, norms too.
    cost = (f"{info.label} is already quantized ({src.label}, {src.bits_per_weight:.2f} bits per matrix weight); "
            f"re-quantizing it to {recipe.label()} (about {target_bpw:.2f} bits per matrix weight)")
    if d.bits > src.bits:  # more bits than the source: the rounding error added is small, the file grows
        return f"{cost} adds little error but no quality back: the source's rounding stays"
    if not allowed:
        raise InvalidParameter(f"{cost} rounds already-rounded weights again, so the errors add up",
                               hint="add --requantize to accept that; without --bits/--recipe the source keeps "
                                    "its format; best, convert the original float weights")
    return f"{cost}: it was dequantized first, so errors add up"
