"""The real ``mlxinfer chat`` with the bundled SmolLM2 in a pseudo-terminal, driven as a person would.

Each chat start loads the model (a few seconds); replies are kept short with --max-tokens and --temp 0.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from chat_pty import ENTRY, READY, STATS, STREAMS_SLOWLY

pytestmark = pytest.mark.slow


def test_chat_conversation_commands_and_resume(pty, chat_env):
    root = Path(chat_env["_ROOT"])
    c = pty("chat", "--temp", "0", "--max-tokens", "16")
    c.expect(r"mlxinfer chat")
    c.expect(r"model\s+smollm2")
    c.expect(r"backend\s+CPU|backend\s+Metal|backend\s+CUDA")
    c.expect(r"kernels\s+\S+")
    c.expect(READY)

    first = c.ask("What is the capital of France?")
    assert "Paris" in c.screen[: first.start()].split("What is the capital of France?")[-1]
    used1 = int(first["used"])
    # first turn: the whole prompt is new; the conversation adds the reply and its end-of-turn tokens
    assert 0 <= used1 - int(first["gen"]) - int(first["prompt"]) <= 2

    second = c.ask("And of Italy?")
    # The KV cache is kept: turn 2 prefills only its own tokens, far fewer than the history it sees.
    full_prompt = int(second["used"]) - int(second["gen"])
    assert int(second["prompt"]) < used1 < full_prompt

    c.command("/set temp 0.5", r"set temperature = 0\.5")
    c.command("/show", r"temperature\s+0\.5")
    c.command("/set temp abc", r"error: invalid temperature 'abc': expected a number")
    c.command("/set top_p 3", r"error: invalid top_p 3\.0: must be in \(0, 1\]")
    c.command("/set bogus 1", r"error: unknown setting 'bogus'")
    c.command("/sett temp 1", r"unknown command /sett — did you mean /set\?")
    c.command("/set temp 0", r"set temperature = 0")

    m = c.command("/undo", r"removed the last exchange \(\"And of Italy\?\"\); context (\d+)/")
    assert int(m[1]) < int(second["used"])
    retry = c.ask("/retry")
    assert "Paris" in c.screen[: retry.start()].split("/retry")[-1]
    assert int(retry["prompt"]) == 1  # the cache was trimmed, not rebuilt

    c.command("/set max_tokens 3", r"set max_tokens = 3")
    c.send_line('"""')
    c.send_line("Say hi")
    c.expect(r"\.\.\. Say hi")
    c.send_line('in one word"""')
    c.expect(STATS)
    c.expect(READY)
    c.child.send("Line one\x1b\r")  # Esc-Enter: a newline, not send
    c.expect(r">>> Line one\s*\.\.\.")
    c.ask("line two")

    c.command("/save trip", r"saved session 'trip' \((\d+) messages\)")
    c.command("/sessions", r"trip\s+\d+ messages · smollm2")
    c.send_line("/bye")
    assert c.wait_exit() == 0

    saved = json.loads((root / "data" / "mlxinfer" / "sessions" / "trip.json").read_text())
    users = [m["content"] for m in saved["messages"] if m["role"] == "user"]
    assert users == ["What is the capital of France?", "Say hi\nin one word", "Line one\nline two"]
    assert saved["settings"]["temperature"] == 0 and saved["settings"]["max_tokens"] == 3
    history = (root / "state" / "mlxinfer" / "history").read_text()
    assert "+What is the capital of France?" in history and "+/retry" in history

    # Resume: the history is shown and the conversation continues; Ctrl-C stops a long reply.
    c = pty("chat", "--session", "trip", "--max-tokens", "300", *STREAMS_SLOWLY)
    c.expect(r"What is the capital of France\?")
    c.expect(r"Paris")
    c.expect(READY)
    c.command("/show", r"messages\s+6")
    c.send_line("Write a long story about a brave knight and a dragon.")
    c.expect(r"brave knight and a dragon\.")
    c.expect(r"…")  # the reply area is up (the prompt is done with the terminal)...
    c.expect(r"[A-Za-z]+[ ,]+[A-Za-z]+[ ,]+[A-Za-z]+[ ,]+[A-Za-z]+", timeout=60)  # ...and text streams
    t0 = time.monotonic()
    c.child.sendintr()
    c.expect(r"\[interrupted\]", timeout=20)
    stopped = c.expect(STATS + r".*interrupted")
    assert time.monotonic() - t0 < 10 and int(stopped["gen"]) < 300
    c.expect(READY)
    after = c.ask("What is the capital of France?")
    assert "Paris" in c.screen[: after.start()].split("What is the capital of France?")[-1]
    c.child.sendintr()  # at an empty prompt: says how to exit
    c.expect(r"Use Ctrl-D, /bye or /exit to quit\.")
    c.expect(READY)  # keys sent before the prompt is back would reach a terminal in line mode
    c.child.sendeof()
    assert c.wait_exit() == 0

    saved = json.loads((root / "data" / "mlxinfer" / "sessions" / "trip.json").read_text())  # autosaved
    assert saved["messages"][7]["interrupted"] is True and saved["messages"][7]["content"]
    assert saved["messages"][-1]["role"] == "assistant" and "Paris" in saved["messages"][-1]["content"]


