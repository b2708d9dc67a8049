"""Reading what the user types: prompt-toolkit in a terminal, plain lines from a pipe.

Terminal input has line editing, persistent history ($XDG_STATE_HOME/mlxinfer/history, appended as each entry
is accepted, so it survives any exit), Ctrl-R reverse search, Tab completion of slash commands and their
arguments, and two ways to write several lines: a block between \"\"\" marks (as in Ollama), or Alt-Enter /
Esc-Enter for a newline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from ..errors import InvalidParameter

TRIPLE = '"""'
PROMPT = ">>> "
CONTINUATION = "... "


def history_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "mlxinfer" / "history"


def open_block(text: str) -> bool:
    """True while a \"\"\" block is started but not closed (Enter then adds a line instead of sending)."""
    s = text.lstrip()
    if not s.startswith(TRIPLE):
        return False
    return not (len(s.rstrip()) >= 2 * len(TRIPLE) and s.rstrip().endswith(TRIPLE))


def strip_block(text: str) -> str:
    """The message inside a \"\"\" block (the marks removed); other text unchanged."""
    s = text.strip()
    if not s.startswith(TRIPLE):
        return text
    s = s[len(TRIPLE):]
    if s.endswith(TRIPLE):
        s = s[:-len(TRIPLE)]
    return s.strip("\n")


def next_entry(keys: str) -> tuple[str, bool, str]:
    """Split keys typed ahead (``_KeyWatch.typed_ahead``: "\\r" = Enter, "\\n" = a newline in the message) into
    (the next prompt's text, whether an Enter already sent it, the keys after that Enter). An Enter inside an
    open \"\"\" block adds a line, as it does at the prompt; an Enter on an empty line sends nothing."""
    text = ""
    for i, ch in enumerate(keys):
        if ch == "\r" and not open_block(text):
            if text.strip():
                return text, True, keys[i + 1:]
            text = ""
        else:
            text += "\n" if ch == "\r" else ch
    return text, False, ""


class LineReader:
    """Plain mode: one message per line; a line starting with \"\"\" opens a block closed by a line ending \"\"\"."""

    def __init__(self, stream=None, prompt_to=None):
        self.stream = stream or sys.stdin
        self.prompt_to = prompt_to  # a stream to write a short prompt to (a terminal in --plain), or None
        self.lines = 0

    def _line(self) -> str:
        line = self.stream.readline()
        self.lines += bool(line)
        return line

    def read(self, default: str = "", accept: bool = False) -> str:
        if self.prompt_to:
            self.prompt_to.write(PROMPT)
            self.prompt_to.flush()
        first = self.lines + 1
        line = self._line()
        if not line:
            raise EOFError
        text = line.rstrip("\n")
        while open_block(text):
            more = self._line()
            if not more:
                break
            text += "\n" + more.rstrip("\n")
        try:  # stdin decodes with surrogateescape: bytes that are not UTF-8 arrive as lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError:
            where = f"line {first}" if self.lines == first else f"lines {first}-{self.lines}"
            raise InvalidParameter(f"{where} of the input is not valid UTF-8 (skipped)",
                                   hint="convert it first, e.g. iconv -f latin1 -t utf-8") from None
        return strip_block(text)

    def close(self) -> None:
        pass


def make_completer(commands: dict[str, str], arguments: Callable[[str], Iterable[str]]):
    """Tab completion: command names (with their help as meta), then the command's argument values."""
    from prompt_toolkit.completion import Completer, Completion

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            text = document.text_before_cursor
            if not text.startswith("/") or "\n" in text:
                return
            if " " not in text:
                for name, help_ in commands.items():
                    if name.startswith(text):
                        yield Completion(name, start_position=-len(text), display_meta=help_)
                return
            cmd, _, arg = text.partition(" ")
            if " " in arg:
                return
            for value in arguments(cmd):
                if value.startswith(arg):
                    yield Completion(value, start_position=-len(arg))

    return SlashCompleter()


class PromptReader:
    """Terminal mode: a prompt-toolkit PromptSession."""

    def __init__(self, completer=None, history: Path | None = None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.formatted_text import FormattedText
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        path = history or history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            hist = FileHistory(str(path))
        except OSError:
            hist = InMemoryHistory()  # read-only home: editing still works, history just is not kept
        kb = KeyBindings()

        @kb.add("escape", "enter")
        def _newline(event):
            event.current_buffer.insert_text("\n")

        @kb.add("enter", filter=Condition(lambda: open_block(self.session.default_buffer.text)))
        def _block_newline(event):
            event.current_buffer.insert_text("\n")

        @kb.add("c-c")
        def _interrupt(event):
            buf = event.current_buffer
            if buf.text:
                buf.reset()  # like a shell: Ctrl-C drops the line being typed
            else:
                event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

        self.session = PromptSession(
            history=hist, completer=completer, complete_while_typing=False, key_bindings=kb,
            auto_suggest=AutoSuggestFromHistory(), enable_history_search=False, mouse_support=False,
            prompt_continuation=lambda width, line, wrap: CONTINUATION.rjust(width),
            placeholder=FormattedText([("fg:ansibrightblack", "Send a message (/help for commands)")]),
        )

    def read(self, default: str = "", accept: bool = False) -> str:
        """The next message; ``default`` starts it (keys typed while a reply streamed) and ``accept`` sends it as
        it is shown (their Enter was pressed too): it still lands in the scrollback and the history."""
        from prompt_toolkit.formatted_text import FormattedText

        text = self.session.prompt(FormattedText([("bold fg:ansimagenta", PROMPT)]), default=default,
                                   accept_default=accept)
        return strip_block(text)

    def close(self) -> None:
        pass
