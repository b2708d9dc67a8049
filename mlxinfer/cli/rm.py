"""``mlxinfer rm``: remove a model from the caches (Hub revisions, GGUF import copies), after asking."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .pull import ModelArg

RM_HELP = """Remove a model from the caches: every cached Hub revision (or the one named by @rev) and GGUF import
copies. Asks first (or --yes); files outside the caches (your own directories and .gguf files) are never deleted.

Examples:

  mlxinfer rm qwen3-0.6b

  mlxinfer rm mlx-community/Llama-3.2-1B-Instruct-4bit --yes

  mlxinfer rm SmolLM2-135M-Instruct.Q4_1.gguf   # the import copy; the .gguf itself stays
"""

def rm_cmd(
    model: ModelArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
):
    from .. import manage
    from ..errors import InvalidParameter
    from ..sources.cache import execute
    from ..ui.console_out import format_bytes

    removal = manage.plan_removal(manage.resolve(model))
    what = []
    if removal.hub_revisions:
        what.append(f"{len(removal.hub_revisions)} Hub cache revision(s)")
    if removal.imports:
        what.append(f"the GGUF import copy {removal.imports[0]}")
    summary = f"{removal.label}: {' and '.join(what)}, {format_bytes(removal.freed_bytes)}"
    if not yes:
        if not sys.stdin.isatty():
            raise InvalidParameter(f"not removing {summary} without confirmation: stdin is not a terminal",
                                   hint="add --yes")
        if not typer.confirm(f"Remove {summary}?", default=False, err=True):
            print("nothing removed", file=sys.stderr)
            raise typer.Exit(1)
    freed = execute(removal)
    if removal.imports:  # the user's .gguf is never touched: say what went
        print(f"removed the imported copy of {removal.label} ({format_bytes(freed)} freed); "
              "the .gguf file itself is untouched")
    else:
        print(f"removed {removal.label} ({format_bytes(freed)} freed)")


def register(app: typer.Typer) -> None:
    app.command("rm", help=RM_HELP, short_help="Remove a model from the caches (asks first).")(rm_cmd)
