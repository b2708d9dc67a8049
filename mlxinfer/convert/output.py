"""Where ``convert`` may write: the checks on ``-o`` that keep a careless command from deleting anyone's files.

- Never: an empty ``-o``, the current directory or one above it, home or one above it, ``/``, the source itself,
  a folder that holds the source or one inside it (``--force`` or not).
- ``--force`` replaces only a directory that is recognisably a model output (the files an MLX model directory
  holds); anything else is refused with what would have been lost.
- A path below an existing file, on a read-only or virtual file system (``/proc``) gets one line naming that.
"""

from __future__ import annotations

import errno
import fnmatch
import os
from pathlib import Path

from ..errors import MlxinferError

# What an MLX / Hugging Face model directory holds; convert copies only these from a source, so its own outputs
# are always replaceable with --force.
MODEL_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "tiktoken.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json", "README.md", "LICENSE*",
    "USE_POLICY.md", "NOTICE*", ".gitattributes", ".DS_Store",
)


class OutputExists(MlxinferError):
    pass


class OutputRefused(OutputExists):
    """An -o that is never written, --force or not."""


def is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in MODEL_FILES)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_output_path(raw: str | os.PathLike) -> Path:
    """The absolute output path, or one line saying why ``raw`` must not be written (no source needed yet)."""
    text = os.fspath(raw)
    if not text.strip():
        raise OutputRefused("-o is empty", hint="give the directory to write the converted model to, e.g. -o my-model")
    out = Path(text).expanduser().absolute()
    real = out.resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if real == Path(real.anchor):
        raise OutputRefused(f"-o {text} is the root directory", hint="give a new directory for the model")
    if _within(cwd, real):
        which = "the current directory" if real == cwd else f"a folder that holds the current directory ({cwd})"
        raise OutputRefused(f"-o {text} is {which}; convert never writes over it",
                            hint="give a new directory for the model, e.g. -o ./my-model")
    if _within(home, real):
        raise OutputRefused(f"-o {text} is your home directory{'' if real == home else ' or above it'}",
                            hint="give a new directory for the model, e.g. -o ~/models/my-model")
    _check_writable_place(out, text)
    return out


def _check_writable_place(out: Path, text: str) -> None:
    """The nearest existing folder must be a directory on a real, writable file system."""
    p = out.parent
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise OutputRefused(f"-o {text}: {p} is a file, not a directory",
                            hint="choose an -o that is not inside a file")
    try:
        st = os.statvfs(p)
    except (OSError, AttributeError):  # no statvfs (Windows): the write itself will tell
        return
    if st.f_blocks == 0:  # /proc, /sys: no storage behind it
        raise OutputRefused(f"-o {text}: {p} is a virtual file system, not a place for files",
                            hint="choose a directory on a disk")
    if getattr(os, "ST_RDONLY", 1) & st.f_flag:
        raise OutputRefused(f"-o {text}: {p} is on a read-only file system", hint="choose a writable directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise OutputRefused(f"-o {text}: permission denied in {p}", hint="choose a directory you can write to")


def check_not_source(out: Path, source: Path) -> None:
    """Neither the source, nor a folder holding it, nor one inside it: --force would delete the source."""
    real, src = out.resolve(), source.resolve()
    if real == src:
        raise OutputRefused(f"-o {out} is the source itself", hint="write the converted model to another -o")
    if _within(src, real):
        raise OutputRefused(f"-o {out} holds the source {source}; convert never writes over its source",
                            hint="write the converted model to another -o")
    if _within(real, src):
        raise OutputRefused(f"-o {out} is inside the source {source}",
                            hint="write the converted model outside the source directory")


def check_replaceable(out: Path, force: bool) -> None:
    """An existing ``out`` may go only with ``force`` and only when everything in it is a model file."""
    if not os.path.lexists(out):
        return
    if out.is_symlink():
        raise OutputExists(f"{out} is a symbolic link", hint="give the real directory, or choose another -o")
    if not out.is_dir():
        raise OutputExists(f"{out} exists and is not a directory", hint="remove it or choose another -o")
    try:
        entries = sorted(os.scandir(out), key=lambda e: e.name)
    except OSError as e:
        raise OutputExists(f"{out} exists and cannot be read ({e.strerror})", hint="choose another -o") from None
    foreign = [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries
               if not (e.is_file(follow_symlinks=False) and is_model_file(e.name))]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
        n = len(foreign)
        what = "1 entry that is not a model file" if n == 1 else f"{n} entries that are not model files"
        raise OutputExists(f"{out} holds {what} ({shown}); --force replaces only a model directory",
                           hint="choose another -o")
    if not force:
        raise OutputExists(f"{out} already exists", hint="choose another -o, or add --force to replace it")


def disk_error(e: OSError, out: Path) -> MlxinferError:
    """A failure to create the output's folder or temp dir, as one line naming the cause."""
    if e.errno in (errno.EACCES, errno.EPERM):
        return OutputRefused(f"-o {out}: permission denied", hint="choose a directory you can write to")
    if e.errno == errno.EROFS:
        return OutputRefused(f"-o {out} is on a read-only file system", hint="choose a writable directory")
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return OutputRefused(f"-o {out}: a file is in the way ({e.filename})", hint="choose another -o")
    return OutputRefused(f"cannot create -o {out}: {e.strerror or e}", hint="choose another -o")
