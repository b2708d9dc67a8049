"""The chat loop: read a line, run a slash command or a turn, show the reply and its stats.

Ctrl-C during a reply asks the turn to stop at the next token (the partial reply stays in the history, marked
interrupted, and the cache is re-synced). In a terminal it is read as a key between tokens (see chat_view's
_KeyWatch); elsewhere it arrives as SIGINT, where a second one interrupts at once (the cache is then rebuilt on
the next turn). Ctrl-C at the prompt tells how to exit; Ctrl-D exits. SIGTERM/SIGHUP (``Terminated``) end the chat
instead: the partial reply is kept (marked interrupted), the session saved, and the exception goes on up.
A failed reply (an error inside generation) is shown as one error line; the session is as it was before it.
"""

from __future__ import annotations

import gc
import signal
import sys
from contextlib import contextmanager
from typing import Callable

from ..engine.session import Session, Turn
from ..errors import MlxinferError, Terminated
from .chat_input import next_entry
from .chat_view import PlainView, RichView


@contextmanager
def _cancel_on_sigint(turn: Turn):
    """First SIGINT cancels the turn gently; the default handler comes back for a second one."""
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:  # not the main thread: no handler changes
        yield
        return

    def handler(signum, frame):
        turn.cancel()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _termination_held():
    """SIGTERM/SIGHUP wait while a session file is written, then arrive as usual (and end the chat). Python
    handlers, not a signal mask: with MLX's threads running, a masked main thread would not keep the signal
    from being noted and handled in the middle of the write."""
    pending: list[int] = []
    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    try:
        old = {sig: signal.signal(sig, lambda signum, _frame: pending.append(signum)) for sig in sigs}
    except ValueError:  # not the main thread: handlers cannot change here
        yield
        return
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if pending:
            signal.raise_signal(pending[0])


