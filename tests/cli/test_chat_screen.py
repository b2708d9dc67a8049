"""What a person sees: the chat in a real terminal emulator (tmux), screen and scrollback captured.

pexpect only sees the byte stream; a terminal shows whether the live reply region left stale copies behind
(e.g. after an echoed ^C shifted it by a line). Skipped where tmux is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from chat_pty import ENTRY, STREAMS_SLOWLY

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


def test_interrupted_reply_leaves_one_clean_copy_on_screen(chat_env, tmp_path):
    sock = str(tmp_path / "tmux.sock")
    env = {**chat_env, "TMUX": ""}
    for var in ("PROMPT_TOOLKIT_NO_CPR", "COLUMNS", "LINES"):  # tmux sets the size and answers size queries
        env.pop(var, None)
    cmd = " ".join(f"'{a}'" for a in ENTRY + ["chat", "--temp", "0", "--max-tokens", "200", *STREAMS_SLOWLY])

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-S", sock, *args], env=env, capture_output=True, text=True,
                              check=True).stdout

    def screen() -> str:
        return tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", "chat")

    def wait_for(text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = screen()
            if text in shown:
                return shown
            time.sleep(0.3)
        raise AssertionError(f"{text!r} never appeared; screen:\n{screen()}")

    tmux("new-session", "-d", "-s", "chat", "-x", "100", "-y", "30", cmd)
    try:
        wait_for("Send a message")
        tmux("send-keys", "-t", "chat", "Tell me a long story about a dragon.", "Enter")
        wait_for("about a dragon.")
        deadline = time.monotonic() + 60
        while len(screen().split("about a dragon.")[-1].split()) < 12 and time.monotonic() < deadline:
            time.sleep(0.3)  # until a dozen words of the reply are on screen
        tmux("send-keys", "-t", "chat", "-l", "Next quest")  # typed while the reply streams...
        time.sleep(0.5)
        tmux("send-keys", "-t", "chat", "C-c")
        wait_for("[interrupted]", timeout=20)
        shown = wait_for(">>> Next quest", timeout=20)  # ...is kept as the start of the next message
        reply = shown.split("about a dragon.")[-1].split("[interrupted]")[0]
        lines = [ln.strip() for ln in reply.splitlines() if ln.strip()]
        assert lines, shown
        assert len(lines) == len(set(lines)), f"a line of the reply shows twice:\n{shown}"
        assert "^C" not in shown and "Next quest" not in reply  # nothing was echoed into the reply
        assert shown.count("Tell me a long story about a dragon.") == 1
        after = shown.split("[interrupted]")[-1]
        assert "interrupted" in after and "tok/s" in after  # the stats line says how the reply ended
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], env=env, capture_output=True)