def test_plain_mode_through_a_pipe(chat_env):
    script = ('What is the capital of France?\n/set nonsense 1\ncaf\xe9 au lait\n/set temp 0\n/\n'
              '"""\nWhat is the capital\nof France?\n"""\n').encode("latin-1")  # line 3 is not UTF-8
    out = subprocess.run(ENTRY + ["chat", "--temp", "0", "--max-tokens", "12"], input=script, env=chat_env,
                         capture_output=True, timeout=120)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    replies = stdout.strip().split("\n")
    assert len(replies) == 2 and all("Paris" in r for r in replies), stdout
    assert "mlxinfer chat" not in stdout and "tok/s" not in stdout  # only replies on stdout
    assert "unknown setting 'nonsense'" in stderr and "set temperature = 0" in stderr
    assert "error: line 3 of the input is not valid UTF-8 (skipped)" in stderr
    assert "error: a command name is missing after '/' (/help lists commands)" in stderr  # not sent to the model
    # The good lines ran; a script still learns that three did not.
    assert out.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last == "error: 3 of the piped messages and commands failed (see the errors above)"
    assert not re.search(r"\x1b\[", stdout)


def test_sigterm_and_sighup_in_the_terminal_save_and_exit(pty, chat_env):
    """In a terminal the reply streams with the keyboard in raw mode and the prompt is prompt-toolkit's: SIGTERM
    during a reply and SIGHUP at the prompt both save the session and exit 128+signum."""
    import signal

    path = Path(chat_env["_ROOT"]) / "data" / "mlxinfer" / "sessions" / "term-sig.json"
    c = pty("chat", "--session", "term-sig", "--temp", "0", "--max-tokens", "400", *STREAMS_SLOWLY)
    c.expect(READY)
    c.send_line("Write a long story about a brave knight and a dragon.")
    c.expect(r"…")
    c.expect(r"[A-Za-z]+[ ,]+[A-Za-z]+[ ,]+[A-Za-z]+[ ,]+[A-Za-z]+", timeout=60)
    c.child.kill(signal.SIGTERM)
    c.expect(r"terminated", timeout=30)
    assert c.wait_exit() == 143
    saved = json.loads(path.read_text())["messages"]
    assert saved[0]["content"] == "Write a long story about a brave knight and a dragon."
    assert saved[1]["interrupted"] is True and len(saved[1]["content"]) > 10

    c = pty("chat", "--session", "term-sig")
    c.expect(r"\[interrupted\]")  # the resumed history shows the cut reply
    c.expect(READY)
    c.command("/set temp 0.3", r"set temperature = 0\.3")
    c.child.kill(signal.SIGHUP)
    assert c.wait_exit() == 129
    data = json.loads(path.read_text())
    assert data["settings"]["temperature"] == 0.3 and len(data["messages"]) == 2
