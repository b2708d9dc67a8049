"""``mlxinfer chat [MODEL]``: the interactive chat (also what ``mlxinfer`` with no command starts).

Settings come from, lowest first: the model's registry defaults, a resumed session (``--session``), the flags
(``engine.settings.resolve``), then checked against the model. A ``--session`` is held by one chat at a time
(a lock beside its file, see ``engine.store``); ``--fork NEW`` continues a copy under another name.
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
    typer.Option("--session", help="Resume the saved session NAME (or start it); it is saved after every reply. "
                 "One chat at a time holds a session: while it is open, another chat on it is refused "
                 "(continue a copy with --fork NEW)."),
]
Fork = Annotated[
    Optional[str],
    typer.Option("--fork", metavar="NEW", help="With --session NAME: copy the saved session NAME to the new "
                 "session NEW and continue there (NAME is left as it is, even while another chat has it open)."),
]
Plain = Annotated[bool, typer.Option("--plain", help="No UI: read messages from stdin line by line, print replies.")]
Think = Annotated[Optional[str], typer.Option("--think", help="Reasoning blocks: on (dimmed), hide, or off.")]
Pipeline = Annotated[bool, typer.Option("--pipeline", help="Under mlx.launch: split the layers into stages "
                                        "(pipeline parallel) instead of tensor parallel.")]


def _open_session(session: str | None, fork: str | None):
    """(lock, saved data or None, the name to save under). Locks before reading, so what is read is current."""
    from ..engine import store
    from ..errors import InvalidParameter

    if fork is not None and not session:
        raise InvalidParameter("--fork needs --session NAME, the saved session to copy",
                               hint="e.g. --session notes --fork notes-2")
    if session is not None and not session.strip():  # --session '' was taken as no session: nothing was saved
        raise InvalidParameter("--session needs a name", hint="e.g. --session notes")
    if not session:
        return None, None, None
    store.check_name(session)
    if fork is None:
        lock = store.SessionLock.acquire(session)
        try:
            return lock, (store.load(session) if session in store.names() else None), session
        except BaseException:
            lock.release()
            raise
    store.check_name(fork)
    if fork == session:
        raise InvalidParameter("--fork needs a new name, not the session's own",
                               hint=f"e.g. --session {session} --fork {session}-2")
    saved = store.load(session)  # atomic saves: a consistent copy even while another chat writes it
    lock = store.SessionLock.acquire(fork, hint="choose another name for --fork")
    if fork in store.names():
        lock.release()
        raise store.SessionError(f"session '{fork}' already exists",
                                 hint=f"choose another name for --fork, or resume it with --session {fork}")
    return lock, saved, fork


def _model_spec(registry, model, saved, name):
    """The model to chat with: MODEL, else the one the resumed session names (said to come from the session when
    it cannot be found: 'unknown model' alone pointed at something the user never typed)."""
    from ..errors import MlxinferError

    if model or not (saved or {}).get("model"):
        return registry.resolve(model)
    try:
        return registry.resolve(saved["model"])
    except MlxinferError as e:
        raise type(e)(f"session '{name}' was saved with the model {saved['model']!r}: {e.args[0]}",
                      hint=f"give a model to use instead: mlxinfer chat MODEL --session {name}") from None


def _params(spec, saved, session, loaded, flags):
    from ..errors import InvalidParameter

    try:
        return o.sampling_from(spec.defaults, (saved or {}).get("settings"), loaded=loaded, **flags)
    except InvalidParameter as e:
        if saved is None:
            raise
        o.sampling_from(spec.defaults, None, loaded=loaded, **flags)  # raises if the cause is not the session
        raise InvalidParameter(str(e), hint=f"saved in session '{session}'; a flag overrides it") from None


def _kv(spec, saved, session, loaded, kv_flags):
    """The KV-cache options by the same precedence as the sampling settings (registry < session < flags)."""
    from ..engine.settings import resolve_kv
    from ..errors import InvalidParameter

    settings = (saved or {}).get("settings")
    try:
        return resolve_kv(spec.defaults, settings if isinstance(settings, dict) else None, kv_flags, loaded=loaded)
    except (InvalidParameter, TypeError) as e:
        if saved is None:
            raise
        resolve_kv(spec.defaults, None, kv_flags, loaded=loaded)  # raises if the cause is not the session
        raise InvalidParameter(f"invalid KV-cache settings: {e}",
                               hint=f"saved in session '{session}'; --kv-bits / --max-kv-size override it") from None


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
    kv_bits: o.KvBits = None,
    max_kv_size: o.MaxKvSize = None,
    context: Context = None,
    session: SessionName = None,
    fork: Fork = None,
    plain: Plain = False,
    think: Think = None,
    kernels: o.Kernels = "auto",
    pipeline: Pipeline = False,
):
    """Chat with a model in the terminal (default: the bundled smollm2)."""
    from ..engine.session import Session
    from ..registry import Registry
    from ..ui.chat_commands import completer_for
    from ..ui.chat_loop import ChatApp, make_reader, make_view
    from ..ui.progress import load_model

    plain = plain or bool(os.environ.get("NO_COLOR")) or not (sys.stdin.isatty() and sys.stdout.isatty())
    flags = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
                 max_tokens=max_tokens, seed=seed)
    kv_flags = dict(kv_bits=kv_bits, max_kv_size=max_kv_size)
    o.sampling_from(None, **flags)  # a bad flag fails before anything is locked or loaded
    from ..engine.settings import resolve_kv

    resolve_kv(None, None, kv_flags)
    from ..distributed import enter

    world = enter(pipeline)
    if world is not None and session:
        from ..errors import InvalidParameter

        raise InvalidParameter("--session is not available under mlx.launch (every rank would need the file)",
                               hint="chat without --session; /save NAME on rank 0 still saves")
    lock, saved, name = _open_session(session, fork)
    app = None
    try:
        registry = Registry.load()
        spec = _model_spec(registry, model, saved, name)
        loaded = load_model(spec, kernels=kernels)
        params = _params(spec, saved, session, loaded, flags)
        kv = _kv(spec, saved, session, loaded, kv_flags)
        if saved is not None:
            chat_session = Session.from_dict(saved, loaded, params=params, kv=kv)
            if system is not None:
                chat_session.system = system or None
        else:
            chat_session = Session(loaded, params, kv=kv,
                                   system=system if system is not None else spec.defaults.get("system"))
        if context is not None:
            chat_session.set_context(context)
        if think is not None:
            chat_session.set_think(think)

        app = ChatApp(chat_session, make_view(plain), None, kernels=kernels, show_stats=not plain,
                      session_name=name, autosave=name is not None, registry=registry, lock=lock)
        # The session holds the model from here: this frame's names would keep it alive after /model switches
        # (the old model's memory stayed in use: 187.6 MB for a 93.8 MB model).
        del loaded, chat_session
        app.reader = make_reader(plain, completer=None if plain else completer_for(app))
        if world is not None:  # rank 0 reads and broadcasts each line; the others run the same lines
            from ..distributed import describe, follow

            app.world = world
            follow.coordinate_ctrl_c()  # Ctrl-C on rank 0 stops the reply on every rank at the same token
            app.reader = follow.LeaderReader(app.reader) if world.leader else follow.FollowerReader()
            app.view.notice(f"distributed: {describe(world)}")  # as generate, bench and serve say it
        if fork is not None:
            if app.save(name, quiet=True):
                app.view.notice(f"continuing a copy of session '{session}' as '{name}' (saved after every reply)")
        elif session and saved is None:
            app.view.notice(f"new session '{session}' (saved after every reply)")
        app.run()
        failed = getattr(app.view, "errors", 0)
        if failed and not sys.stdin.isatty():
            from ..errors import MlxinferError

            raise MlxinferError(f"{failed} of the piped messages and commands failed (see the errors above)")
    finally:
        if app is not None:
            app.release()
        elif lock is not None:
            lock.release()


def register(app: typer.Typer) -> None:
    app.command("chat", help="Chat with a model in the terminal (default: the bundled smollm2).")(chat)
