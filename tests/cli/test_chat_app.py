"""The chat loop and slash commands with scripted input (no terminal), plus the pure rendering/input helpers."""

from __future__ import annotations

import io

import pytest

from mlxinfer.ui.chat_input import LineReader, make_completer, open_block, strip_block
from mlxinfer.ui.chat_view import PlainReply, reply_renderable, split_think


class Script:
    """A reader that plays lines, then raises EOFError (Ctrl-D)."""

    def __init__(self, lines):
        self.lines = list(lines)

    def read(self):
        if not self.lines:
            raise EOFError
        item = self.lines.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        pass


@pytest.fixture
def run_chat(smollm2, monkeypatch, tmp_path):
    from mlxinfer.engine.sampling import SamplingParams
    from mlxinfer.engine.session import Session
    from mlxinfer.ui.chat_loop import ChatApp
    from mlxinfer.ui.chat_view import PlainView

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no clipboard tools
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)

    def run(lines, **kw):
        out, err = io.StringIO(), io.StringIO()
        session = Session(smollm2, SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8)))
        loads = []
        app = ChatApp(session, PlainView(out, err), Script(lines), show_stats=True,
                      load_model=lambda spec, kernels: loads.append(spec.name) or smollm2, **kw)
        app.run()
        return app, out.getvalue(), err.getvalue(), loads

    return run


@pytest.mark.slow
def test_commands_through_the_loop(run_chat, smollm2_dir):
    app, out, err, loads = run_chat([
        "/help", "/system Answer in one short sentence.", "/system", "What is the capital of France?",
        "/think hide", "/think maybe", "/stats off", "/stats", "/stats loud", "/copy",
        "/model smollm2", f"/model {smollm2_dir}", "/show", "/sessions", "/load nothing-here", "/save", "/retry",
        KeyboardInterrupt(), "/clear", "/undo", "/retry", "/exit", "never read",
    ])
    assert "Paris" in out and out.count("Paris") == 2  # the reply and its /retry
    assert "/model [ALIAS]" in err and "switch model" in err
    assert "system prompt: Answer in one short sentence." in err
    assert "think hide" in err and "invalid think mode 'maybe'" in err
    assert "stats line off" in err and "stats line on" in err and "invalid value 'loud' for /stats" in err
    assert "no clipboard here" in err
    assert "already using smollm2" in err  # the model in use is not loaded again
    assert loads == [str(smollm2_dir)] and "switched to smollm2; the conversation continues (2 messages)" in err
    assert "messages      2" in err  # /show after the switch: the conversation was kept
    assert "no saved sessions yet" in err and "no saved session 'nothing-here'" in err
    assert "usage: /save NAME" in err
    assert "Use Ctrl-D, /bye or /exit to quit." in err
    assert "nothing to undo" in err and "nothing to retry yet" in err
    assert app.session.messages == [] and app.session.system == "Answer in one short sentence."
    assert err.count("TTFT") == 2  # a stats line after the reply and after the /retry (toggled back on)


@pytest.mark.slow
def test_context_overflow_notice_and_long_message(run_chat):
    lines = ["/set context 80"] + [f"Name a color, number {i}." for i in range(3)] + ["word " * 100]
    app, out, err, _ = run_chat(lines, max_tokens=10)
    assert "context full: dropped the 2 oldest messages" in err  # one exchange: the first
    assert "the message takes" in err and "no room for a reply in a 80-token context" in err
    # The refused message cost nothing: the exchanges left before it are still there.
    assert [m["content"] for m in app.session.messages[::2]] == ["Name a color, number 1.", "Name a color, number 2."]
    assert len(out.strip().split("\n")) >= 3 and app.session.context_used <= 80


def test_a_command_that_takes_no_argument_refuses_one(run_chat):
    """"/bye now" quit and "/clear all" cleared: a typo acted silently."""
    app, out, err, _ = run_chat(["Say hi.", "/clear all", "/bye now", "/show"], max_tokens=3)
    assert "error: /clear takes no argument (got 'all'); send /clear alone" in err
    assert "error: /bye takes no argument (got 'now'); send /bye alone" in err
    assert len(app.session.messages) == 2  # not cleared, and the chat went on to /show
    assert "messages" in err


def test_split_think():
    assert split_think("plain answer") == (None, "plain answer", False)
    assert split_think("<think>hmm") == ("hmm", "", True)
    assert split_think("<think>a b</think>\n\nAnswer") == ("a b", "Answer", False)
    assert split_think("reasoning</think>Answer") == ("reasoning", "Answer", False)  # opened by the template


def test_plain_reply_hides_thinking_while_streaming():
    out = io.StringIO()
    r = PlainReply(out, "hide")
    for piece in ["<th", "ink>secret ", "plan</thi", "nk>\n\nThe ", "answer."]:
        r.feed(piece)
    r.finish()
    assert out.getvalue() == "The answer.\n"
    out = io.StringIO()
    r = PlainReply(out, "on")
    r.feed("<think>x</think>y")
    r.finish()
    assert out.getvalue() == "<think>x</think>y\n"


def test_reply_renderable_hides_or_dims_thinking():
    from rich.console import Console

    def text(reply, mode):
        c = Console(width=80, record=True, color_system=None)
        c.print(reply_renderable(reply, mode))
        return c.export_text()

    assert "secret" in text("<think>secret</think>**Bold** answer", "on")
    hidden = text("<think>secret plan</think>**Bold** answer", "hide")
    assert "secret" not in hidden and "thought for 2 words" in hidden and "Bold answer" in hidden


