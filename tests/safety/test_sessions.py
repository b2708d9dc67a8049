"""Sessions under concurrency and signals, with real processes: two chats on one --session never lose a turn (the
second is refused and offered --fork), /save and /load respect the same lock, a killed holder frees it, SIGTERM
and SIGHUP save the partial reply marked interrupted and exit 128+signum, and a failed reply leaves the chat
usable. The model is the tiny random llama with a byte-level tokenizer (loads in about a second)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import MLXINFER, assert_one_line_error, error_lines, run, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # chatty: greedy never ends the reply and every token is visible, so a reply streams for as long as needed
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", chatty=True, max_position_embeddings=65536)


@pytest.fixture
def env(tmp_path) -> dict:
    return {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "PYTHONUNBUFFERED": "1"}


def sessions(env) -> Path:
    return Path(env["XDG_DATA_HOME"]) / "mlxinfer" / "sessions"


def messages(env, name) -> list[dict]:
    return json.loads((sessions(env) / f"{name}.json").read_text())["messages"]


def wait_for(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def read_until(stream, needle: bytes, timeout=60.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, f"timed out waiting for {needle!r}: {seen[-500:]!r}"
        chunk = os.read(stream.fileno(), 4096)
        assert chunk, f"the stream ended before {needle!r}: {seen[-500:]!r}"
        seen += chunk
    return seen


class Chat:
    """A piped ``mlxinfer chat`` kept running: lines go in one at a time."""

    def __init__(self, *args, env, wrapper: str | None = None):
        cmd = [sys.executable, "-c", wrapper, *args] if wrapper else [*MLXINFER, "chat", *args]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, **env})

    def send(self, line: str) -> None:
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def finish(self, timeout=120) -> tuple[int, str, str]:
        out, err = self.p.communicate(timeout=timeout)
        return self.p.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        for stream in (self.p.stdin, self.p.stdout, self.p.stderr):
            stream.close()


@pytest.fixture
def chats():
    started: list[Chat] = []

    def start(*args, **kw) -> Chat:
        c = Chat(*args, **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.kill()


FLAGS = ("--temp", "0", "--max-tokens", "6")


def test_second_chat_on_a_session_is_refused_and_forks(tiny, env, chats):
    first = chats(str(tiny), "--session", "notes", *FLAGS, env=env)
    first.send("first question")
    wait_for(lambda: len(messages(env, "notes")) == 2, what="the first reply to be saved")

    busy = run("chat", str(tiny), "--session", "notes", *FLAGS, env=env, input="lost question\n")
    line = assert_one_line_error(busy, "session 'notes' is open in another mlxinfer", f"pid {first.p.pid}",
                                 "--session notes --fork")
    assert len(messages(env, "notes")) == 2, line  # nothing written by the refused chat

    fork = run("chat", str(tiny), "--session", "notes", "--fork", "notes-2", *FLAGS, env=env,
               input="forked question\n")
    assert fork.returncode == 0, fork.stderr
    assert "continuing a copy of session 'notes' as 'notes-2'" in fork.stderr
    forked = messages(env, "notes-2")
    assert [m["content"] for m in forked[::2]] == ["first question", "forked question"]

    first.send("third question")
    code, _, err = first.finish()
    assert code == 0, err
    kept = messages(env, "notes")
    assert [m["content"] for m in kept[::2]] == ["first question", "third question"]  # no turn lost
    assert not list(sessions(env).glob(".*.tmp")) and not (sessions(env) / ".notes.lock").exists()

    again = run("chat", str(tiny), "--session", "notes", *FLAGS, env=env, input="/show\nfourth\n")
    assert again.returncode == 0, again.stderr
    assert len(messages(env, "notes")) == 6
    used = re.search(r"context used\s+(\d+)/65536 tokens", again.stderr)
    assert used and int(used[1]) > 30, again.stderr  # issue #16: a resumed session said 0 before its first turn


def test_save_and_load_inside_chat_respect_the_lock(tiny, env, chats):
    holder = chats(str(tiny), "--session", "busy", *FLAGS, env=env)
    holder.send("mine")
    wait_for(lambda: len(messages(env, "busy")) == 2, what="the holder's reply")
    before = (sessions(env) / "busy.json").read_bytes()

    other = run("chat", str(tiny), *FLAGS, env=env,
                input="/load busy\nhello\n/save busy\n/save elsewhere\n/sessions\n")
    assert other.returncode == 2, other.stderr  # the chat went on; the exit status says that two lines failed
    errors = [line for line in error_lines(other) if line.startswith("error:")]
    assert errors.pop() == "error: 2 of the piped messages and commands failed (see the errors above)"
    assert len(errors) == 2, errors
    assert all(f"session 'busy' is open in another mlxinfer (pid {holder.p.pid})" in e for e in errors)
    assert (sessions(env) / "busy.json").read_bytes() == before
    assert len(messages(env, "elsewhere")) == 2
    assert "busy" in other.stderr and f"open in pid {holder.p.pid}" in other.stderr  # /sessions says who


def test_a_killed_holder_frees_the_session(tiny, env, chats):
    holder = chats(str(tiny), "--session", "crash", *FLAGS, env=env)
    holder.send("before the crash")
    wait_for(lambda: len(messages(env, "crash")) == 2, what="the reply")
    holder.p.send_signal(signal.SIGKILL)
    holder.p.wait(timeout=30)
    after = run("chat", str(tiny), "--session", "crash", *FLAGS, env=env, input="after the crash\n")
    assert after.returncode == 0, after.stderr
    assert [m["content"] for m in messages(env, "crash")[::2]] == ["before the crash", "after the crash"]


@pytest.fixture(scope="module")
def saved_pair(tiny, tmp_path_factory) -> Path:
    """Two sessions, 'src' and 'taken', saved once by real chats; each test gets a copy."""
    data = tmp_path_factory.mktemp("pair")
    env = {"XDG_DATA_HOME": str(data / "data"), "XDG_STATE_HOME": str(data / "state"), "PYTHONUNBUFFERED": "1"}
    for name in ("src", "taken"):
        r = run("chat", str(tiny), "--session", name, *FLAGS, env=env, input="hi\n")
        assert r.returncode == 0, r.stderr
    return sessions(env)


@pytest.mark.parametrize("args, needles", [
    (("--fork", "x"), ("--fork needs --session",)),
    (("--session", "src", "--fork", "src"), ("--fork needs a new name",)),
    (("--session", "src", "--fork", "taken"), ("session 'taken' already exists", "--session taken")),
    (("--session", "missing", "--fork", "new"), ("no saved session 'missing'",)),
    (("--session", "src", "--fork", "../evil"), ("invalid session name",)),
])
def test_fork_refusals(tiny, saved_pair, env, args, needles):
    shutil.copytree(saved_pair, sessions(env))
    before = {p.name: p.read_bytes() for p in sessions(env).iterdir()}
    # The flags are refused before the session is touched: the test process stands in for the CLI's.
    assert_one_line_error(run_in_process("chat", str(tiny), *args, *FLAGS, env=env, input="hi\n"), *needles)
    assert {p.name: p.read_bytes() for p in sessions(env).iterdir()} == before


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_signal_while_a_reply_streams_saves_it_marked_interrupted(tiny, env, chats, signame):
    signum = getattr(signal, signame)
    c = chats(str(tiny), "--session", "sig", "--temp", "0", "--max-tokens", "30000", env=env)
    c.send("tell me everything")
    streamed = b""
    while len(streamed) < 40:  # the reply is streaming now
        chunk = os.read(c.p.stdout.fileno(), 4096)
        assert chunk, "the chat ended before the reply streamed"
        streamed += chunk
    c.p.send_signal(signum)
    code, out, err = c.finish(timeout=60)
    assert code == 128 + signum, err
    assert "Traceback" not in err and "terminated" in err
    saved = messages(env, "sig")
    assert saved[0] == {"role": "user", "content": "tell me everything"}
    reply = saved[1]
    assert reply["role"] == "assistant" and reply.get("interrupted") is True
    assert len(reply["content"]) >= 20  # what had streamed is in the saved reply
    text = (streamed + out.encode()).decode("utf-8", "replace")
    assert reply["content"][:10].encode("utf-8", "replace") and reply["content"][:10] in text
    assert not list(sessions(env).glob(".*.tmp"))


def test_sigterm_at_the_prompt_saves_and_exits_143(tiny, env, chats):
    c = chats(str(tiny), "--session", "idle", *FLAGS, env=env)
    c.send("hello")
    wait_for(lambda: len(messages(env, "idle")) == 2, what="the reply")
    c.send("/set temp 0.4")
    read_until(c.p.stderr, b"set temperature = 0.4")  # the chat is back at its prompt, reading stdin
    c.p.send_signal(signal.SIGTERM)
    code, _, err = c.finish(timeout=60)
    assert code == 143, err
    data = json.loads((sessions(env) / "idle.json").read_text())
    assert data["settings"]["temperature"] == 0.4 and len(data["messages"]) == 2


FAIL_ONCE = """
import sys
import mlxinfer.engine.steps as steps
real, calls = steps.token_steps, []

