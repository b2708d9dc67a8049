"""Slash commands: one table (name, arguments, help, handler, argument completions) drives /help, Tab
completion, dispatch and the "did you mean" suggestion for unknown commands."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..engine import store
from ..engine.prompts import template_system_prompt
from ..engine.session import KV_SETTINGS, SETTING_NAMES, THINK_MODES, Session
from ..errors import InvalidParameter

_COMMAND_RE = re.compile(r"^/[A-Za-z?]+(\s|$)")


@dataclass
class Command:
    name: str
    args: str
    help: str
    run: Callable
    complete: Callable[["object"], Iterable[str]] | None = None


def is_command(text: str) -> bool:
    # A lone "/" is a command started and not finished (it went to the model as a message): /help is the answer.
    return text.strip() == "/" or bool(_COMMAND_RE.match(text.strip()))


# ----- handlers: (app, arg) -> None | "exit" -----
def _help(app, arg):
    rows = [(f"{c.name} {c.args}".strip(), c.help) for c in COMMANDS]
    rows += [('"""', 'start and end a multi-line message (or Alt-Enter for a newline)'),
             ("Ctrl-C", "stop a reply (the partial reply is kept, marked interrupted)"),
             ("Ctrl-D", "exit")]
    app.view.table(rows, title="Commands")


def _clear(app, arg):
    app.session.clear()
    app.view.info("new conversation (history and cache cleared; system prompt and settings kept)")


def _system(app, arg):
    s = app.session
    if not arg:
        own = None if s.system else template_system_prompt(s.loaded)
        app.view.info(f"system prompt: {s.system}" if s.system else
                      f"no system prompt of yours; the chat template adds its own: {own} (/system TEXT replaces it)"
                      if own else "no system prompt (set one with /system TEXT)")
        return
    s.set_system(None if arg in ("none", "off", '""') else arg)
    app.view.info("system prompt set" if s.system else "system prompt removed")


def _set(app, arg):
    parts = arg.split(None, 1)
    if len(parts) != 2:
        _show_settings(app)
        app.view.info("usage: /set NAME VALUE, e.g. /set temp 0.7 (names: " + ", ".join(SETTING_NAMES) + ")")
        return
    name, value = parts[0].lower(), parts[1].strip()
    kv_before = app.session.kv
    field = app.session.set(name, value)  # validated against the model; unknown names get a suggestion
    if field in KV_SETTINGS:
        again = app.session.kv != kv_before and app.session.messages
        value = app.session.kv.as_dict()[field]
        app.view.info(f"set {field} = {value or 'off'}; KV cache: {kv_cache_line(app.session)}"
                      + (" (the conversation is prefilled again on the next message)" if again else ""))
        return
    shown = app.session.context_limit if field == "context" else app.session.think if field == "think" else \
        getattr(app.session.params, field)
    app.view.info(f"set {field} = {_shown(shown)}")  # as /show says
    used = app.session.context_used if field == "context" else 0
    if used > app.session.context_limit:  # (it said "context used 64/40 (160%)" until the next message)
        app.view.notice(f"the conversation takes {used} tokens, more than {app.session.context_limit}: the oldest "
                        "messages drop when you send the next one")


def _shown(value) -> str:
    """A setting's value as /show and /set print it: 2 (not 2.0), 0.7, random (no seed)."""
    if value is None:
        return "random"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _settings_rows(s: Session) -> list[tuple[str, str]]:
    rows = [(name, _shown(value)) for name, value in s.params.as_dict().items()]
    kv = [(name, "off" if value is None else str(value)) for name, value in s.kv.as_dict().items()
          if name in KV_SETTINGS]
    return rows + [("context", str(s.context_limit)), ("think", s.think)] + kv


def kv_cache_line(s: Session) -> str:
    """The KV cache as /show and the chat header say it, with what the custom kernels do about it."""
    from ..engine.kv_options import kernel_note

    note = kernel_note(s.loaded.model, s.kv)
    return note[len("KV cache "):] if note else s.kv.describe()


def _show_settings(app):
    app.view.table(_settings_rows(app.session), title="Settings")


