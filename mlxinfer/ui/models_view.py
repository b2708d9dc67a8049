"""Rendering for ``mlxinfer models``: the aliases table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .console_out import format_bytes


def print_models(rows, default: str, user_file: Path) -> None:
    table = Table(title="mlxinfer models", title_justify="left")
    table.add_column("alias", no_wrap=True, style="bold")
    table.add_column("params", no_wrap=True)
    table.add_column("quant")
    table.add_column("on disk", no_wrap=True)
    table.add_column("description / source", overflow="fold")
    for r in rows:
        mark = f"✓ {format_bytes(r.disk_bytes)}" if r.on_disk else "–"
        alias = f"{r.alias} *" if r.alias == default else r.alias
        table.add_row(alias, r.params, r.quant, mark, f"{r.description}\n[dim]{escape(r.source)}[/dim]")
    console = Console()
    console.print(table)
    console.print(f"* default model. Your own aliases go in {user_file} (or $MLXINFER_MODELS).", style="dim")