def flaky(*args, **kwargs):
    calls.append(1)
    for i, token in enumerate(real(*args, **kwargs)):
        if len(calls) == 1 and i == 3:  # the first reply fails after three tokens
            raise RuntimeError("injected failure\\nsecond line of an MLX-style message\\nhttps://example")
        yield token

steps.token_steps = flaky
from mlxinfer.cli.main import entry
entry()
"""


def test_a_failed_reply_is_an_error_line_and_the_next_message_works(tiny, env, chats):
    c = chats("chat", str(tiny), "--session", "fail", *FLAGS, env=env, wrapper=FAIL_ONCE)
    c.send("first message")
    c.send("second message")
    code, out, err = c.finish()
    assert code == 2, err  # the next message worked; the exit status still says that one failed
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == "error: 1 of the piped messages and commands failed (see the errors above)"
    failed = [line for line in lines if "generation failed" in line]
    assert failed == ["error: generation failed: RuntimeError: injected failure (the message was not kept; "
                      "Up arrow brings it back)"], lines
    assert "[interrupted]" not in err and "stopped before the reply began" not in err and "Traceback" not in err
    assert "second line" not in err
    assert [m["content"] for m in messages(env, "fail")[::2]] == ["second message"]
    assert not messages(env, "fail")[1].get("interrupted")
