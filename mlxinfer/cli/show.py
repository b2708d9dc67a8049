"""``mlxinfer show``: what a model is, from its config, model card and weight headers."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from .pull import ModelArg

SHOW_HELP = """Show what a model is (architecture, parameters, quantization, context, chat template, license, size),
read from its config.json, model card and weight headers without loading the weights.

Examples:

  mlxinfer show smollm2

  mlxinfer show mlx-community/Qwen3-0.6B-4bit --json
"""


def show_cmd(
    model: ModelArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object for scripts.")] = False,
):
    from .. import manage

    info = manage.describe(manage.resolve(model))
    if as_json:
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from ..ui.models_view import print_show

    print_show(info)


def register(app: typer.Typer) -> None:
    app.command("show", help=SHOW_HELP, short_help="Show a model's architecture, size, quantization, license.")(
        show_cmd)
