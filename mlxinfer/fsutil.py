"""Atomic directories and files: build the result beside its target under a temp name, rename it into place.

One piece of code for every directory mlxinfer writes whole (convert's output, the GGUF import cache):

- ``AtomicDir(target)`` makes ``.NAME.tmp-PID-XXXX`` beside ``target`` and holds an ``flock`` on it while it is in
  use. Any exit without ``publish()`` (an error, Ctrl-C, SIGTERM/SIGHUP as ``Terminated``) removes it, with those
  signals held back (``signals_deferred``) so another one cannot cut the cleanup or the final rename short; parent
  folders it had to create go too.
- ``sweep_stale(parent, name)`` removes what a run killed outright (SIGKILL, power loss) left: only our own temp
  names holding our marker file (a user's folder named alike is left alone), only when the pid in the name is gone
  *and* nobody holds the directory's lock (a concurrent run in another pid namespace keeps its lock).
- ``write_failure(e, where)``: MLX reports a failed write as a bare RuntimeError; this names the real cause.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from .errors import MlxinferError

# mkdtemp's names: .NAME.tmp-PID-XXXXXXXX (8 of [a-z0-9_]); a folder of the user's that looks alike is never ours
# unless it also holds MARKER, which only AtomicDir writes.
STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[a-z0-9_]{8}$")
MARKER = ".mlxinfer-temp"
_DEFERRED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class WriteFailed(MlxinferError):
    """Writing failed for a reason the user fixes outside mlxinfer (disk full, size limit, permissions)."""


@contextlib.contextmanager
def signals_deferred():
    """Hold back Ctrl-C / SIGTERM / SIGHUP until the block ends (cleanup must not be cut short), then deliver them.

    The Python handlers are swapped for a recorder: masking the main thread alone would not do, since the kernel
    hands a process signal to any thread (MLX's, numpy's) and Python then runs the handler in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for signum in _DEFERRED:
        try:
            previous[signum] = signal.signal(signum, lambda n, _f: pending.append(n))
        except (ValueError, OSError):
            continue
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)  # the restored handler runs now (Terminated, KeyboardInterrupt, ...)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we wrote: never treat it as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows: the pid check alone decides
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def sweep_stale(parent: Path, name: str | None = None) -> list[Path]:
    """Remove ``.NAME.tmp-PID-*`` / ``.NAME.old-PID-*`` directories in ``parent`` whose process is gone and whose lock
    is free (``name=None``: any name). Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = STALE_RE.match(entry.name)
        if not m or (name is not None and m["name"] != name) or int(m["pid"]) == os.getpid():
            continue
        if not entry.is_dir(follow_symlinks=False) or pid_alive(int(m["pid"])):
            continue
        if not os.path.isfile(os.path.join(entry.path, MARKER)) or os.path.islink(os.path.join(entry.path, MARKER)):
            continue  # a look-alike name the user gave a folder: not ours to delete
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _try_lock(fd):  # free: its owner is gone in every pid namespace that shares this disk
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
        finally:
            os.close(fd)
    return removed


def _make_parents(path: Path, created: list[Path]) -> None:
    """``mkdir -p`` that records the folders it created (deepest last) in ``created``, so a failure can take
    them back."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:
            continue
        created.append(p)


def _remove_empty(folders: list[Path]) -> None:
    for p in reversed(folders):
        try:
            p.rmdir()
        except OSError:  # not empty (someone else uses it now) or gone
            break


