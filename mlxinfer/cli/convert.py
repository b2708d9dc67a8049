"""``mlxinfer convert``: Hugging Face safetensors or GGUF -> an MLX model directory, with a quality report."""

from __future__ import annotations

import re
import sys
from typing import Annotated, Optional

import typer

_STAGES = {"download": "download", "import": "import", "convert": "Converting tensors", "eval": "Quality check"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def _peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kilobytes on Linux


def parse_size(text: str) -> int:
    """'512MB', '2GB', '1.5G', '1048576' -> bytes (powers of 1024)."""
    from ..errors import InvalidParameter

    m = _SIZE_RE.match(text)
    if not m:
        raise InvalidParameter(f"--shard-size {text!r} is not a size", hint="write it like 512MB or 2GB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def convert_cmd(
    source: Annotated[str, typer.Argument(help="Hub repo id org/name[@rev], alias, Hugging Face directory or .gguf.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output MLX model directory.")],
    bits: Annotated[Optional[int], typer.Option("--bits", "-b", help="Quantize to 2|3|4|5|6|8 bits.")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", "-g", help="Group size 32|64|128.")] = None,
    mode: Annotated[Optional[str], typer.Option("--mode", help="affine (default), or mxfp4/nvfp4/mxfp8 where "
                                                               "this MLX supports them.")] = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Mixed precision as in mlx-lm: mixed_4_6, "
                                                                         "mixed_3_6, mixed_3_4, mixed_2_6, or a TOML "
                                                                         "rules file.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="float16|bfloat16|float32 for unquantized "
                                                                 "tensors (default: the source's).")] = None,
    dequantize: Annotated[bool, typer.Option("--dequantize", help="Quantized source -> float weights.")] = False,
    requantize: Annotated[bool, typer.Option(
        "--requantize", help="Allow quantizing an already-quantized source to as few bits again (errors add up; "
                             "without --bits/--recipe a quantized source keeps its format).")] = False,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace OUTPUT (and --alias) if it exists.")] = False,
    run_eval: Annotated[Optional[bool], typer.Option("--eval/--no-eval", help="Quality report vs the source "
                                                                              "(default: on for small models).",
                                                     show_default=False)] = None,
    eval_tokens: Annotated[Optional[int], typer.Option(
        "--eval-tokens", help="Tokens of the built-in sample to compare (default 2048; 128 on CPU).")] = None,
    shard_size: Annotated[str, typer.Option("--shard-size", help="Largest weight file; bounds peak memory.")] = "1GB",
    revision: Annotated[Optional[str], typer.Option("--revision", help="Hub branch, tag or commit.")] = None,
    alias: Annotated[Optional[str], typer.Option("--alias", help="Add the result to your models.toml as NAME.")] = None,
):
    """Convert a model to MLX: quantize (uniform or mixed recipes), change dtype, or dequantize."""
    from ..convert import ConvertOptions, convert
    from ..errors import InvalidParameter
    from ..ui.console_out import format_bytes
    from ..ui.progress import load_progress, stderr_console

    if eval_tokens is not None and eval_tokens < 1:
        raise InvalidParameter(f"--eval-tokens {eval_tokens} must be positive",
                               hint="give a token count such as 512, or --no-eval to skip the check")
    opts = ConvertOptions(
        bits=bits, group_size=group_size, mode=mode, recipe=recipe, dtype=dtype, dequantize=dequantize,
        requantize=requantize,
        force=force, eval=run_eval, eval_tokens=eval_tokens, shard_bytes=parse_size(shard_size),
        revision=revision, alias=alias,
    )
    console = stderr_console()
    with load_progress(console) as bar:
        def progress(stage: str, done: int, total: int) -> None:
            if bar is not None:
                bar(_STAGES.get(stage, stage), done, total)

        # SIGTERM/SIGHUP arrive as Terminated (cli/main.py): convert cleans up its temp dir as for Ctrl-C
        result = convert(source, output, opts, progress=progress)

    rev = f" @ {result.source.revision[:12]}" if result.source.revision else ""
    lines = [
        f"Converted {result.source.label}{rev} -> {result.out_dir}",
        f"  recipe          {result.recipe}",
        f"  parameters      {result.parameters:,}",
        f"  size            {format_bytes(result.size_before)} -> {format_bytes(result.size_after)} "
        f"({len(result.shards)} file{'s' if len(result.shards) != 1 else ''})",
        f"  bits per weight {result.bits_per_weight:.2f}",
        f"  time            {result.seconds:.1f} s",
    ]
    peak = _peak_rss()
    if peak:
        lines.append(f"  peak memory     {format_bytes(peak)} (whole process)")
    if result.quality is not None:
        lines.append("Quality against the source (built-in sample):")
        lines += [f"  {k:<26} {v}" for k, v in result.quality.rows()]
    for note in result.notes:
        lines.append(f"note: {note}")
    if result.alias_file is not None:
        lines.append(f"alias '{alias}' added to {result.alias_file}: mlxinfer chat {alias}")
    typer.echo("\n".join(lines))


# Backslashes keep Rich from reading [default] / [[rule]] as markup.
_EPILOG = (
    "Examples: mlxinfer convert Qwen/Qwen3-0.6B -o qwen3-4bit --bits 4 · "
    "mlxinfer convert model.F16.gguf -o m --recipe mixed_4_6 --alias mine · "
    "mlxinfer convert ./mlx-4bit -o ./f16 --dequantize.  "
    "A TOML recipe: \\[default] bits = 4 / \\[\\[rule]] match = \"down_proj\" "
    "layers = \"sensitive\" bits = 6 "
    "(layers: first, last, edges, sensitive, [0, -1] or \"2-5\"; quantize = false keeps a layer in --dtype)."
)


def register(app: typer.Typer) -> None:
    app.command("convert", help="Convert Hugging Face safetensors or GGUF to an MLX model (quantize, recipes, "
                                "quality report).", epilog=_EPILOG)(convert_cmd)
