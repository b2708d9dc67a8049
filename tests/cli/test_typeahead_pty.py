"""Keys typed while a reply streams are kept whole in the real chat (pty): the text and its Enter, so a message
typed ahead is sent as soon as the reply ends, shown at the prompt and kept in the history."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from chat_pty import READY, STATS, STREAMS_SLOWLY

pytestmark = pytest.mark.slow


def test_message_typed_during_a_reply_is_sent_with_its_enter(pty, chat_env):
    c = pty("chat", "--temp", "0", "--max-tokens", "60", *STREAMS_SLOWLY)  # ~7 tok/s: 60 tokens last ~9 s
    c.expect(READY)
    c.send_line("Count from 1 to 100, separated by commas.")
    c.expect(r"Count from 1 to 100, separated by commas\.")
    c.expect(r"\d+, \d+, \d+")  # the reply is streaming
    assert not re.search(STATS, c.screen[c.pos:]), "the reply ended before the keys could be typed during it"
    c.child.send("hel")
    time.sleep(0.3)
    c.child.send("lx\x7fo\r")  # a typo corrected with Backspace, then Enter: all while the reply streams
    first = c.expect(STATS)
    assert int(first["gen"]) > 20
    before = c.screen[: first.start()].split("separated by commas.")[-1]
    assert "hello" not in before and "hel" not in before  # nothing was echoed into the reply
    c.expect(r">>> hello")  # shown at the prompt, and sent without another Enter:
    second = c.expect(STATS, timeout=90)
    assert int(second["prompt"]) < int(second["used"]) - int(second["gen"])  # a new turn on the kept cache
    c.expect(READY)
    c.send_line("/bye")
    assert c.wait_exit() == 0
    history = (Path(chat_env["_ROOT"]) / "state" / "mlxinfer" / "history").read_text()
    assert "\n+hello\n" in history
