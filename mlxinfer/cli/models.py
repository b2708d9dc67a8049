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
    from ..ui.models_view import print_models

    print_models(rows, registry.default, user_registry_path())


def register(app: typer.Typer) -> None:
    app.command("models", help="List model aliases, their size and whether they are on disk.")(models_cmd)
