"""What ``mlxinfer models`` reports about each registry alias (no printing here)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import MlxinferError
from .registry import Registry


@dataclass
class ModelRow:
    alias: str
    description: str
    params: str
    quant: str
    source: str
    on_disk: bool
    disk_bytes: int | None
    location: str | None
    origin: str                     # which models.toml defined it

    def as_dict(self) -> dict:
        return asdict(self)


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _converted(local: Path | None) -> dict | None:
    """The record ``mlxinfer convert`` leaves in config.json, if this directory is one of its outputs."""
    if local is None or not (local / "config.json").is_file():
        return None
    try:
        record = json.loads((local / "config.json").read_text()).get("mlxinfer", {}).get("converted")
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def _where(registry: Registry, alias: str) -> tuple[str, Path | None]:
    """(source label, local path if the model is already on disk)."""
    try:
        spec = registry.spec(alias)
    except MlxinferError:
        return "(package missing)", None
    if spec.kind == "hub":
        from .sources.hub import cached_path

        return spec.source_label(), cached_path(spec.repo, spec.revision)
    path = spec.path
    return str(path), path if path is not None and path.exists() else None


def list_models(registry: Registry | None = None) -> list[ModelRow]:
    registry = registry or Registry.load()
    rows = []
    for alias in registry.aliases():
        entry = registry.entry(alias)
        source, local = _where(registry, alias)
        quant, description = entry.get("quant", ""), entry.get("description", "")
        converted = _converted(local)
        if converted:
            quant = quant or f"{converted.get('recipe', '?')}, {converted.get('bits_per_weight', 0):.2f} bpw"
            kl = (converted.get("quality") or {}).get("kl_mean")
            extra = f"converted from {converted.get('source', '?')}" + (f", KL {kl:.3g}" if kl is not None else "")
            description = f"{description} ({extra})" if description else extra
        rows.append(ModelRow(
            alias=alias, description=description, params=str(entry.get("params", "")),
            quant=quant, source=source, on_disk=local is not None,
            disk_bytes=_dir_bytes(local) if local else None, location=str(local) if local else None,
            origin=str(registry.origin(alias)),
        ))
    return rows
