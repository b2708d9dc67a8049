"""Saved chat sessions: one JSON file per name in ``$XDG_DATA_HOME/mlxinfer/sessions``, written atomically
(temp file in the same folder, fsync, ``os.replace``) so a crash mid-save leaves the previous version intact.

One process at a time writes a session: a chat holds ``SessionLock(name)`` (an exclusive ``flock`` on
``.NAME.lock`` beside ``NAME.json``, holding the owner's pid) for as long as it is bound to NAME. The kernel drops
the lock when the process dies, however it dies; a clean release also removes the file.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..fsutil import atomic_write_text, pid_alive
from .session import Session, SessionError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def sessions_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "mlxinfer" / "sessions"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or "") or name.endswith(".json"):
        shown = name if len(name or "") <= 40 else name[:40] + "…"
        near = _suggest(name or "")
        raise SessionError(
            f"invalid session name {shown!r}",
            hint=(f"try '{near}'; " if near else "") + "a name is a letter or digit, then letters, digits, '.', '_' "
                 "or '-', at most 100 characters",
        )
    return name


def _suggest(name: str) -> str | None:
    """'my chat' -> 'my-chat': the name with what a session name cannot hold turned into '-', if that is one."""
    if not name.isascii() or len(name) > 100:  # 'café' -> 'caf' would be no help
        return None
    near = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._").removesuffix(".json")
    return near if near and _NAME_RE.match(near) and near != name else None


def session_path(name: str) -> Path:
    return sessions_dir() / f"{check_name(name)}.json"


class SessionBusy(SessionError):
    """The session is open in another process."""

    def __init__(self, name: str, pid: int | None, hint: str | None = None):
        who = f"another mlxinfer (pid {pid})" if pid else "another mlxinfer"
        super().__init__(f"session '{name}' is open in {who}", hint=hint or (
            f"close that chat first, or continue a copy of it: mlxinfer chat --session {name} --fork NEW-NAME"))
        self.pid = pid


def lock_path(name: str) -> Path:
    return sessions_dir() / f".{check_name(name)}.lock"


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None


class SessionLock:
    """An exclusive lock on one session name, held until ``release()`` or the end of the process."""

    def __init__(self, name: str, path: Path, fd: int):
        self.name, self.path, self._fd = name, path, fd

    @classmethod
    def acquire(cls, name: str, hint: str | None = None) -> "SessionLock":
        """Take NAME's lock now or raise ``SessionBusy`` (never waits)."""
        path = lock_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no flock (Windows): sessions are not shared there
            return cls(name, path, -1)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SessionBusy(name, _read_pid(path), hint) from None
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder we waited on may have released (and removed) the file: lock the one in place
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return cls(name, path, fd)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file (while still holding it, so nobody locks a file about to vanish) and unlock."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if fd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> "SessionLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder(name: str) -> int | None:
    """The pid of the live process that holds NAME open, if any (for listings; ``acquire`` is the real test)."""
    pid = _read_pid(lock_path(name))
    if pid is None or pid == os.getpid():
        return pid
    return pid if pid_alive(pid) else None


def save(name: str, data: dict) -> Path:
    """Write the session atomically. Callers hold ``SessionLock(name)``; as a second line of defence a session
    that a live process other than this one has open is refused."""
    path = session_path(name)
    Session.check_dict(data)
    other = holder(name)
    if other is not None and other != os.getpid():
        raise SessionBusy(name, other, hint="save under another name, or close that chat first")
    data = {**data, "name": name, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n", private=True)  # conversations
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
    except OSError as e:
        raise SessionError(f"cannot read session {path}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, or not UTF-8: damaged (a full disk, an editor)
        raise SessionError(f"session {path} is damaged ({e})",
                           hint="repair or delete that file, or use another session name") from None
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
    open_in: int | None = None   # pid of a live process that has it open


def list_sessions() -> list[SessionInfo]:
    out = []
    for name in names():
        path = session_path(name)
        try:  # listed as /load would read it: a file /load refuses is "unreadable", not "4 messages"
            data = Session.check_dict(json.loads(path.read_text(encoding="utf-8")))
            model, count = str(data.get("model", "?")), len(data.get("messages", []))
        except (OSError, ValueError, TypeError, AttributeError, SessionError):
            model, count = "unreadable", 0
        out.append(SessionInfo(name, path, path.stat().st_mtime, model, count, holder(name)))
    return out
