"""What ``mlxinfer models`` reports: each registry alias, then the Hub repos in the cache that MLX can load and the
GGUF import copies, with their sizes on disk (no printing here)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import MlxinferError
from .registry import Registry


@dataclass
class ModelRow:
    alias: str | None               # None for cache rows
    description: str
    params: str
    quant: str
    source: str
    on_disk: bool
    disk_bytes: int | None
    location: str | None
    origin: str                     # which models.toml defined it; "hub cache" / "gguf import" for cache rows
    kind: str = "alias"             # "alias" | "hub" | "gguf"
    name: str = ""                  # what to pass to pull/rm/show
    revisions: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # registry aliases that name this cache entry

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
            origin=str(registry.origin(alias)), name=alias,
        ))
    return rows + cache_rows(registry)


def _config(directory: Path) -> dict:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _quant(config: dict) -> str:
    q = config.get("quantization")
    return f"{q['bits']}-bit" if isinstance(q, dict) and "bits" in q else ""


def _refused(repo_path: Path) -> str | None:
    """Why pull refused a Hub repo, in a few words, from the config files it fetched before the weights (the checks
    of ``sources.hub._precheck``); None when nothing there is refused (a download cut short)."""
    from .engine.model_checks import check_config, read_config
    from .engine.trust import check_no_remote_code

    for folder in sorted(Path(repo_path, "snapshots").glob("*/")):
        if not (folder / "config.json").is_file():
            continue
        try:
            check_config(folder, read_config(folder))
        except MlxinferError:
            return "its config.json is broken"
        try:
            check_no_remote_code(folder)
        except MlxinferError:
            return "it needs code that comes with the model, which mlxinfer never runs"
    return None


def cache_rows(registry: Registry) -> list[ModelRow]:
    """Hub repos MLX can load (huggingface_hub's cache scan) and GGUF imports, whichever aliases name them."""
    from .sources.cache import gguf_imports, hub_models

    by_repo: dict[str, list[str]] = {}
    by_file: dict[str, list[str]] = {}
    for alias in registry.aliases():
        e = registry.entry(alias)
        if "hub" in e:
            by_repo.setdefault(e["hub"], []).append(alias)
        for key in ("file", "path"):
            if str(e.get(key, "")).lower().endswith(".gguf"):
                by_file.setdefault(Path(e[key]).name, []).append(alias)
    rows = []
    loadable, unfinished = hub_models()  # one scan of the Hub cache for both
    for m in loadable:
        config = _config(m.path)
        refs = ", ".join(m.refs) or m.revisions[0][:10]
        rows.append(ModelRow(
            alias=None, description=f"{config.get('model_type', '?')} ({refs})", params="", quant=_quant(config),
            source=m.name, on_disk=True, disk_bytes=m.disk_bytes, location=str(m.path), origin="hub cache",
            kind="hub", name=m.name, revisions=m.revisions, aliases=by_repo.get(m.name, []),
        ))
    for m in unfinished:  # listed, or their space could only be found by knowing the name
        why = _refused(m.path)
        rows.append(ModelRow(
            alias=None, description=f"refused by pull: {why} (mlxinfer rm {m.name} removes it)" if why else
            f"incomplete download (mlxinfer pull {m.name} finishes it, rm removes it)",
            params="", quant="", source=m.name, on_disk=False, disk_bytes=m.disk_bytes, location=str(m.path),
            origin="hub cache", kind="hub", name=m.name, aliases=by_repo.get(m.name, []),
        ))
    for m in gguf_imports():
        label = m.info.get("size_label", "")
        kind = m.info.get("file_type_name", "")
        rows.append(ModelRow(
            alias=None, description=f"GGUF import of {m.name}" + (f" ({m.info['name']})" if m.info.get("name") else ""),
            params=str(label), quant=kind or _quant(_config(m.path)), source=m.name, on_disk=True,
            disk_bytes=m.disk_bytes, location=str(m.path), origin="gguf import", kind="gguf", name=m.name,
            aliases=by_file.get(m.name, []),
        ))
    return rows
