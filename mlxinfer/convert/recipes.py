"""Quantization recipes: which layers get how many bits.

A recipe is a default setting plus ordered per-layer rules (first match wins). The built-in mixed recipes are
written in the same rule format a user's TOML file uses, so ``--recipe my.toml`` can do anything they do::

    name = "my-recipe"                 # optional, shown in the model card
    [default]                          # optional; --bits / --group-size override it
    bits = 4
    group_size = 64
    mode = "affine"
    [[rule]]
    match = "lm_head"                  # glob on the module path; a bare name also matches a path suffix
    bits = 8
    [[rule]]
    match = "*.mlp.down_proj"
    layers = "sensitive"               # "first" | "last" | "edges" | "sensitive" | [0, 1, -1] | "0-3"
    bits = 6
    [[rule]]
    match = "self_attn.k_proj"
    quantize = false                   # keep this layer in --dtype

MLX/mlx-lm do the quantization itself (``nn.quantize`` with a ``class_predicate``); this module only answers the
predicate's question for each layer path.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, InvalidParameter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# Modes other than affine fix both bit width and group size.
FIXED_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
SELECTORS = ("first", "last", "edges", "sensitive")


def available_modes() -> list[str]:
    """Quantization modes the installed MLX accepts (probed once on a tiny matrix)."""
    global _MODES
    if _MODES is None:
        import mlx.core as mx

        found = []
        for mode in ("affine", *FIXED_MODES):
            bits, group = FIXED_MODES.get(mode, (4, 64))
            try:
                mx.eval(mx.quantize(mx.zeros((8, 128)), group_size=group, bits=bits, mode=mode))
                found.append(mode)
            except (ValueError, RuntimeError, TypeError):
                continue
        _MODES = found
    return list(_MODES)


_MODES: list[str] | None = None


@dataclass(frozen=True)
class QuantSetting:
    bits: int
    group_size: int
    mode: str = "affine"

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


@dataclass(frozen=True)
class Rule:
    match: str
    layers: Any = None              # None, a selector name, a list of ints, or "a-b"
    bits: int | None = None
    group_size: int | None = None
    mode: str | None = None
    quantize: bool = True


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    default: QuantSetting
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    source: str = "built-in"        # "built-in" or the TOML file's path
    mlx_lm: str | None = None       # an mlx-lm recipe name: its predicate builder decides the layers

    def with_overrides(self, bits: int | None, group_size: int | None, mode: str | None) -> "Recipe":
        """--bits / --group-size / --mode change the default; rules keep their own explicit values."""
        d = self.default
        mode = mode or d.mode
        if mode in FIXED_MODES:
            fb, fg = FIXED_MODES[mode]
            bits, group_size = bits or fb, group_size or fg
        default = QuantSetting(bits or d.bits, group_size or d.group_size, mode)
        return replace(self, default=default)

    def label(self) -> str:
        d = self.default
        if not self.rules:
            return f"{d.bits}-bit {d.mode}, group {d.group_size}"
        return f"{self.name} ({d.bits}-bit {d.mode} base, group {d.group_size}, {len(self.rules)} rules)"


def _sensitive_rules(high: int) -> tuple[Rule, ...]:
    # mlx-lm's mixed recipes (after llama.cpp's Q4_K_M): the output head, and the V and FFN-down projections of
    # the first/last eighth of the layers and every third layer in between, carry the most quantization error.
    # Written as rules for the model card and for TOML authors; the decisions come from mlx-lm itself.
    return (
        Rule("*lm_head*", bits=high),
        Rule("*v_proj*", layers="sensitive", bits=high),
        Rule("*v_a_proj*", layers="sensitive", bits=high),
        Rule("*v_b_proj*", layers="sensitive", bits=high),
        Rule("*down_proj*", layers="sensitive", bits=high),
    )


def _mixed(low: int, high: int) -> Recipe:
    name = f"mixed_{low}_{high}"
    return Recipe(name, f"mlx-lm's {name}: {low}-bit, {high}-bit lm_head and sensitive v/down projections",
                  QuantSetting(low, 64), _sensitive_rules(high), mlx_lm=name)


# The names mlx-lm uses mean exactly what they mean there (mlx_lm.convert.mixed_quant_predicate_builder decides).
BUILTIN: dict[str, Recipe] = {r.name: r for r in (_mixed(4, 6), _mixed(3, 6), _mixed(3, 4), _mixed(2, 6))}


def uniform(bits: int | None, group_size: int | None, mode: str | None) -> Recipe:
    mode = mode or "affine"
    base = Recipe("uniform", "", QuantSetting(4, 64, mode))
    return base.with_overrides(bits, group_size, mode)


# -- validation -------------------------------------------------------------------------------------------
def check_setting(s: QuantSetting, where: str = "") -> None:
    modes = available_modes()
    at = f" ({where})" if where else ""
    if s.mode not in modes:
        raise InvalidParameter(f"quantization mode '{s.mode}'{at} is not supported by this MLX",
                               hint=f"use one of: {', '.join(modes)}")
    if s.mode in FIXED_MODES:
        fb, fg = FIXED_MODES[s.mode]
        if (s.bits, s.group_size) != (fb, fg):
            raise InvalidParameter(f"mode {s.mode}{at} needs {fb} bits and group size {fg}, "
                                   f"not {s.bits} bits / group {s.group_size}",
                                   hint="drop --bits/--group-size for this mode")
        return
    if s.bits not in BITS:
        raise InvalidParameter(f"{s.bits} bits{at} is not supported", hint=f"use one of {BITS}")
    if s.group_size not in GROUP_SIZES:
        raise InvalidParameter(f"group size {s.group_size}{at} is not supported", hint=f"use one of {GROUP_SIZES}")


def validate(recipe: Recipe) -> None:
    # The flags' own recipe has nothing but its default: naming it "(default)" read as if 7 were the default.
    check_setting(recipe.default, "" if recipe.name == "uniform" else "default")
    for i, r in enumerate(recipe.rules):
        if r.quantize:
            check_setting(resolve_rule(recipe, r), f"rule {i + 1}, match '{r.match}'")


def resolve_rule(recipe: Recipe, rule: Rule) -> QuantSetting:
    d = recipe.default
    if rule.mode in FIXED_MODES:
        fb, fg = FIXED_MODES[rule.mode]
        return QuantSetting(rule.bits or fb, rule.group_size or fg, rule.mode)
    if rule.mode is None and d.mode in FIXED_MODES and rule.bits and rule.bits != d.bits:
        # e.g. mixed_4_6 with --mode mxfp4: the 6-bit layers cannot be mxfp4, so they use affine (group 64)
        return QuantSetting(rule.bits, rule.group_size or 64, "affine")
    return QuantSetting(rule.bits or d.bits, rule.group_size or d.group_size, rule.mode or d.mode)


# -- loading ----------------------------------------------------------------------------------------------
def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a TOML rules file."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.is_file() and (path.suffix == ".toml" or "/" in name_or_path):
        what = "is a directory, not a rules file" if path.is_dir() else "does not exist"
        raise InvalidParameter(f"the recipe file {name_or_path} {what}",
                               hint=f"give the path of a .toml rules file, or one of {', '.join(BUILTIN)}")
    if not path.is_file():
        raise InvalidParameter(f"unknown recipe '{name_or_path}'",
                               hint=f"use one of {', '.join(BUILTIN)} or the path of a .toml rules file")
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}", hint="fix the line named above") from None
    return parse_recipe(doc, str(path))


def _int(doc: dict, key: str, where: str) -> int | None:
    v = doc.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise ConfigError(f"{where}: '{key}' must be an integer")
    return v


def parse_recipe(doc: dict, source: str) -> Recipe:
    unknown = set(doc) - {"name", "description", "default", "rule", "rules"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}",
                          hint="a recipe has name, description, [default] and [[rule]] tables")
    d = doc.get("default", {})
    if not isinstance(d, dict) or set(d) - {"bits", "group_size", "mode"}:
        raise ConfigError(f"{source}: [default] may only set bits, group_size, mode")
    default = QuantSetting(_int(d, "bits", f"{source} [default]") or 4,
                           _int(d, "group_size", f"{source} [default]") or 64, str(d.get("mode", "affine")))
    rules = []
    for i, r in enumerate(doc.get("rule", doc.get("rules", []))):
        where = f"{source} rule {i + 1}"
        if not isinstance(r, dict) or not isinstance(r.get("match"), str) or not r["match"]:
            raise ConfigError(f"{where}: needs match = \"glob on the layer path\"")
        bad = set(r) - {"match", "layers", "bits", "group_size", "mode", "quantize"}
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(bad))}")
        layers = r.get("layers")
        _check_layers(layers, where)
        quantize = r.get("quantize", True)
        if not isinstance(quantize, bool):
            raise ConfigError(f"{where}: quantize must be true or false")
        rules.append(Rule(r["match"], layers, _int(r, "bits", where), _int(r, "group_size", where),
                          r.get("mode"), quantize))
    name = str(doc.get("name") or Path(source).stem)
    return Recipe(name, str(doc.get("description", "")), default, tuple(rules), source)


def _check_layers(layers: Any, where: str) -> None:
    if layers is None or layers in SELECTORS:
        return
    if isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        return
    if isinstance(layers, str) and _parse_range(layers) is not None:
        return
    raise ConfigError(f"{where}: layers must be one of {', '.join(SELECTORS)}, a list of integers or \"a-b\"")


def _parse_range(text: str) -> tuple[int, int] | None:
    a, sep, b = text.partition("-")
    if sep and a.strip().isdigit() and b.strip().isdigit():
        return int(a), int(b)
    return None


# -- matching ---------------------------------------------------------------------------------------------
def layer_index(path: str) -> int | None:
    """The block index in a path such as ``model.layers.3.mlp.down_proj`` (None for embeddings, lm_head...)."""
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


def layer_selected(layers: Any, index: int | None, n_layers: int) -> bool:
    if layers is None:
        return True
    if index is None:
        return False
    eighth = max(1, n_layers // 8)
    if layers == "first":
        return index < eighth
    if layers == "last":
        return index >= n_layers - eighth
    if layers == "edges":
        return index < eighth or index >= n_layers - eighth
    if layers == "sensitive":
        return index < n_layers // 8 or index >= 7 * n_layers // 8 or (index - n_layers // 8) % 3 == 2
    if isinstance(layers, list):
        return any(index == (x if x >= 0 else n_layers + x) for x in layers)
    lo, hi = _parse_range(layers)
    return lo <= index <= hi


def path_matches(pattern: str, path: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def setting_for(recipe: Recipe, path: str, n_layers: int) -> QuantSetting | None:
    """The quantization of the layer at ``path``; None keeps it unquantized."""
    index = layer_index(path)
    for rule in recipe.rules:
        if path_matches(rule.match, path) and layer_selected(rule.layers, index, n_layers):
            return resolve_rule(recipe, rule) if rule.quantize else None
    return recipe.default


def check_rules_select(recipe: Recipe, paths: list[str], n_layers: int) -> None:
    """Refuse a rule that selects none of ``paths`` (the model's quantizable layers): a typo in match or a layer
    this model does not have converted with exit 0, the rule silently doing nothing."""
    for i, rule in enumerate(recipe.rules):
        where = f"{recipe.source} rule {i + 1} (match '{rule.match}'"
        wanted = rule.layers if isinstance(rule.layers, list) else _parse_range(rule.layers or "") or []
        missing = [x for x in wanted if not -n_layers <= x < n_layers]
        if missing:
            raise ConfigError(f"{where}, layers {_toml_layers(rule.layers)}) names layer {missing[0]}, but this model "
                              f"has layers 0-{n_layers - 1}",
                              hint=f"use 0 to {n_layers - 1}, or -1 to -{n_layers} counting from the last")
        matched = [p for p in paths if path_matches(rule.match, p)]
        if not matched:
            example = next((p for p in paths if layer_index(p) is not None), paths[0] if paths else "lm_head")
            raise ConfigError(f"{where}) selects no layer of this model",
                              hint=f"match is a glob on layer paths such as {example}")
        if not any(layer_selected(rule.layers, layer_index(p), n_layers) for p in matched):
            numbered = any(layer_index(p) is not None for p in matched)
            raise ConfigError(f"{where}, layers {_toml_layers(rule.layers)}) selects no layer of this model",
                              hint=f"this model has layers 0-{n_layers - 1}" if numbered else
                              f"'{rule.match}' has no layer number: drop layers from this rule")


def _toml_layers(layers: Any) -> str:
    return f'"{layers}"' if isinstance(layers, str) else str(layers)


def count_layers(model) -> int:
    layers = getattr(model, "layers", None)
    try:
        return len(layers)
    except TypeError:
        found = {layer_index(p) for p, _ in model.named_modules()}
        found.discard(None)
        return (max(found) + 1) if found else 1


def predicate(recipe: Recipe, model) -> Callable[[str, Any], bool | dict]:
    """An mlx-lm ``quant_predicate``: True for the default setting, a dict for others, False to skip.

    Returning True (not a dict) for default layers keeps config.json's quantization section short: only layers
    that differ from the default are listed, which is what mlx-lm's loader expects.
    """
    n_layers = count_layers(model)
    default = recipe.default
    setting = _mlx_lm_setting(recipe, model) if recipe.mlx_lm else (lambda p: setting_for(recipe, p, n_layers))

    def decide(path: str, module) -> bool | dict:
        s = setting(path)
        if s is None:
            return False
        if module.weight.shape[-1] % s.group_size != 0:
            return False  # the input width must split into whole groups; such a layer stays in float
        return True if s == default else s.as_dict()

    return decide


def _mlx_lm_setting(recipe: Recipe, model) -> Callable[[str], QuantSetting | None]:
    """mlx-lm's own mixed predicate; its low-bit layers take our default (so --bits/--mode/--group-size apply to
    them), its high-bit ones stay affine as in mlx-lm (group 64 under a fixed-group mode such as mxfp4)."""
    from mlx_lm.convert import mixed_quant_predicate_builder

    d = recipe.default
    group = d.group_size if d.mode not in FIXED_MODES else 64
    try:
        mixed = mixed_quant_predicate_builder(recipe.mlx_lm, model, group_size=group)
    except ValueError as e:
        raise InvalidParameter(f"recipe {recipe.name}: {e}", hint="use --bits, or a TOML recipe") from None
    low = int(recipe.mlx_lm.split("_")[1])

    def setting(path: str) -> QuantSetting | None:
        choice = mixed(path, None)
        if choice is False:
            return None
        if not isinstance(choice, dict) or choice.get("bits") == low:
            return d
        return QuantSetting(choice["bits"], choice["group_size"], choice.get("mode", "affine"))

    return setting
