"""Locate files that ship with mlxinfer: in a wheel they sit in ``mlxinfer/data``; in a source checkout
(editable install, tests) they are the top-level originals."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def data_path(name: str) -> Path:
    """Path of a shipped data file or folder, e.g. ``models.toml`` or ``metal_kernels``."""
    packaged = Path(str(resources.files("mlxinfer") / "data" / name))
    if packaged.exists():
        return packaged
    source = _REPO_ROOT / name
    if source.exists():
        return source
    raise FileNotFoundError(f"mlxinfer data file {name!r} is missing from the installation")
