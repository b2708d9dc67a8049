"""``mlxinfer models``: the registry's aliases, what they are, and whether they are on disk."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer


def models_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list for scripts.")] = False,
):
    """List model aliases (packaged models.toml merged with your own)."""
    from ..models_info import list_models
    from ..registry import Registry, user_registry_path

    registry = Registry.load()
    rows = list_models(registry)
    if as_json:
        json.dump([r.as_dict() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..ui.console_out import format_bytes

    table = Table(title="mlxinfer models", title_justify="left")
    table.add_column("alias", no_wrap=True, style="bold")
    table.add_column("params", no_wrap=True)
    table.add_column("quant")
    table.add_column("on disk", no_wrap=True)
    table.add_column("description / source", overflow="fold")
    for r in rows:
        mark = f"✓ {format_bytes(r.disk_bytes)}" if r.on_disk else "–"
        alias = f"{r.alias} *" if r.alias == registry.default else r.alias
        table.add_row(alias, r.params, r.quant, mark, f"{r.description}\n[dim]{escape(r.source)}[/dim]")
    console = Console()
    console.print(table)
    console.print(f"* default model. Your own aliases go in {user_registry_path()} (or $MLXINFER_MODELS).", style="dim")


def register(app: typer.Typer) -> None:
    app.command("models", help="List model aliases, their size and whether they are on disk.")(models_cmd)