def _show(app, arg):
    s, m = app.session, app.session.loaded
    app.view.table([
        ("name", m.name), ("source", m.spec.source_label()), ("architecture", m.model_type),
        ("parameters", m.spec.params or f"{m.num_parameters() / 1e6:,.0f}M"), ("quantization", m.quantization),
        ("backend", f"{m.backend} ({m.dtype})"), ("kernels", m.kernels), ("context limit", str(m.context_length)),
        ("KV cache", kv_cache_line(s)),
    ], title="Model")
    _show_settings(app)
    used = s.context_used
    app.view.table([
        ("system", s.system or _template_system_row(s)),
        ("messages", str(len(s.messages))),
        ("context used", f"{used}/{s.context_limit} tokens ({100 * used / s.context_limit:.1f}%)"),
        ("session", app.session_line()),
    ], title="Conversation")


def _template_system_row(s: Session) -> str:
    own = template_system_prompt(s.loaded)
    return f"(none; the chat template adds: {own})" if own else "(none)"


def _save(app, arg):
    if not arg:
        raise InvalidParameter("usage: /save NAME", hint="e.g. /save trip-plans")
    app.save(arg.strip())


def _load(app, arg):
    if not arg:
        raise InvalidParameter("usage: /load NAME", hint="/sessions lists saved sessions")
    name = arg.strip()
    data, lock = app.open_session(name)  # refused while another process has it open
    try:
        if lock is not app.lock:
            app.save_on_exit()  # with --session, the session being left keeps its last changes
        saved_model = data.get("model")
        if saved_model and saved_model != app.session.loaded.name:
            try:
                app.switch_model(saved_model)
            except Exception as e:  # noqa: BLE001 - keep chatting with the current model
                app.view.notice(f"could not load the session's model '{saved_model}' ({e}); "
                                f"keeping {app.session.loaded.name}")
        session = Session.from_dict(data, app.session.loaded)
    except BaseException:
        app.drop(lock)
        raise
    app.adopt(lock)
    app.session = session
    app.saved_state = session.to_dict()
    app.view.info(f"loaded session '{name}' ({len(app.session.messages)} messages)")
    app.show_history()


def _sessions(app, arg):
    infos = store.list_sessions()
    if not infos:
        app.view.info(f"no saved sessions yet (in {store.sessions_dir()}); save one with /save NAME")
        return
    def where(i):
        if i.open_in is None:
            return ""
        return " · open here" if i.open_in == os.getpid() else f" · open in pid {i.open_in}"

    rows = [(i.name, f"{i.messages} messages · {i.model} · "
                     f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(i.modified))}{where(i)}") for i in infos]
    app.view.table(rows, title=f"Saved sessions ({store.sessions_dir()})")


def _retry(app, arg):
    app.run_turn(app.session.retry)


def _undo(app, arg):
    removed = app.session.undo()
    if removed is None:
        app.view.info("nothing to undo")
        return
    text = removed["content"].replace("\n", " ")
    app.view.info(f"removed the last exchange (\"{text[:50]}{'…' if len(text) > 50 else ''}\"); "
                  f"context {app.session.context_used}/{app.session.context_limit}")


def _model(app, arg):
    if not arg:
        app.view.info(f"model: {app.session.loaded.name}; switch with /model ALIAS "
                      f"(aliases: {', '.join(_aliases(app))})")
        return
    if not app.switch_model(arg.strip()):
        app.view.info(f"already using {app.session.loaded.name}")
        return
    app.view.info(f"switched to {app.session.loaded.name}; the conversation continues "
                  f"({len(app.session.messages)} messages)")


def _clipboard_command() -> list[str] | None:
    candidates = [["pbcopy"], ["clip.exe"]]
    if os.environ.get("WAYLAND_DISPLAY"):
        candidates.insert(0, ["wl-copy"])
    if os.environ.get("DISPLAY"):
        candidates += [["xclip", "-selection", "clipboard"], ["xsel", "--clipboard", "--input"]]
    for cmd in candidates:
        if shutil.which(cmd[0]):
            return cmd
    return None


