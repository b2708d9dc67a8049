"""Provenance for every benchmark record: which model (and weights), which engine, on which machine and OS."""

from __future__ import annotations

import subprocess
import time
from functools import lru_cache
from pathlib import Path
from typing import Any


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the mlxinfer checkout this code runs from; (None, None) for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None, None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def library_versions() -> dict:
    import mlx.core as mx

    return {"mlx": getattr(mx, "__version__", None) or _dist_version("mlx"), "mlx_lm": _dist_version("mlx-lm")}


def engine_info(loaded) -> dict:
    """The mlxinfer engine that produced a record: version, checkout commit, libraries, backend, kernels."""
    from .. import __version__

    commit, dirty = git_commit()
    return {"name": "mlxinfer", "version": __version__, "git_commit": commit, "git_dirty": dirty,
            **library_versions(), "backend": loaded.backend, "kernels": loaded.kernels,
            "kernels_detail": loaded.kernels_detail}


def peer_engine_info(backend: str) -> dict:
    """mlx-lm's own generation path (its stream_generate, its load defaults, MLX built-in kernels)."""
    return {"name": "mlx-lm", "version": _dist_version("mlx-lm"), "git_commit": None, "git_dirty": None,
            **library_versions(), "backend": backend, "kernels": "builtin",
            "kernels_detail": "mlx_lm.load + mlx_lm.stream_generate, MLX built-in kernels"}


def majority_float_dtype(model) -> str:
    """The floating dtype most parameters have (what a model 'runs in')."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    floats = [str(v.dtype) for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    name = max(set(floats), key=floats.count) if floats else "unknown"
    return name.replace("mlx.core.", "")


def _revision(spec, path: Path) -> str | None:
    """The pinned revision: the Hub snapshot commit, the GGUF file's sha256, or what the spec asked for."""
    if path.parent.name == "snapshots":
        return path.name
    if spec.is_gguf:
        try:
            from ..sources.gguf_import import file_digest

            return "sha256:" + file_digest(spec.path)
        except OSError:
            return None
    return spec.revision


def model_info(spec, path: Path, config: dict, model, *, dtype: str, quantization: str, context_length: int) -> dict:
    """What a record says about the model and its weights (the same fields for mlxinfer and the mlx-lm peer)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import get_total_parameters

    q = config.get("quantization") or {}
    return {
        "name": spec.alias or spec.name,
        "alias": spec.alias,
        "repo": spec.repo,
        "revision": _revision(spec, path),
        "source": spec.source_label(),
        "path": str(path),
        "model_type": config.get("model_type"),
        "params": int(get_total_parameters(model)),
        "params_label": spec.params or None,
        "quantization": quantization,
        "bits": q.get("bits"),
        "group_size": q.get("group_size"),
        "quant_mode": q.get("mode", "affine") if q else None,
        "dtype": dtype,
        "weight_bytes": int(sum(v.nbytes for _, v in tree_flatten(model.parameters()))),
        "context_length": context_length,
    }


def loaded_model_info(loaded) -> dict:
    return model_info(loaded.spec, loaded.path, loaded.config, loaded.model, dtype=loaded.dtype,
                      quantization=loaded.quantization, context_length=loaded.context_length)


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists are kept as they are (the CSV writer joins them)."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
