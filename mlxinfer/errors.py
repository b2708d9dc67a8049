"""Errors a user can fix. The CLI prints them as one line and exits with ``exit_code``."""

from __future__ import annotations

import re


class MlxinferError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} ({self.hint})" if self.hint else msg


class ModelNotFound(MlxinferError):
    pass


class InvalidModel(MlxinferError):
    pass


class DamagedFile(InvalidModel):
    """A model file on disk is truncated or corrupt: getting it again (download, import, convert) fixes it."""


class ConfigError(MlxinferError):
    pass


class InvalidParameter(MlxinferError):
    pass


class DownloadError(MlxinferError):
    pass


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived. A KeyboardInterrupt so every cleanup path that handles Ctrl-C (temp dirs, the
    partial reply) runs for it too; code that must tell the two apart (chat: Ctrl-C stops a reply, SIGTERM ends
    the program) checks for this class. The CLI exits 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # not \t or \n: "\ninterrupted" starts a fresh line


def one_line(error: BaseException) -> str:
    """A library's exception text on one line: transformers' can run to six, and its first line alone stops
    mid-sentence ("... from one of:")."""
    return " ".join(str(error).split()) or type(error).__name__


def printable(text: str) -> str:
    """Text from model files (names, licenses, error lines quoting them) with control characters shown as '?': an
    ESC sequence in a config could clear the screen or retitle the terminal when printed raw."""
    return _CONTROL.sub("?", text)
