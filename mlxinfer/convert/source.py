"""Turn a convert SOURCE (Hub repo id, alias, local Hugging Face directory or .gguf file) into a local input.

Safety rules live here: pickle checkpoints are refused, and models that need remote code (a ``model_file`` /
``auto_map`` Python class the installed mlx-lm does not provide) are refused rather than executed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import InvalidModel, InvalidParameter, MlxinferError
from ..registry import ModelSpec, Registry

Progress = Callable[[str, int, int], None]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Any one of these holds a vocabulary transformers can build a tokenizer from (tokenizer_config.json alone cannot).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken", "tiktoken.model")
_SNAPSHOT_RE = re.compile(r"/snapshots/([0-9a-f]{40})/?$")


@dataclass
class SourceInfo:
    label: str                 # what the model card names: repo id, alias or path
    kind: str                  # "hf" (safetensors directory) | "gguf"
    path: Path                 # the directory, or the .gguf file
    revision: str | None = None
    repo: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"

    def size_bytes(self) -> int:
        if self.is_gguf:
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in self.path.glob("model*.safetensors"))


class PickleRefused(MlxinferError):
    pass


def _refuse_pickle(path: Path) -> None:
    raise PickleRefused(
        f"{path} is a pickle checkpoint; mlxinfer never loads pickle files (they can run arbitrary code)",
        hint="use a safetensors copy of the model (most Hub repos have one) or a .gguf file",
    )


def check_hf_dir(path: Path) -> dict:
    """A Hugging Face / MLX directory we can convert safely; returns its config."""
    if not (path / "config.json").is_file():
        raise InvalidModel(f"{path} has no config.json", hint="give a Hugging Face model directory or a .gguf file")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            _refuse_pickle(path / pickles[0])
        raise InvalidModel(f"{path} has no *.safetensors weights", hint="the download may be incomplete")
    from ..engine.model_checks import check_config, read_config

    config = read_config(path)  # a JSON object, or one line saying why not
    check_config(path, config)  # model_type a name, sizes whole numbers in range
    if config.get("model_file"):
        raise InvalidModel(
            f"{path} needs its own Python code ({config['model_file']}) to build the model; "
            "mlxinfer never runs code from a model", hint="pick a model whose architecture mlx-lm supports",
        )
    _check_architecture(path, config)
    if not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):  # the output could load but never run
        raise InvalidModel(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json or "
                           "*.tiktoken)", hint="copy them from the original model into that folder")
    from ..engine.trust import check_no_remote_code  # tokenizer auto_map / custom tokenizer_class too (issue #12)
    check_no_remote_code(path)
    return config


def _check_architecture(path: Path, config: dict) -> None:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, KeyError) as e:
        remote = " (it ships remote code, which mlxinfer never runs)" if config.get("auto_map") else ""
        kind = config.get("model_type", "?")
        raise InvalidModel(
            f"{path}: architecture '{kind}' is not supported by the installed mlx-lm{remote}: {e}",
            hint="upgrade mlx-lm (pip install -U mlx-lm) or pick another model",
        ) from None


def _revision_of(path: Path) -> str | None:
    m = _SNAPSHOT_RE.search(str(path.resolve()))
    return m.group(1) if m else None


def _from_path(label: str, path: Path) -> SourceInfo:
    if path.is_dir():
        check_hf_dir(path)
        return SourceInfo(label=label, kind="hf", path=path, revision=_revision_of(path))
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return SourceInfo(label=label, kind="gguf", path=path)
    if suffix in PICKLE_SUFFIXES:
        _refuse_pickle(path)
    if suffix == ".safetensors":
        raise InvalidModel(f"{path} is a single weights file",
                           hint="give the directory that holds it with its config.json and tokenizer files")
    raise InvalidModel(f"{path} is not a model", hint="give a Hugging Face model directory or a .gguf file")


def resolve_source(arg: str, *, revision: str | None = None, registry: Registry | None = None,
                   progress: Progress | None = None) -> SourceInfo:
    """Resolve and (for the Hub) download the source. Hub downloads fetch safetensors/JSON/tokenizer files only."""
    spec: ModelSpec = (registry or Registry.load()).resolve(arg)
    if spec.kind == "hub":
        from ..sources.hub import download_model

        if revision and spec.revision and revision != spec.revision and not spec.alias:
            raise InvalidParameter(f"{arg} names revision {spec.revision} and --revision names {revision}",
                                   hint=f"give the revision once: {spec.repo}@{revision}, or drop --revision")
        rev = revision or spec.revision
        path = download_model(spec.repo, rev, progress=progress)
        check_hf_dir(path)
        return SourceInfo(label=spec.repo, kind="hf", path=path, revision=_revision_of(path) or rev, repo=spec.repo)
    if spec.path is None or not spec.path.exists():
        raise InvalidModel(f"no such file or directory: {spec.path}", hint="check the path")
    if revision:  # it was ignored: a local file or folder has no branches or tags
        raise InvalidParameter(f"--revision {revision} applies to Hub sources only; {arg} is on disk",
                               hint="drop --revision")
    label = f"{spec.alias} ({spec.path.name})" if spec.alias else str(spec.path)
    info = _from_path(label, spec.path)
    if info.is_gguf:
        from ..sources.gguf_import import file_digest

        info.revision = "sha256:" + file_digest(info.path)[:16]  # memoised: the import needs it anyway
    return info
