"""What chat shows: header panel, live Markdown replies, think blocks, stats and notices.

Two views with one interface: ``RichView`` for a terminal and ``PlainView`` for pipes/``--plain``/``NO_COLOR``
(replies alone on stdout, everything else on stderr, so chat can be scripted).

Streaming Markdown without flicker: while a reply streams, a Rich ``Live`` region shows only the last screenful
of the rendered Markdown and is redrawn at most ``REFRESH_HZ`` times a second; when the reply ends the region is
erased and the full rendering is printed once, so the scrollback holds exactly one copy of every line.
"""

from __future__ import annotations

import re
import sys
import time

from rich.box import ROUNDED
from rich.console import Console, Group
from rich.live import Live
from rich.markdown import Markdown
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

REFRESH_HZ = 8
CODE_THEME = "monokai"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_think(text: str) -> tuple[str | None, str, bool]:
    """Split a reply into (thinking, answer, still_thinking). Handles templates that open the block in the
    prompt, where the reply holds only the closing tag."""
    start, end = text.find(THINK_OPEN), text.find(THINK_CLOSE)
    if end >= 0 and (start < 0 or end < start):
        return text[:end].strip(), text[end + len(THINK_CLOSE):].lstrip(), False
    if start < 0:
        return None, text, False
    before = text[:start]
    if end < 0:
        return text[start + len(THINK_OPEN):].strip(), before, True
    return text[start + len(THINK_OPEN):end].strip(), (before + text[end + len(THINK_CLOSE):]).lstrip(), False


def reply_renderable(text: str, think: str = "on", streaming: bool = False):
    """The Rich rendering of a (partial) reply: thinking dimmed (or one line when hidden), answer as Markdown."""
    thinking, answer, open_ = split_think(text)
    parts = []
    if thinking is not None:
        if think == "hide":
            words = len(thinking.split())
            label = f"thinking… ({words} words)" if open_ else f"thought for {words} words (hidden; /think on shows it)"
            parts.append(Text(label, style="dim italic"))
        elif thinking:
            parts.append(Text("Thinking", style="dim bold"))
            parts.append(Text(thinking, style="dim italic"))
            if not open_:
                parts.append(Text(""))
    if answer.strip():
        parts.append(Markdown(answer, code_theme=CODE_THEME))
    elif streaming and not parts:
        parts.append(Text("…", style="dim"))
    return Group(*parts)


class _Tail:
    """Renders another renderable and keeps only its last ``height`` lines (the Live region never scrolls)."""

    def __init__(self, renderable, height: int):
        self.renderable, self.height = renderable, max(height, 3)

    def __rich_console__(self, console, options):
        lines = console.render_lines(self.renderable, options, pad=False)
        for line in lines[-self.height:]:
            yield from line
            yield Segment.line()


class _KeyWatch:
    """While a reply streams the terminal is put in a quiet, non-canonical mode without signals: nothing is
    echoed (an echoed ^C or stray keys would shift the live region and leave a stale copy behind) and Ctrl-C
    arrives as a byte that ``pressed_ctrl_c()`` polls between tokens. Not using SIGINT here matters: a signal
    landing while MLX waits on its scheduler was seen to hang the process (MLX 0.32, CPU)."""

    def __init__(self):
        self._fd, self._old = None, None
        self.typed = b""
        try:
            import termios

            fd = sys.stdin.fileno()
            old = termios.tcgetattr(fd)
            new = list(old)
            new[3] &= ~(termios.ECHO | termios.ICANON | termios.ISIG | getattr(termios, "ECHOCTL", 0))
            new[6] = list(new[6])
            new[6][termios.VMIN], new[6][termios.VTIME] = 0, 0
            termios.tcsetattr(fd, termios.TCSANOW, new)
            self._fd, self._old = fd, old
        except Exception:  # noqa: BLE001 - no terminal (or no termios): SIGINT does the job instead
            pass

    def pressed_ctrl_c(self) -> bool:
        if self._fd is None:
            return False
        import os
        import select

        try:
            if not select.select([self._fd], [], [], 0)[0]:
                return False
            data = os.read(self._fd, 1024)
        except OSError:
            return False
        self.typed += data.replace(b"\x03", b"")  # the user may start the next message while this one streams
        return b"\x03" in data

    def typed_ahead(self) -> str:
        """What was typed meanwhile, whole: "\\r" for each Enter, "\\n" for Esc-Enter / Alt-Enter (a newline in the
        message), Backspace applied, other keys (arrows, function keys) dropped. ``chat_input.next_entry`` splits
        it into what the next prompt shows and whether its Enter was already pressed."""
        raw = self.typed.decode("utf-8", "ignore")
        raw = re.sub(r"\x1b[\r\n]", "\x00", raw)  # Esc-Enter, before the escape sequences go
        raw = re.sub(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|[^\r\n])", "", raw)
        out: list[str] = []
        for ch in raw:
            if ch in "\x7f\b":
                if out and out[-1] != "\r":  # Backspace edits the line being typed, not one already sent
                    out.pop()
            elif ch in "\r\n":  # Enter (the terminal may turn CR into NL in this mode)
                out.append("\r")
            elif ch == "\x00":
                out.append("\n")
            elif ch.isprintable():
                out.append(ch)
        return "".join(out)

    def restore(self) -> None:
        if self._fd is not None:
            import termios

            self.pressed_ctrl_c()  # collect the last keys before the terminal goes back to line mode
            try:
                termios.tcsetattr(self._fd, termios.TCSANOW, self._old)
            except Exception:  # noqa: BLE001
                pass
            self._fd = None