def _copy(app, arg):
    text = app.session.last_reply()
    if text is None:
        app.view.info("no reply to copy yet")
        return
    cmd = _clipboard_command()
    if cmd is None:
        app.view.notice("no clipboard here (needs pbcopy, wl-copy, xclip or xsel with a display); "
                        "the reply is in the scrollback above")
        return
    try:
        subprocess.run(cmd, input=text.encode(), check=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as e:
        app.view.error(f"copying failed ({cmd[0]}: {e})")
        return
    app.view.info(f"copied the last reply ({len(text)} characters) with {cmd[0]}")


def _think(app, arg):
    if not arg:
        app.view.info(f"think: {app.session.think} (on: shown dimmed · hide: not shown · off: ask the model "
                      "not to think)")
        return
    app.session.set_think(arg.strip().lower())
    app.view.info(f"think {app.session.think}")


def _stats(app, arg):
    arg = arg.strip().lower()
    if arg in ("on", "off"):
        app.show_stats = arg == "on"
    elif arg:
        raise InvalidParameter(f"invalid value {arg!r} for /stats", hint="use /stats on, /stats off or /stats")
    else:
        app.show_stats = not app.show_stats
    app.view.info(f"stats line {'on' if app.show_stats else 'off'}")


def _exit(app, arg):
    return "exit"


def _aliases(app) -> list[str]:
    from ..registry import Registry

    try:
        app.registry = app.registry or Registry.load()
        return app.registry.aliases()
    except Exception:  # noqa: BLE001 - completion must never fail the prompt
        return []


COMMANDS = [
    Command("/help", "", "show this help", _help),
    Command("/clear", "", "start a new conversation (history and cache reset)", _clear),
    Command("/system", "[TEXT]", "set the system prompt (show it with no text; none or off removes it)", _system),
    Command("/set", "NAME VALUE", "change a setting: " + ", ".join(SETTING_NAMES), _set,
            lambda app: SETTING_NAMES),
    Command("/show", "", "model info, settings and context use", _show),
    Command("/save", "NAME", "save this session", _save, lambda app: store.names()),
    Command("/load", "NAME", "load a saved session (messages, system, settings, model)", _load,
            lambda app: store.names()),
    Command("/sessions", "", "list saved sessions", _sessions),
    Command("/retry", "", "regenerate the last reply", _retry),
    Command("/undo", "", "drop the last exchange", _undo),
    Command("/model", "[ALIAS]", "switch model, keeping the conversation", _model, _aliases),
    Command("/copy", "", "copy the last reply to the clipboard", _copy),
    Command("/think", "on|off|hide", "show, hide or turn off <think> reasoning", _think, lambda app: THINK_MODES),
    Command("/stats", "[on|off]", "toggle the stats line after each reply", _stats, lambda app: ("on", "off")),
    Command("/exit", "", "quit", _exit),
    Command("/bye", "", "quit", _exit),
]
_BY_NAME = {c.name: c for c in COMMANDS}
_ALIASES = {"/?": "/help", "/quit": "/exit", "/regen": "/retry", "/reset": "/clear"}


def dispatch(app, text: str):
    name, _, arg = text.partition(" ")
    name = _ALIASES.get(name.lower(), name.lower())
    cmd = _BY_NAME.get(name)
    if cmd is None and name == "/":
        app.view.error("a command name is missing after '/' (/help lists commands)")
        return None
    if cmd is None:
        near = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.4)
        app.view.error(f"unknown command {name}" + (f" — did you mean {near[0]}?" if near else "")
                       + " (/help lists commands)")
        return None
    if not cmd.args and arg.strip():  # "/bye now" quit and "/clear all" cleared: a typo must not act silently
        app.view.error(f"{cmd.name} takes no argument (got {arg.strip()!r}); send {cmd.name} alone")
        return None
    return cmd.run(app, arg.strip())


def completer_for(app):
    from .chat_input import make_completer

    def arguments(cmd: str) -> Iterable[str]:
        c = _BY_NAME.get(cmd)
        return list(c.complete(app)) if c and c.complete else []

    return make_completer({c.name: c.help for c in COMMANDS}, arguments)
