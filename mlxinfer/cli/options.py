"""Options shared by several commands (same names in generate, chat and bench)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Model = Annotated[
    Optional[str],
    typer.Argument(help="Alias from models.toml, Hub repo id org/name[@rev], MLX model directory or .gguf file."),
]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
Temp = Annotated[Optional[float], typer.Option("--temp", "-t", help="Sampling temperature (0 = greedy).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling, in (0, 1].")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Drop tokens below min-p × the top probability.")]
RepeatPenalty = Annotated[Optional[float], typer.Option("--repeat-penalty", help="Repetition penalty (1 = off).")]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="Maximum tokens to generate.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for reproducible sampling.")]
Kernels = Annotated[
    str, typer.Option("--kernels", help="auto | custom | builtin (env MLXINFER_KERNELS).", show_default=True)
]


def sampling_from(spec_defaults: dict, **flags):
    """SamplingParams from the model's registry defaults with the command-line flags over them."""
    from ..engine.sampling import SamplingParams

    keys = SamplingParams.names()
    base = {k: v for k, v in spec_defaults.items() if k in keys}
    mapped = {
        "temperature": flags.get("temp"), "top_p": flags.get("top_p"), "top_k": flags.get("top_k"),
        "min_p": flags.get("min_p"), "repeat_penalty": flags.get("repeat_penalty"),
        "max_tokens": flags.get("max_tokens"), "seed": flags.get("seed"),
    }
    return SamplingParams(**base).with_values(**mapped)
