"""Saved chat sessions: one JSON file per name in ``$XDG_DATA_HOME/mlxinfer/sessions``, written atomically
(temp file in the same folder, fsync, ``os.replace``) so a crash mid-save leaves the previous version intact."""

from __future__ import annotations

import difflib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .session import Session, SessionError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def sessions_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "mlxinfer" / "sessions"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or "") or name.endswith(".json"):
        raise SessionError(
            f"invalid session name {name!r}",
            hint="use letters, digits, '.', '_' or '-' (up to 100 characters), e.g. my-notes",
        )
    return name


def session_path(name: str) -> Path:
    return sessions_dir() / f"{check_name(name)}.json"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save(name: str, data: dict) -> Path:
    path = session_path(name)
    Session.check_dict(data)
    data = {**data, "name": name, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


def names() -> list[str]:
    d = sessions_dir()
    return sorted(p.stem for p in d.glob("*.json") if _NAME_RE.match(p.stem)) if d.is_dir() else []


def load(name: str) -> dict:
    path = session_path(name)
    if not path.is_file():
        near = difflib.get_close_matches(name, names(), n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'?" if near else "list saved sessions with /sessions"
        raise SessionError(f"no saved session '{name}'", hint=hint)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SessionError(f"cannot read session {path}: {e}") from None
    try:
        return Session.check_dict(data)
    except SessionError as e:
        raise SessionError(f"{path}: {e}") from None


@dataclass
class SessionInfo:
    name: str
    path: Path
    modified: float
    model: str
    messages: int


def list_sessions() -> list[SessionInfo]:
    out = []
    for name in names():
        path = session_path(name)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            model, count = str(data.get("model", "?")), len(data.get("messages", []))
        except (OSError, ValueError, TypeError, AttributeError):
            model, count = "unreadable", 0
        out.append(SessionInfo(name, path, path.stat().st_mtime, model, count))
    return out
