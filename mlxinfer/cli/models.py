"""``mlxinfer models``: the registry's aliases, what they are and whether they are on disk, then the Hub repos in the
cache that MLX can load and the GGUF import copies, with their sizes."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

HELP = """List model aliases (packaged models.toml merged with your own), then what the caches hold: Hub repos MLX
can load (the Hugging Face cache, shared with mlx-lm) and GGUF import copies, with sizes on disk.

Examples:

  mlxinfer models                    # tables

  mlxinfer models --json | jq '.[] | select(.kind == "hub") | .name'
"""


def models_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list for scripts (each row has a 'kind': "
                                          "alias, hub or gguf).")] = False,
):
    from ..models_info import list_models
    from ..registry import Registry, missing_user_registry, user_registry_path

    if (missing := missing_user_registry()) is not None:
        print(f"warning: MLXINFER_MODELS names {missing}, which does not exist: only the packaged "
              "aliases are listed (fix the path or unset it)", file=sys.stderr)
    registry = Registry.load()
    rows = list_models(registry)
    if as_json:
        json.dump([r.as_dict() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from ..ui.models_view import print_models

    print_models(rows, registry.default, user_registry_path())


def register(app: typer.Typer) -> None:
    app.command("models", help=HELP, short_help="List aliases and the models in the caches, with sizes.")(models_cmd)