def test_triple_quote_blocks_and_line_reader():
    assert open_block('"""') and open_block('"""\nline') and not open_block('"""\nline"""')
    assert not open_block('"""one line"""') and not open_block("plain")
    assert strip_block('"""\nSay hi\nin French\n"""') == "Say hi\nin French"
    reader = LineReader(io.StringIO('first\n"""\na\nb\n"""\nlast\n'))
    assert [reader.read(), reader.read(), reader.read()] == ["first", "a\nb", "last"]
    with pytest.raises(EOFError):
        reader.read()


def test_completion_of_commands_and_arguments():
    from prompt_toolkit.document import Document

    comp = make_completer({"/set": "change", "/sessions": "list", "/save": "save"},
                          lambda cmd: {"/set": ["temp", "top_p"], "/save": ["notes"]}.get(cmd, []))

    def texts(line):
        return [c.text for c in comp.get_completions(Document(line), None)]

    assert texts("/se") == ["/set", "/sessions"]
    assert texts("/set t") == ["temp", "top_p"]
    assert texts("/save n") == ["notes"]
    assert texts("hello") == [] and texts("/set temp 0") == []


def test_a_save_is_not_cut_by_sigterm():
    """SIGTERM during a session write waits for the write, then ends the chat as it would have (Terminated)."""
    import os
    import signal

    from mlxinfer.errors import Terminated
    from mlxinfer.ui.chat_loop import _termination_held

    def raise_terminated(signum, _frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    steps = []
    try:
        with pytest.raises(Terminated) as e:
            with _termination_held():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # bytecodes run: an unheld signal would be handled here
                    pass
                steps.append("written")
        assert steps == ["written"] and e.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is raise_terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_model_switch_frees_the_old_model(monkeypatch, tmp_path, smollm2_dir):
    """The chat command's own frame kept the first model alive: after /model the header said 187.6 MB in use for
    a 93.8 MB model, and a large model would have stayed twice in memory."""
    import gc
    import io
    import weakref

    from mlxinfer.cli.main import main
    from mlxinfer.ui import chat_loop

    for var in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var))
    freed = []
    switch = chat_loop.ChatApp.switch_model

    def watched(self, arg):
        old = weakref.ref(self.session.loaded.model)
        switch(self, arg)
        gc.collect()
        freed.append(old() is None)

    monkeypatch.setattr(chat_loop.ChatApp, "switch_model", watched)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/model {smollm2_dir}\n"))  # (not the alias in use: a no-op)
    assert main(["chat", "--temp", "0", "-n", "3"]) == 0
    assert freed == [True]


def test_set_speaks_as_show_does(run_chat):
    """/show lists think with the settings, but /set think off was an unknown setting; /set temp 2 said 2.0 where
    /show says 2; the max_kv_size range came with two brackets in a row."""
    app, out, err, loads = run_chat(["/set think off", "/set temp 2", "/set max_kv_size 2", "/show", "/exit"])
    assert "set think = off" in err and app.session.think == "off"
    assert "set temperature = 2\n" in err and "set temperature = 2.0" not in err
    assert "must be between 32 and 8192, the model's context (leave it off" in err


def test_show_and_system_say_the_system_prompt_the_template_adds(run_chat):
    """SmolLM2's template writes "You are a helpful AI assistant named SmolLM..." when the chat has no system
    prompt: /show said "system (none)", and a message too long for /set context said to shorten a system prompt
    the user never set."""
    own = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    app, out, err, loads = run_chat(["/system", "/show", "/set context 32",
                                     "hello there, how are you doing today my friend? tell me", "/system Hi.",
                                     "/show", "/exit"])
    assert f"no system prompt of yours; the chat template adds its own: {own} (/system TEXT replaces it)" in err
    assert f"system        (none; the chat template adds: {own})" in err
    assert "replace the chat template's own system prompt with a shorter /system TEXT" in err
    assert "system        Hi." in err


def test_show_says_whether_the_named_session_holds_what_is_on_screen(run_chat):
    """After /save NAME in a plain chat, /show said "session NAME" while later messages were in no file; a
    --session chat saves after every reply."""
    app, out, err, loads = run_chat(["/show", "/save notes", "/show", "Say hi.", "/show", "/load notes", "/show",
                                     "/exit"], max_tokens=3)
    rows = [line for line in err.splitlines() if line.startswith("  session ")]
    assert [r.split(None, 1)[1] for r in rows] == [
        "(not saved; /save NAME)", "notes (saved)", "notes (changed since saved; /save notes keeps the changes)",
        "notes (saved)"]
    app, out, err, loads = run_chat(["/save notes3", "Say hi.", "/show", "/exit"], max_tokens=3, autosave=True,
                                    session_name="notes2")
    assert "  session       notes3 (saved after every reply)" in err
    assert "this chat now saves to 'notes3' after every reply; 'notes2' keeps what it had" in err


def test_save_says_what_it_replaced_and_set_context_what_will_drop(run_chat):
    """/save NAME over another saved session replaced it without a word; /set context 40 under a 64-token
    conversation left /show at 160% with nothing said until the next message dropped half of it (chat audit)."""
    app, out, err, loads = run_chat(["Say hi.", "/save first", "/exit"], max_tokens=3)
    app.release()  # (the chat's lock on the session: a chat that ends lets go of it)
    app, out, err, loads = run_chat(["/save first", "/save first", "Say hi.", "And again.", "/set context 40",
                                     "/exit"], max_tokens=3)
    assert "saved session 'first' (0 messages)" in err
    assert err.count("it replaced the session of that name (2 messages)") == 1  # not when saving it again
    assert "more than 40: the oldest messages drop when you send the next one" in err
