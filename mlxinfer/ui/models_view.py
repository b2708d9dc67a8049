"""Rendering for ``mlxinfer models`` (the aliases, then what the caches hold), ``pull``, ``rm`` and ``show``."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import printable
from .console_out import format_bytes


def print_models(rows, default: str, user_file: Path) -> None:
    console = Console()
    table = Table(title="mlxinfer models", title_justify="left")
    table.add_column("alias", no_wrap=True, style="bold")
    table.add_column("params", no_wrap=True)
    table.add_column("quant")
    table.add_column("on disk", no_wrap=True)
    table.add_column("description / source", overflow="fold")
    for r in (r for r in rows if r.kind == "alias"):
        mark = f"✓ {format_bytes(r.disk_bytes)}" if r.on_disk else "–"
        alias = f"{r.alias} *" if r.alias == default else r.alias
        table.add_row(escape(printable(alias)), escape(printable(str(r.params))), escape(printable(str(r.quant))), mark,
                      f"{escape(printable(r.description))}\n[dim]{escape(printable(r.source))}[/dim]")
    console.print(table)
    console.print(f"* default model. Your own aliases go in {user_file} (or $MLXINFER_MODELS).", style="dim")
    cached = [r for r in rows if r.kind != "alias"]
    if not cached:
        console.print("Nothing in the caches yet: `mlxinfer pull MODEL` downloads or imports one.", style="dim")
        return
    table = Table(title="in the caches (Hugging Face Hub, GGUF imports)", title_justify="left")
    table.add_column("name (for pull / rm / show)", overflow="fold", style="bold")
    table.add_column("kind", no_wrap=True)
    table.add_column("quant", no_wrap=True)
    table.add_column("size", no_wrap=True, justify="right")
    table.add_column("details / location", overflow="fold")
    for r in cached:
        via = f"alias {', '.join(r.aliases)}; " if r.aliases else ""
        table.add_row(escape(printable(r.name)), r.kind, escape(printable(str(r.quant))),
                      format_bytes(r.disk_bytes or 0),
                      f"{escape(printable(via + r.description))}\n[dim]{escape(printable(r.location or ''))}[/dim]")
    console.print(table)
    total = sum(r.disk_bytes or 0 for r in cached)
    console.print(f"{len(cached)} cached model(s), {format_bytes(total)} on disk. Free space: mlxinfer rm NAME.",
                  style="dim")


_SHOW_KEYS = (("model", "model"), ("description", "description"), ("source", "source"), ("architecture",
              "architecture"), ("parameters", "parameters"), ("quantization", "quantization"), ("context", "context"),
              ("layers", "layers"), ("hidden size", "hidden_size"), ("vocabulary", "vocab_size"),
              ("chat template", "chat_template"), ("license", "license"), ("size on disk", "disk_bytes"),
              ("path", "path"))


def _params(n: int | None) -> str:
    if not n:
        return "?"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit} ({n:,})"
    return str(n)


def print_show(info: dict) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, key in _SHOW_KEYS:
        if info.get(key) is None:
            continue
        value = info[key]
        if key == "parameters":
            value = _params(value)
        elif key == "disk_bytes":
            value = format_bytes(value)
        table.add_row(label, escape(printable(str(value))))
    Console().print(table)
