"""Helpers for driving the real ``mlxinfer chat`` in a pseudo-terminal (pexpect), reading the screen text as a
person would: escape sequences stripped, searched in order."""

from __future__ import annotations

import re
import sys
import time

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[=>78MDEc]|[\r\x07]")
ENTRY = [sys.executable, "-c", "from mlxinfer.cli.main import entry; entry()"]
# For tests that act while a reply streams (Ctrl-C, SIGTERM, keys typed ahead): MLX's built-in CPU kernels decode
# the bundled model at ~10 tok/s, so the reply is still streaming when they act; the native kernels (200-350 tok/s
# on a quiet 2-core VM) can finish a few hundred tokens before a key arrives. The UI path is the same either way.
STREAMS_SLOWLY = ("--kernels", "builtin")


class Pty:
    """A chat process in a pseudo-terminal; ``expect`` searches the de-escaped output from the last match on."""

    def __init__(self, args: list[str], env: dict, timeout: float = 60):
        import pexpect

        self.child = pexpect.spawn(ENTRY[0], ENTRY[1:] + args, env=env, dimensions=(40, 140), encoding="utf-8",
                                   codec_errors="replace", timeout=timeout)
        self.raw, self.pos, self.timeout = "", 0, timeout

    @property
    def screen(self) -> str:
        return ANSI.sub("", self.raw)

    def _read(self, wait: float) -> bool:
        import pexpect

        try:
            self.raw += self.child.read_nonblocking(65536, timeout=wait)
            return True
        except pexpect.TIMEOUT:
            return True
        except pexpect.EOF:
            return False

    def expect(self, pattern: str, timeout: float | None = None) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + (timeout or self.timeout)
        alive = True
        while True:
            m = rx.search(self.screen, self.pos)
            if m:
                self.pos = m.end()
                return m
            if not alive or time.monotonic() > deadline:
                tail = self.screen[self.pos:][-1500:]
                raise AssertionError(f"{'exited' if not alive else 'timed out'} waiting for {pattern!r}; "
                                     f"output since the last match:\n{tail}")
            alive = self._read(0.2)

    def send_line(self, text: str) -> None:
        self.child.send(text + "\r")

    def ask(self, text: str, timeout: float | None = None) -> re.Match:
        """Send a message and wait for the reply's stats line; returns its match."""
        self.send_line(text)
        m = self.expect(STATS, timeout)
        self.expect(READY)
        return m

    def command(self, text: str, expect: str) -> re.Match:
        self.send_line(text)
        m = self.expect(expect)
        self.expect(READY)
        return m

    def wait_exit(self, timeout: float = 30) -> int:
        import pexpect

        self.child.expect(pexpect.EOF, timeout=timeout)
        self.child.close()
        return self.child.exitstatus

    def close(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


STATS = (r"(?P<gen>\d+) tokens? [\d.]+ tok/s · prompt (?P<prompt>\d+) tokens? [\d.]+ tok/s · TTFT [\d.]+ s · "
         r"context (?P<used>\d+)/(?P<limit>\d+)")
READY = r"Send a message"
