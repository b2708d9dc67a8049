"""What is on disk, and removing it: the Hugging Face Hub cache (through huggingface_hub's own cache API, shared
with mlx-lm) and mlxinfer's GGUF import copies under ``$MLXINFER_CACHE/gguf/``. No printing here."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ModelNotFound
from .gguf_import import cache_root
from .hub_net import hub_cache_dir


@dataclass
class CachedModel:
    kind: str                       # "hub" | "gguf"
    name: str                       # Hub repo id, or the GGUF file name an import came from
    path: Path                      # newest loadable snapshot (hub) or the import directory (gguf)
    disk_bytes: int
    revisions: list[str] = field(default_factory=list)   # commit hashes of loadable snapshots (hub)
    refs: list[str] = field(default_factory=list)        # branch / tag names pointing at them (hub)
    info: dict = field(default_factory=dict)             # the import's "mlxinfer" record (gguf)


def _loadable(revision) -> bool:
    """MLX can load a snapshot that has a config.json and safetensors weights."""
    names = {f.file_name for f in revision.files}
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def _scan():
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    try:
        return scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return None


def hub_models() -> tuple[list[CachedModel], list[CachedModel]]:
    """Model repos in the Hub cache, from one scan: (those with a snapshot MLX can load, those without one that a
    model download left part way). Sizes as huggingface_hub counts them: blobs shared between revisions once. An
    unfinished repo's ``path`` is its cache folder (``rm`` removes it; ``pull`` finishes it)."""
    info = _scan()
    loadable, unfinished = [], []
    for repo in sorted(info.repos if info else [], key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revisions = sorted((r for r in repo.revisions if _loadable(r)), key=lambda r: r.last_modified, reverse=True)
        if revisions:
            loadable.append(CachedModel(
                kind="hub", name=repo.repo_id, path=revisions[0].snapshot_path, disk_bytes=repo.size_on_disk,
                revisions=[r.commit_hash for r in revisions], refs=sorted({ref for r in revisions for ref in r.refs}),
            ))
            continue
        # A model download cut short: a snapshot with its config but not its weights, or a blob still being
        # written. (A repo another tool cached without weights, e.g. a README alone, is no model: not listed.)
        has_config = any(f.file_name == "config.json" for r in repo.revisions for f in r.files)
        if has_config or any(Path(repo.repo_path, "blobs").glob("*.incomplete")):
            unfinished.append(CachedModel(kind="hub", name=repo.repo_id, path=repo.repo_path,
                                          disk_bytes=repo.size_on_disk))
    return loadable, unfinished


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def gguf_imports() -> list[CachedModel]:
    """The MLX directories made from GGUF files (``<digest>-v<N>/`` with config.json naming the source file)."""
    root = cache_root() / "gguf"
    rows = []
    for d in sorted(root.glob("*-v*")) if root.is_dir() else []:
        if not d.is_dir() or d.name.startswith("."):
            continue
        try:
            record = json.loads((d / "config.json").read_text()).get("mlxinfer", {})
        except (OSError, ValueError, AttributeError):
            record = {}
        if not isinstance(record, dict) or record.get("source") != "gguf":
            continue
        rows.append(CachedModel(kind="gguf", name=str(record.get("file", d.name)), path=d,
                                disk_bytes=_dir_bytes(d), info=record))
    return rows


@dataclass
class Removal:
    """What ``remove`` would delete: Hub revisions and/or import directories, and the bytes it frees."""

    label: str
    hub_revisions: list[str] = field(default_factory=list)
    imports: list[Path] = field(default_factory=list)
    freed_bytes: int = 0
    _strategy: object = None

    @property
    def empty(self) -> bool:
        return not self.hub_revisions and not self.imports


def plan_hub_removal(repo: str, revision: str | None = None) -> Removal:
    """All cached revisions of ``repo`` (or the one a branch, tag or commit prefix names)."""
    info = _scan()
    found = [r for r in (info.repos if info else []) if r.repo_type == "model" and r.repo_id == repo]
    if not found:
        raise ModelNotFound(f"{repo} is not in the Hub cache ({hub_cache_dir()})",
                            hint="run 'mlxinfer models' to see what is cached")
    revisions = list(found[0].revisions)
    if revisions and revision:
        revisions = [r for r in revisions if revision in r.refs or r.commit_hash.startswith(revision)]
        if not revisions:
            raise ModelNotFound(f"revision {revision!r} of {repo} is not in the Hub cache",
                                hint=f"run 'mlxinfer rm {repo}' to remove every cached revision")
    hashes = [r.commit_hash for r in revisions]
    # Every revision goes: delete the whole repo folder (incomplete downloads too), as huggingface_hub does.
    strategy = info.delete_revisions(*hashes)
    label = repo + (f"@{revision}" if revision else "")
    return Removal(label=label, hub_revisions=hashes, freed_bytes=strategy.expected_freed_size, _strategy=strategy)


def plan_import_removal(directory: Path, label: str) -> Removal:
    return Removal(label=label, imports=[directory], freed_bytes=_dir_bytes(directory))


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def execute(removal: Removal) -> int:
    """Delete what ``removal`` lists (never anything outside the two caches); returns the bytes freed."""
    if removal._strategy is not None:
        strategy = removal._strategy
        for p in [*strategy.repos, *strategy.snapshots, *strategy.blobs, *strategy.refs]:
            if not _inside(Path(p), hub_cache_dir()):  # the strategy only ever names cache paths; check anyway
                raise RuntimeError(f"refusing to delete {p}: it is outside the Hub cache")
        strategy.execute()
    root = cache_root() / "gguf"
    for d in removal.imports:
        if not _inside(d, root) or d.resolve() == root.resolve():
            raise RuntimeError(f"refusing to delete {d}: it is outside the GGUF import cache")
        # Rename first, so a crash halfway leaves no half-deleted directory that looks like an import.
        doomed = d.with_name(f".{d.name}.removing")
        d.rename(doomed)
        shutil.rmtree(doomed)
    return removal.freed_bytes
