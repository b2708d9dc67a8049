"""The ``mlxinfer`` entry point: one Typer app, one top-level error handler.

Each command lives in its own module ``mlxinfer.cli.<name>`` exposing ``register(app)``; modules that are not
present are skipped, so commands can be added without touching this file.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from .. import __version__

COMMANDS = ("chat", "generate", "bench", "microbench", "convert", "models", "pull", "rm", "show", "serve")

app = typer.Typer(
    name="mlxinfer",
    help="Local LLM chat, benchmark and conversion on MLX (Apple Silicon; CPU elsewhere).\n\n"
    "Without a command it starts a chat: `mlxinfer qwen3-0.6b --temp 0` is `mlxinfer chat qwen3-0.6b --temp 0`; "
    "with a prompt after the model it answers once: `mlxinfer smollm2 \"Why is the sky blue?\"` is "
    "`mlxinfer generate smollm2 -p \"Why is the sky blue?\"`.",
    no_args_is_help=False,
    invoke_without_command=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        typer.echo(f"mlxinfer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
):
    """With no command (or with chat's arguments alone, e.g. `mlxinfer qwen3-0.6b --temp 0`), start a chat."""


_ROOT_OPTIONS = ("-h", "--help", "--version", "--install-completion", "--show-completion")


def _with_default_command(argv: list[str]) -> list[str]:
    """`mlxinfer [chat args]` means `mlxinfer chat [chat args]`; `mlxinfer MODEL "prompt" [options]` means
    `mlxinfer generate MODEL -p "prompt" [options]` (one-shot, as `ollama run MODEL "prompt"`)."""
    if "chat" not in COMMANDS_PRESENT:
        return argv
    if argv and argv[0] in (*COMMANDS_PRESENT, *_ROOT_OPTIONS):
        return argv
    if len(argv) >= 2 and not argv[0].startswith("-") and not argv[1].startswith("-") and \
            "generate" in COMMANDS_PRESENT:
        rest = argv[2:]
        if any(a in ("-p", "--prompt") or a.startswith(("--prompt=", "-p")) for a in rest if a != "--"):
            from ..errors import InvalidParameter  # the later -p won silently: the prompt typed first was dropped

            raise InvalidParameter(f"two prompts: {argv[1][:40]!r} after the model and one with -p",
                                   hint="give one of them")
        return ["generate", argv[0], "-p", argv[1], *rest]
    return ["chat", *argv]


COMMANDS_PRESENT: list[str] = []
for _name in COMMANDS:
    try:
        _module = importlib.import_module(f"mlxinfer.cli.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"mlxinfer.cli.{_name}":
            raise
        continue
    _module.register(app)
    COMMANDS_PRESENT.append(_name)


def debug_enabled() -> bool:
    return os.environ.get("MLXINFER_DEBUG", "") not in ("", "0", "false", "no")


def _click_exceptions() -> tuple[type, ...]:
    """ClickException classes: typer ships its own click (``typer._click``); a separately installed click may
    also raise (Typer's rich help, plugins). Both mean a usage error."""
    import typer._click.exceptions as tclick

    classes: list[type] = [tclick.ClickException]
    try:
        import click

        classes.append(click.ClickException)
    except ImportError:
        pass
    return tuple(classes)


class _ClosedStream:
    """Stands in for a stdout/stderr the parent closed: writing raises instead of crashing on ``None``."""

    def write(self, _text):
        import errno

        raise OSError(errno.EBADF, "the stream is closed")

    def flush(self):
        pass

    def isatty(self):
        return False

    def fileno(self):
        import io

        raise io.UnsupportedOperation("closed stream")


_SIGNALS: list[int] = []  # SIGTERM/SIGHUP received, in order


def _install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise ``Terminated`` in the main thread, so they clean up and save like Ctrl-C does."""
    import signal
    import threading

    from ..errors import Terminated

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, _frame):
        _SIGNALS.append(signum)  # typer turns every KeyboardInterrupt, Terminated too, into exit 130
        raise Terminated(signum)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handler)


def _check_argv(argv: list[str]) -> None:
    """Python decodes undecodable argv bytes as lone surrogates; they would fail much later, far from the cause."""
    from ..errors import InvalidParameter

    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            # surrogateescape gives back the bytes the user typed: b'\xff' shows as \xff, not as \udcff
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise InvalidParameter(f"argument '{shown}' is not valid UTF-8", hint="pass text in UTF-8") from None


def _give_usage_context(e: Exception, argv: list[str] | None) -> None:
    """click's parser raises some usage errors (an option missing its value) without a context, and then prints
    no usage line; give them the command's context so every usage error shows it."""
    if not argv or not hasattr(e, "ctx") or e.ctx is not None:
        return
    try:
        import typer._click as tclick
        from typer._click.utils import _detect_program_name

        root = typer.main.get_command(app)
        settings = dict(getattr(app.info, "context_settings", None) or {})
        parent = tclick.Context(root, info_name=_detect_program_name(), **settings)
        sub = root.get_command(parent, argv[0]) if hasattr(root, "get_command") else None
        if sub is not None:
            e.ctx, e.cmd = tclick.Context(sub, info_name=argv[0], parent=parent, **settings), sub
    except Exception:  # noqa: BLE001 - the message alone is still right
        pass


def _follower_rank() -> bool:
    """A rank other than 0 of a launched run, from the launcher's variables (before any group exists)."""
    from ..distributed.group import RANK_VARIABLES, launched

    env = os.environ
    rank = next((env[k] for k in RANK_VARIABLES if k in env), "0")
    return launched() and rank.strip() != "0"


def _usage_line(e: Exception) -> str:
    """A click usage error as one line: its message (click's "Did you mean ...?" included) and where to look."""
    name, possible = getattr(e, "option_name", None), getattr(e, "possibilities", None)
    try:
        message = " ".join(e.format_message().split())
    except Exception:  # noqa: BLE001 - a click exception without the method
        message = " ".join(str(e).split())
    if name and possible is not None:  # click suggests at 60% likeness: `bench --temp` got "--help"
        import difflib

        command = getattr(getattr(e, "ctx", None), "command", None)
        options = {o for p in getattr(command, "params", ()) for o in (*p.opts, *p.secondary_opts)
                   if o.startswith("--")} or set(possible)

        def near_to(option: str) -> bool:  # 80% alike, or one the start of the other (--temperature: --temp)
            short, long_ = sorted((name, option), key=len)
            return difflib.SequenceMatcher(None, name, option).ratio() >= 0.8 or \
                (len(short) >= 5 and long_.startswith(short))

        near = [p for p in options if p != "--help" and near_to(p)]
        message = f"no such option: {name}" + (f"; did you mean {' or '.join(sorted(near))}?" if near else "")
    if len(message) > 1 and message[0].isupper() and message[1].islower():
        message = message[0].lower() + message[1:]  # "No such option" -> "no such option", as our own lines read
    message = message.rstrip(".")
    names, ctx = [], getattr(e, "ctx", None)
    while ctx is not None and getattr(ctx, "parent", None) is not None:  # the subcommands, not the program name
        names.insert(0, ctx.info_name)  # (click would say "python -m mlxinfer" when run so)
        ctx = ctx.parent
    return f"{message} (see: {' '.join(['mlxinfer', *names])} --help)"


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _os_error_line(e: OSError) -> str:
    import errno

    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on the device{where}; nothing was kept (free some space and try again)"
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded{where}; nothing was kept (free some space and try again)"
    if e.errno == errno.EFBIG:
        return f"file size limit reached{where}; nothing was kept (raise the limit: ulimit -f)"
    if e.errno in (errno.EACCES, errno.EPERM):
        from ..fsutil import read_failure

        denied = read_failure(e)
        return str(denied) if denied is not None else f"permission denied{where} (choose a path you can write to)"
    if e.errno == errno.EROFS:
        return f"read-only file system{where} (choose a writable path)"
    if e.errno == errno.EBADF:
        return "cannot write the output: the stream is closed (redirect it to a file or to /dev/null)"
    return f"{e.strerror or e}{where}"


def main(argv: list[str] | None = None) -> int:
    """Run the app. Every user error is one line on stderr with exit code 2, usage errors too (click's message and
    the command's --help); Ctrl-C exits 130, SIGTERM/SIGHUP 128 + signum; a broken pipe exits quietly. No
    traceback unless MLXINFER_DEBUG=1 (then it comes first, the exit code unchanged)."""
    from ..errors import Terminated

    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:  # started with the descriptor closed
            setattr(sys, name, _ClosedStream())
    _install_signal_handlers()
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    usage_errors = _click_exceptions()  # here, not in the except clause: a signal there would escape every handler
    # Signals are taken here, outside _run: one raised while _run reports an error (mlx.launch SIGTERMs the other
    # ranks when one exits) is caught as well as one raised during the command.
    try:
        return _run(raw_argv, usage_errors)
    except Terminated as e:
        if not _follower_rank():  # under mlx.launch: the launcher ending a rank after another's error
            _say("\nterminated")
        return e.exit_code
    except KeyboardInterrupt:
        from ..distributed.group import note_interrupted

        note_interrupted()
        _say("\ninterrupted")
        return 130


def _run(raw_argv: list[str], usage_errors: tuple[type, ...]) -> int:
    """The command and every error but a signal's (main takes those), each as one line and an exit code."""
    from ..errors import MlxinferError

    argv = raw_argv
    try:
        _check_argv(raw_argv)
        argv = _with_default_command(raw_argv)
        rv = app(args=argv, standalone_mode=False)
        if isinstance(rv, int) and rv != 0:  # click turns Ctrl-C into Exit(130) and returns it here
            if rv == 130 and _SIGNALS:
                _say("\nterminated")
                return 128 + _SIGNALS[0]
            if rv == 130:
                _say("\ninterrupted")
            return rv
        return 0
    except MlxinferError as e:
        _traceback_if_debug()
        _say(f"error: {e}")
        return e.exit_code
    except BrokenPipeError:
        _silence_stdout()
        return 1  # what click itself does on EPIPE inside a command (it exits 1, silently)
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, EOFError):
        return 1
    except usage_errors as e:
        _give_usage_context(e, argv)
        if not _follower_rank():  # under mlx.launch every rank parses the same line: rank 0 alone says it
            _say(f"error: {_usage_line(e)}")  # one line, like every other error (click's own is four)
        return 2
    except UnicodeDecodeError as e:
        _traceback_if_debug()
        _say(f"error: input is not valid UTF-8 (byte {e.start}: {e.reason}); pass text in UTF-8")
        return 2
    except MemoryError:
        _traceback_if_debug()
        _say("error: out of memory (try a smaller model, batch, context or prompt)")
        return 2
    except OSError as e:
        _traceback_if_debug()
        _say(f"error: {_os_error_line(e)}")
        return 2
    except Exception as e:  # noqa: BLE001 - the one top-level handler
        _traceback_if_debug()
        from ..distributed.group import fail, interrupted_follower, lost_peer_line  # under mlx.launch

        if interrupted_follower():  # followers print nothing; rank 0 said "interrupted"
            return 130
        if (line := lost_peer_line(e)) is not None:
            try:
                sys.stdout.flush()  # what was generated stays written (fail ends the process without cleanup)
            except (OSError, ValueError):
                pass
            fail(line)  # ends the process now: mlx.launch's SIGTERM, on its way, must not add a second line
            return 1
        first = (str(e).splitlines() or [""])[0]
        how = "report it with the traceback above" if debug_enabled() else \
            "set MLXINFER_DEBUG=1 for the traceback and report it"
        _say(f"error: internal error: {type(e).__name__}: {first} ({how})")
        return 1


def _traceback_if_debug() -> None:
    """MLXINFER_DEBUG=1 adds the traceback above the usual line; the exit code stays what it would be without."""
    if debug_enabled():
        import traceback

        try:
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _say(line: str) -> None:
    """One line on stderr; a closed or broken stderr is not worth a second error."""
    from ..errors import printable

    line = printable(line)  # an error may quote a model file: its ESC sequences must not reach the terminal
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def entry() -> None:
    sys.exit(main())
