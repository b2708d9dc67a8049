"""Keys typed ahead during a reply: how the raw terminal bytes become the next prompt's text and Enter."""

from __future__ import annotations

import pytest

from mlxinfer.ui.chat_input import next_entry
from mlxinfer.ui.chat_view import _KeyWatch


def keys(raw: bytes) -> str:
    k = _KeyWatch.__new__(_KeyWatch)  # no terminal: only the decoding is under test
    k.typed = raw
    return k.typed_ahead()


@pytest.mark.parametrize("raw, want", [
    (b"hello\r", "hello\r"),
    (b"hello\n", "hello\r"),                       # the tty turns CR into NL outside raw mode
    (b"helx\x7flo", "hello"),                      # Backspace edits
    (b"a\rb\x7f\x7f", "a\r"),                      # ...but never a line already sent
    (b"up\x1b[Aarrow\x1bOPkeys", "uparrowkeys"),   # arrows and function keys dropped
    (b"one\x1b\rtwo\r", "one\ntwo\r"),             # Esc-Enter: a newline in the message
    ("caf\u00e9\r".encode(), "caf\u00e9\r"),
])
def test_raw_keys(raw, want):
    assert keys(raw) == want


@pytest.mark.parametrize("typed, want", [
    ("hello\r", ("hello", True, "")),
    ("hel", ("hel", False, "")),
    ("\r \rhi\rthere", ("hi", True, "there")),     # Enter on an empty line sends nothing
    ('"""a\rb"""\rx', ('"""a\nb"""', True, "x")),  # Enter inside a """ block adds a line
    ('"""a\rb', ('"""a\nb', False, "")),
    ("a\nb\r/bye\r", ("a\nb", True, "/bye\r")),
])
def test_next_entry(typed, want):
    assert next_entry(typed) == want