class AtomicDir:
    """``with AtomicDir(target) as d: write into d.path; d.publish()`` - the target appears whole or not at all."""

    def __init__(self, target: Path, *, sweep: bool = True, describe_error=None):
        """``describe_error(OSError) -> Exception``: what to raise when the folder or temp dir cannot be made."""
        self.target = Path(target)
        self._describe = describe_error
        self.path: Path | None = None
        self._fd: int | None = None
        self._created: list[Path] = []
        self._sweep = sweep
        self.published = False

    def __enter__(self) -> "AtomicDir":
        parent = self.target.parent
        with signals_deferred():  # the temp dir exists only once cleanup is armed
            try:
                _make_parents(parent, self._created)
                if self._sweep:
                    sweep_stale(parent, self.target.name)
                self.path = Path(tempfile.mkdtemp(dir=parent, prefix=f".{self.target.name}.tmp-{os.getpid()}-"))
                (self.path / MARKER).touch()
                self._fd = os.open(self.path, os.O_RDONLY)
                _try_lock(self._fd)
            except BaseException as e:
                self._cleanup()
                if isinstance(e, OSError) and self._describe is not None:
                    raise self._describe(e) from None
                raise
        return self

    def publish(self, replace: bool = True) -> None:
        """Rename the finished temp dir to ``target``; an existing target (only if ``replace``) is moved aside, then
        removed. Signals wait until the rename is done, so the target is either the old or the new directory."""
        with signals_deferred():
            old = None
            if os.path.lexists(self.target):
                if not replace:
                    raise FileExistsError(errno.EEXIST, "already exists", str(self.target))
                old = Path(tempfile.mkdtemp(dir=self.target.parent,
                                            prefix=f".{self.target.name}.old-{os.getpid()}-"))
                (old / MARKER).touch()
                os.replace(self.target, old / "d")  # rename into a fresh name: never onto something else
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path / MARKER)  # the published folder is the user's (if cut here: never swept)
                os.chmod(self.path, 0o777 & ~current_umask())  # mkdtemp's 0700 hid a converted model from others
                os.replace(self.path, self.target)
            except BaseException:
                if old is not None:
                    os.replace(old / "d", self.target)
                    shutil.rmtree(old, ignore_errors=True)
                raise
            self.published = True
        if old is not None:  # signals welcome again: if one cuts this short, the next run sweeps the rest
            shutil.rmtree(old, ignore_errors=True)

    def _cleanup(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.published:
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
            _remove_empty(self._created)

    def __exit__(self, *exc) -> None:
        with signals_deferred():
            self._cleanup()


def current_umask() -> int:
    """The process umask, read without changing it where /proc says it (os.umask can only swap it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str, private: bool = False) -> None:
    """Write a small text file whole (temp file, fsync, rename) or not at all; with the usual permissions (0666 less
    the umask), or owner-only with ``private`` (chat sessions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if not private:
            os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600: a bench report others could not read
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _may(st: os.stat_result, bit: int) -> bool:
    """Whether the mode bits let this user ``bit`` (4 read, 1 search/execute); root's override is left out, so a
    denied read is explained by the bits a user can change."""
    if st.st_uid == os.geteuid():
        return bool(st.st_mode >> 6 & bit)
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return bool(st.st_mode >> 3 & bit)
    return bool(st.st_mode & bit)


def unreadable(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(the part of ``path`` that cannot be read, a chmod that fixes it) when a permission error on ``path`` came
    from reading it (a file without read permission, a folder on the way that cannot be opened); None when
    everything on the way is readable (then it was a write)."""
    p = Path(os.path.abspath(path))
    for part in [*reversed(p.parents), p]:
        try:
            st = part.stat()
        except OSError:
            return None  # it does not exist (a write to a new file) or cannot be looked at: not a read
        if part.is_dir():
            if not _may(st, 1) or (part == p and not _may(st, 4)):
                return part, f"chmod u+rx '{part}'"
        elif not _may(st, 4):
            return part, f"chmod u+r '{part}'"
    return None


def read_failure(error: BaseException) -> MlxinferError | None:
    """The one-line error for a permission error that came from reading (None if it was a write)."""
    code, name = getattr(error, "errno", None), getattr(error, "filename", None)
    if code not in (errno.EACCES, errno.EPERM) or not name:
        return None
    found = unreadable(name)
    if found is None:
        return None
    part, fix = found
    kind = "folder" if part.is_dir() else "file"
    return MlxinferError(f"cannot read the {kind} {part}: permission denied", hint=f"make it readable: {fix}")


def write_failure(error: BaseException, where: Path, what: str, limit_hint: str = "") -> MlxinferError | None:
    """The one-line error for a failed write of ``what`` into ``where`` (None when it was not the disk's doing).
    MLX raises ``RuntimeError("[write] Unable to write N bytes")`` without errno: look at space and limits."""
    code = getattr(error, "errno", None)
    if (denied := read_failure(error)) is not None:  # a source file that cannot be read, not the output
        return denied
    if code is None:
        text = str(error).lower()
        if not isinstance(error, RuntimeError) or not ("unable to write" in text or text.startswith("[write]")):
            return None
        code = _likely_errno(where)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return WriteFailed(f"no space left on the device while writing {what} in {where}; nothing was kept",
                           hint="free some space or choose another place")
    if code == errno.EFBIG:
        return WriteFailed(f"file size limit reached while writing {what} in {where}; nothing was kept",
                           hint=f"raise the limit (ulimit -f){limit_hint}")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return WriteFailed(f"cannot write {what} in {where}: {os.strerror(code)}; nothing was kept",
                           hint="choose a place you can write to")
    if code == errno.EIO or code is None:
        return WriteFailed(f"writing {what} in {where} failed ({error}); nothing was kept",
                           hint="check the disk and free space")
    return None


def _likely_errno(where: Path) -> int | None:
    try:
        if shutil.disk_usage(where).free < (64 << 20):
            return errno.ENOSPC
    except OSError:
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            return errno.EFBIG
    except (ImportError, OSError, ValueError):
        pass
    return None
