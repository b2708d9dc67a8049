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

COMMANDS = ("chat", "generate", "bench", "convert", "models")

app = typer.Typer(
    name="mlxinfer",
    help="Local LLM chat, benchmark and conversion on MLX (Apple Silicon; CPU elsewhere).\n\n"
    "Without a command it starts a chat: `mlxinfer qwen3-0.6b --temp 0` is `mlxinfer chat qwen3-0.6b --temp 0`.",
    no_args_is_help=False,
    invoke_without_command=True,
    add_completion=False,
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


def _with_default_command(argv: list[str]) -> list[str]:
    """`mlxinfer [chat args]` means `mlxinfer chat [chat args]`."""
    if "chat" not in COMMANDS_PRESENT:
        return argv
    if not argv or (argv[0] not in COMMANDS_PRESENT and argv[0] not in ("-h", "--help", "--version")):
        return ["chat", *argv]
    return argv


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


def main(argv: list[str] | None = None) -> int:
    """Run the app; user errors print one line and exit 2, no traceback unless MLXINFER_DEBUG=1."""
    from ..errors import MlxinferError

    argv = _with_default_command(list(sys.argv[1:] if argv is None else argv))
    try:
        rv = app(args=argv, standalone_mode=False)
        if isinstance(rv, int) and rv != 0:  # click turns Ctrl-C into Exit(130) and returns it here
            if rv == 130:
                print("\ninterrupted", file=sys.stderr)
            return rv
        return 0
    except MlxinferError as e:
        if debug_enabled():
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, EOFError):
        return 1
    except Exception as e:  # noqa: BLE001 - the one top-level handler
        import click

        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        if debug_enabled():
            raise
        print(f"error: {type(e).__name__}: {e} (set MLXINFER_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


def entry() -> None:
    sys.exit(main())