def failure_line(e: BaseException) -> str:
    """One line for an exception: MLX errors run over several lines and name a URL after the first."""
    first = (str(e).strip().splitlines() or [""])[0].strip()
    if isinstance(e, MlxinferError):
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class ChatApp:
    """Owns the session, the view and the reader; slash commands (chat_commands) act on it."""

    def __init__(self, session: Session, view: RichView | PlainView, reader, *, kernels: str = "auto",
                 show_stats: bool = True, session_name: str | None = None, autosave: bool = False,
                 registry=None, load_model: Callable | None = None, lock=None):
        self.session, self.view, self.reader = session, view, reader
        self.kernels = kernels
        self.show_stats = show_stats
        self.session_name = session_name   # the name /save used last or --session gave
        self.autosave = autosave           # --session NAME: save after every reply
        self.lock = lock                   # store.SessionLock of session_name: no other process writes it
        self.registry = registry
        self._load_model = load_model
        self.typed_ahead = ""              # keys typed while the last reply streamed (Enter included), not read yet
        self.world = None                  # under mlx.launch (mlxinfer.distributed.World): rank 0 leads, others follow
        self._window_told = False          # --max-kv-size: said once that the window is full and rotates
        self.saved_state: dict | None = None  # the session as last saved or loaded (what /show compares with)

    # ----- models -----
    def switch_model(self, arg: str) -> bool:
        """Load ``arg`` and go on with it; False (nothing done) when it is the model in use."""
        from ..registry import Registry
        from .progress import load_model

        self.registry = self.registry or Registry.load()
        spec = self.registry.resolve(arg)
        if spec == self.session.loaded.spec:  # it was hashed, loaded and the header drawn again
            return False
        loaded = (self._load_model or load_model)(spec, kernels=self.kernels)
        old = self.session.loaded
        self.session.switch_model(loaded)
        del old
        gc.collect()
        try:
            import mlx.core as mx

            mx.clear_cache()
        except Exception:  # noqa: BLE001 - freeing memory is best effort
            pass
        self.view.header(loaded, self.session)
        return True

    # ----- turns -----
    def run_turn(self, start: Callable[[], Turn]) -> Turn | None:
        try:
            turn = start()
        except MlxinferError as e:
            self.view.error(str(e))
            return None
        except Exception as e:  # noqa: BLE001 - e.g. the template failing: the messages are as they were
            self.view.error(f"generation failed: {failure_line(e)}")
            return None
        s = self.session
        if turn.dropped:
            self.view.notice(f"context full: dropped the {turn.dropped} oldest messages to stay within "
                             f"{s.context_limit} tokens (the system prompt is kept)")
        reply = self.view.reply(s.think)

        def on_prefill(done: int, total: int) -> None:
            reply.prefill(done, total)
            if reply.pressed_ctrl_c():
                turn.cancel()

        turn.on_prefill = on_prefill
        it = iter(turn)
        failure = terminated = None
        try:
            with _cancel_on_sigint(turn):
                for r in it:
                    reply.feed(r.text)
                    if reply.pressed_ctrl_c():
                        turn.cancel()
        except Terminated as e:  # SIGTERM/SIGHUP: keep what came, save, then end the chat
            turn.terminated, terminated = True, e
            turn.cancel()
        except KeyboardInterrupt:
            turn.cancel()
        except Exception as e:  # noqa: BLE001 - a failed reply must not end the chat (the session is restored)
            failure = e
        finally:
            it.close()
            reply.finish(interrupted=turn.interrupted)
            self.typed_ahead += reply.typed_ahead()  # after what is still pending from before this turn
        if terminated is not None:
            raise terminated  # run() saves the session on the way out
        if failure is not None:
            undone = " (the message was not kept; Up arrow brings it back)" if turn.error is not None else ""
            self.view.error(f"generation failed: {failure_line(failure)}{undone}")
        if turn.discarded:
            self.view.notice("stopped before the reply began; the message was dropped (Up arrow brings it back)")
        stats_line = turn.stats is not None and self.show_stats and turn.error is None
        window = s.kv.max_size
        # context_used renders and tokenizes the whole history: only when the stats line or the window needs it
        used = s.context_used if stats_line or (window and not self._window_told) else 0
        rotated = bool(window) and used > window
        if stats_line:
            from .console_out import stats_text

            self.view.stats(stats_text(turn.stats, context=(used, s.context_limit), window=window if rotated else None))
        if rotated and not self._window_told:
            self._window_told = True
            self.view.notice(f"the KV cache window is full: the model now sees the last {window} tokens "
                             "(--max-kv-size, /set max_kv_size; the first 4 stay); older ones drop as the chat goes on")
        if turn.stats is not None and turn.stats.finish_reason == "length" and turn.max_tokens < s.params.max_tokens:
            self.view.notice("the reply reached the context limit (/set context, /clear or /undo make room)")
        if self.autosave and self.session_name:
            self.save(self.session_name, quiet=True)
        return turn

    # ----- sessions on disk -----
    def bind(self, name: str, hint: str | None = None) -> None:
        """Hold NAME's lock (raises store.SessionBusy if another process has it) and let go of the previous one."""
        from ..engine import store

        if self.lock is not None and self.lock.held and self.lock.name == name:
            return
        new = store.SessionLock.acquire(name, hint=hint)
        if self.lock is not None:
            self.lock.release()
        self.lock = new

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def save(self, name: str, quiet: bool = False) -> bool:
        from ..engine import store

        if self.world is not None and not self.world.leader:
            return True  # the leader writes the one copy; a follower on the same host would fight it for the lock

        replaced = None
        if name != self.session_name and not quiet:  # another session of that name was replaced without a word
            try:
                replaced = len(store.load(name).get("messages") or []) if name in store.names() else None
            except (MlxinferError, OSError):
                replaced = 0
        try:
            self.bind(name, hint="save under another name, or close that chat first")
            with _termination_held():
                path = store.save(name, self.session.to_dict())
        except (MlxinferError, OSError) as e:
            self.view.error(f"could not save the session: {e}")
            return False
        before, self.session_name = self.session_name, name
        self.saved_state = self.session.to_dict()
        if not quiet:
            self.view.info(f"saved session '{name}' ({len(self.session.messages)} messages) to {path}" +
                           (f"; it replaced the session of that name ({replaced} messages)" if replaced is not None
                            else ""))
            if self.autosave and before not in (None, name):  # --session: a "save as", as in an editor
                self.view.info(f"this chat now saves to '{name}' after every reply; '{before}' keeps what it had")
        return True

    def session_line(self) -> str:
        """What /show says of the session on disk: its name and whether what is on screen is in it."""
        name = self.session_name
        if name is None:
            return "(not saved; /save NAME)"
        if self.autosave:
            return f"{name} (saved after every reply)"
        if self.saved_state == self.session.to_dict():
            return f"{name} (saved)"
        return f"{name} (changed since saved; /save {name} keeps the changes)"

    def save_on_exit(self) -> None:
        """--session: what changed since the last reply (/set, /undo, an interrupted reply) is kept too."""
        if self.autosave and self.session_name:
            self.save(self.session_name, quiet=True)

    def open_session(self, name: str):
        """Take NAME's lock and read it (for /load): returns (data, lock). Nothing else changes until
        ``adopt(lock)``; hand the lock to ``drop(lock)`` if the load goes no further."""
        from ..engine import store

        if self.lock is not None and self.lock.held and self.lock.name == name:
            return store.load(name), self.lock
        lock = store.SessionLock.acquire(name, hint="close that chat first, or /load another session")
        try:
            return store.load(name), lock
        except BaseException:
            lock.release()
            raise

    def adopt(self, lock) -> None:
        """Bind the chat to ``lock``'s session, letting go of the one before."""
        if lock is self.lock:
            return
        self.release()
        self.lock = lock
        self.session_name = lock.name

    def drop(self, lock) -> None:
        if lock is not self.lock:
            lock.release()

    def show_history(self, last: int = 20) -> None:
        msgs = self.session.messages
        if len(msgs) > last:
            self.view.notice(f"({len(msgs) - last} earlier messages not shown)")
        for m in msgs[-last:]:
            if m["role"] == "user":
                self.view.user_message(m["content"])
            else:
                self.view.assistant_message(m["content"], self.session.think, m.get("interrupted", False))

    # ----- the loop -----
    def run(self) -> None:
        from .chat_commands import dispatch, is_command

        self.view.header(self.session.loaded, self.session)
        if self.session.messages:
            self.show_history()
        try:
            self._loop(dispatch, is_command)
        except Terminated:
            self.session.keep_unanswered()
            self.save_on_exit()
            raise
        finally:
            self.reader.close()
        self.save_on_exit()

    def _loop(self, dispatch, is_command) -> None:
        while True:
            try:
                ahead, sent, self.typed_ahead = next_entry(self.typed_ahead)
                text = self.reader.read(ahead, sent) if ahead else self.reader.read()
            except EOFError:
                break
            except Terminated:
                raise
            except MlxinferError as e:  # an input line that cannot be a message (not UTF-8)
                self.view.error(str(e))
                continue
            except KeyboardInterrupt:
                self.view.notice("Use Ctrl-D, /bye or /exit to quit.")
                continue
            if not text.strip():
                continue
            if is_command(text):
                if self.world is not None and text.strip().split()[0] == "/load":
                    self.view.error("/load is not available under mlx.launch (each rank would need the file)")
                    continue
                try:
                    if dispatch(self, text.strip()) == "exit":
                        break
                except MlxinferError as e:
                    self.view.error(str(e))
                continue
            self.run_turn(lambda: self.session.send(text))


def make_view(plain: bool):
    return PlainView() if plain else RichView()


def make_reader(plain: bool, completer=None):
    from .chat_input import LineReader, PromptReader

    if plain:
        prompt_to = sys.stderr if sys.stdin.isatty() and sys.stderr.isatty() else None
        return LineReader(prompt_to=prompt_to)
    return PromptReader(completer=completer)
