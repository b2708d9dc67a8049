"""Options shared by several commands (same names in generate, chat and bench)."""

from __future__ import annotations

from typing import Annotated, Any, Mapping, Optional

import typer

Model = Annotated[
    Optional[str],
    typer.Argument(help="Alias from models.toml, Hub repo id org/name[@rev], MLX model directory or .gguf file."),
]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
Temp = Annotated[Optional[float], typer.Option("--temp", "-t", help="Sampling temperature, >= 0 (0 = greedy).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling, in (0, 1] (1 = off).")]
TopK = Annotated[Optional[int], typer.Option(
    "--top-k", help="Keep the k most likely tokens, 0 to the vocabulary size (0 = off).")]
MinP = Annotated[Optional[float], typer.Option(
    "--min-p", help="Drop tokens below min-p × the top probability, in [0, 1] (0 = off).")]
RepeatPenalty = Annotated[Optional[float], typer.Option(
    "--repeat-penalty", help="Repetition penalty, > 0 (1 = off).")]
MaxTokens = Annotated[Optional[int], typer.Option(
    "--max-tokens", "-n", help="Maximum tokens to generate, 1 to the model's context (-1: as many as fit).")]
Seed = Annotated[Optional[int], typer.Option(
    "--seed", help="Random seed for reproducible sampling, 0 to 2^64-1.")]
Kernels = Annotated[
    str, typer.Option("--kernels", help="auto | custom | builtin (env MLXINFER_KERNELS).", show_default=True)
]


def sampling_from(spec_defaults: Mapping[str, Any] | None, saved: Mapping[str, Any] | None = None, *,
                  loaded=None, **flags):
    """SamplingParams by the one precedence rule (engine.settings.resolve): the model's registry defaults <
    ``saved`` (a resumed session) < the command-line flags (named as the options: temp, top_p, ...; None = not
    given). With ``loaded`` the values are also checked against the model (vocabulary, context)."""
    from ..engine.settings import resolve

    return resolve(spec_defaults, saved, flags, loaded=loaded)
KvBits = Annotated[Optional[int], typer.Option(
    "--kv-bits", help="Quantize the KV cache to 4 or 8 bits (less memory for long contexts; default: off).")]
MaxKvSize = Annotated[Optional[int], typer.Option(
    "--max-kv-size", help="Keep at most N tokens in the KV cache (a rotating window: long chats go on, the "
    "oldest tokens but the first 4 are dropped; default: the whole context).")]