class RichReply:
    def __init__(self, console: Console, think: str):
        self.console, self.think = console, think
        self.text = ""
        self._last = 0.0
        self._keys = _KeyWatch()
        self._live = Live(console=console, auto_refresh=False, transient=True, redirect_stdout=False,
                          redirect_stderr=False)
        self._live.start()
        self._live.update(Text("…", style="dim"), refresh=True)

    def pressed_ctrl_c(self) -> bool:
        return self._keys.pressed_ctrl_c()

    def typed_ahead(self) -> str:
        return self._keys.typed_ahead()

    def prefill(self, done: int, total: int) -> None:
        if not self.text and total > 256:
            self._live.update(Text(f"reading the prompt… {done}/{total} tokens", style="dim"), refresh=True)

    def feed(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        now = time.monotonic()
        if now - self._last >= 1 / REFRESH_HZ:
            self._last = now
            height = self.console.size.height - 2
            self._live.update(_Tail(reply_renderable(self.text, self.think, streaming=True), height), refresh=True)

    def finish(self, interrupted: bool = False) -> None:
        self._live.stop()  # transient: the live region is erased...
        self._keys.restore()
        if self.text.strip():  # ...and the final rendering printed once, into the scrollback
            self.console.print(reply_renderable(self.text, self.think))
        if interrupted:
            self.console.print(Text("[interrupted]", style="yellow"))


class PlainReply:
    """Writes the reply to stdout as it streams; with think=hide, text inside <think>…</think> is held back."""

    def __init__(self, out, think: str):
        self.out, self.think = out, think
        self.text, self._written = "", 0

    def pressed_ctrl_c(self) -> bool:
        return False  # plain mode: Ctrl-C comes as SIGINT

    def typed_ahead(self) -> str:
        return ""

    def prefill(self, done: int, total: int) -> None:
        pass

    def _visible(self, final: bool) -> str:
        if self.think != "hide":
            return self.text
        thinking, answer, open_ = split_think(self.text)
        if thinking is None:
            # Hold back a possible partial "<think>" at the end until it is decided.
            keep = 0 if final else max((n for n in range(1, len(THINK_OPEN)) if self.text.endswith(THINK_OPEN[:n])),
                                       default=0)
            return self.text[:len(self.text) - keep]
        return "" if open_ else answer

    def feed(self, piece: str) -> None:
        self.text += piece
        visible = self._visible(final=False)
        if len(visible) > self._written and visible.startswith(visible[:self._written]):
            self.out.write(visible[self._written:])
            self.out.flush()
            self._written = len(visible)

    def finish(self, interrupted: bool = False) -> None:
        visible = self._visible(final=True)
        if len(visible) > self._written:
            self.out.write(visible[self._written:])
        self.out.write("\n")
        self.out.flush()
        if interrupted:
            print("[interrupted]", file=sys.stderr, flush=True)


def header_rows(loaded, session) -> list[tuple[str, str]]:
    from .console_out import format_bytes

    import mlx.core as mx

    backend = {"metal": "Metal (Apple GPU)", "cuda": "CUDA", "cpu": "CPU"}.get(loaded.backend, loaded.backend)
    detail = loaded.kernels_detail or ""
    kernels = detail if detail.startswith(loaded.kernels) else loaded.kernels + (f" ({detail})" if detail else "")
    params = loaded.spec.params or f"{loaded.num_parameters() / 1e6:,.0f}M"
    rows = [
        ("model", loaded.name + (f" — {loaded.spec.description}" if loaded.spec.description else "")),
        ("parameters", params),
        ("quantization", loaded.quantization),
        ("memory", f"{format_bytes(loaded.weight_bytes())} weights, {format_bytes(mx.get_active_memory())} in use"),
        ("context", f"{session.context_limit:,} tokens"),
        ("backend", f"{backend}, {loaded.dtype}"),
        ("kernels", kernels),
    ]
    if session.kv.active:
        from .chat_commands import kv_cache_line

        rows.append(("KV cache", kv_cache_line(session)))
    if session.system:
        rows.append(("system", session.system if len(session.system) <= 60 else session.system[:57] + "..."))
    return rows


class RichView:
    interactive = True

    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False)

    def header(self, loaded, session) -> None:
        rows = header_rows(loaded, session)
        grid = Table.grid(padding=(0, 3))
        grid.add_column(style="default")
        grid.add_column(style="bold")
        for k, v in rows:
            grid.add_row(k, v)
        self.console.print(Panel(grid, title="[bold magenta]mlxinfer chat[/]", title_align="left",
                                 border_style="blue", box=ROUNDED, padding=(0, 2)))
        self.console.print(Text.assemble(
            ("  /help", "bold"), (" commands · ", "dim"), ('"""', "bold"), (" or ", "dim"), ("Alt-Enter", "bold"),
            (" for multi-line · ", "dim"), ("Ctrl-C", "bold"), (" stops a reply · ", "dim"), ("Ctrl-D", "bold"),
            (" exits", "dim"),
        ))

    def reply(self, think: str) -> RichReply:
        return RichReply(self.console, think)

    def user_message(self, text: str) -> None:
        self.console.print(Text(">>> ", style="bold magenta") + Text(text))

    def assistant_message(self, text: str, think: str, interrupted: bool = False) -> None:
        self.console.print(reply_renderable(text, think))
        if interrupted:
            self.console.print(Text("[interrupted]", style="yellow"))

    def stats(self, line: str) -> None:
        self.console.print(Text(line, style="dim"))

    def info(self, text: str) -> None:
        self.console.print(Text(text))

    def table(self, rows: list[tuple[str, str]], title: str | None = None) -> None:
        grid = Table.grid(padding=(0, 3))
        grid.add_column(style="dim")
        grid.add_column()
        for k, v in rows:
            grid.add_row(k, v)
        if title:
            self.console.print(Text(title, style="bold"))
        self.console.print(grid)

    def markdown(self, text: str) -> None:
        self.console.print(Markdown(text))

    def notice(self, text: str) -> None:
        self.console.print(Text(text, style="yellow"))

    def error(self, text: str) -> None:
        self.console.print(Text("error: ", style="bold red") + Text(text))


class PlainView:
    """Replies on stdout; everything else (notices, command output, stats) on stderr."""

    interactive = False

    def __init__(self, out=None, err=None):
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.errors = 0  # errors shown: a piped chat with any exits non-zero (cli.chat), so scripts can tell

    def _say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def header(self, loaded, session) -> None:
        pass

    def reply(self, think: str) -> PlainReply:
        return PlainReply(self.out, think)

    def user_message(self, text: str) -> None:
        self._say(f">>> {text}")

    def assistant_message(self, text: str, think: str, interrupted: bool = False) -> None:
        self._say(text + (" [interrupted]" if interrupted else ""))

    def stats(self, line: str) -> None:
        self._say(line)

    info = notice = _say

    def table(self, rows: list[tuple[str, str]], title: str | None = None) -> None:
        if title:
            self._say(title)
        width = max((len(k) for k, _ in rows), default=0)
        for k, v in rows:
            self._say(f"  {k.ljust(width)}  {v}")

    def markdown(self, text: str) -> None:
        self._say(text)

    def error(self, text: str) -> None:
        self.errors += 1
        self._say(f"error: {text}")
