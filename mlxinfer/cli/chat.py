"""``mlxinfer chat [MODEL]``: the interactive chat (also what ``mlxinfer`` with no command starts).

Settings come from, lowest first: the model's registry defaults, a resumed session (``--session``), the flags.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from . import options as o

Context = Annotated[
    Optional[int], typer.Option("--context", "-c", help="Context limit in tokens (default: the model's).")
]
SessionName = Annotated[
    Optional[str],
    typer.Option("--session", help="Resume the saved session NAME (or start it); it is saved after every reply."),
]
Plain = Annotated[bool, typer.Option("--plain", help="No UI: read messages from stdin line by line, print replies.")]
Think = Annotated[Optional[str], typer.Option("--think", help="Reasoning blocks: on (dimmed), hide, or off.")]


def chat(
    model: o.Model = None,
    system: o.System = None,
    temp: o.Temp = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    min_p: o.MinP = None,
    repeat_penalty: o.RepeatPenalty = None,
    max_tokens: o.MaxTokens = None,
    seed: o.Seed = None,
    context: Context = None,
    session: SessionName = None,
    plain: Plain = False,
    think: Think = None,
    kernels: o.Kernels = "auto",
):
    """Chat with a model in the terminal (default: the bundled smollm2)."""
    from ..engine import store
    from ..engine.session import Session
    from ..registry import Registry
    from ..ui.chat_commands import completer_for
    from ..ui.chat_loop import ChatApp, make_reader, make_view
    from ..ui.progress import load_model

    plain = plain or bool(os.environ.get("NO_COLOR")) or not (sys.stdin.isatty() and sys.stdout.isatty())
    saved = None
    if session:
        store.check_name(session)
        if session in store.names():
            saved = store.load(session)
    registry = Registry.load()
    spec = registry.resolve(model or (saved or {}).get("model"))
    loaded = load_model(spec, kernels=kernels)

    flags = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
                 max_tokens=max_tokens, seed=seed)
    if saved is not None:
        chat_session = Session.from_dict(saved, loaded)
        chat_session.params = o.sampling_from(chat_session.params.as_dict(), **flags)
        if system is not None:
            chat_session.system = system or None
    else:
        params = o.sampling_from(spec.defaults, **flags)
        chat_session = Session(loaded, params, system=system if system is not None else spec.defaults.get("system"))
    if context is not None:
        chat_session.set_context(context)
    if think is not None:
        chat_session.set_think(think)

    app = ChatApp(chat_session, make_view(plain), None, kernels=kernels, show_stats=not plain,
                  session_name=session, autosave=session is not None, registry=registry)
    app.reader = make_reader(plain, completer=None if plain else completer_for(app))
    if session and saved is None:
        app.view.notice(f"new session '{session}' (saved after every reply)")
    app.run()


def register(app: typer.Typer) -> None:
    app.command("chat", help="Chat with a model in the terminal (default: the bundled smollm2).")(chat)
