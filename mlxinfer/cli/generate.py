"""``mlxinfer generate``: one prompt in, one reply out (streamed), stats on stderr."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from . import options as o


def generate_cmd(
    model: o.Model = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt; '-' reads stdin.")] = None,
    system: o.System = None,
    temp: o.Temp = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    min_p: o.MinP = None,
    repeat_penalty: o.RepeatPenalty = None,
    max_tokens: o.MaxTokens = None,
    seed: o.Seed = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the reply and stats.")] = False,
    kernels: o.Kernels = "auto",
):
    """Generate a reply to one prompt."""
    from ..engine.generate import chat_prompt, stream_generate
    from ..errors import InvalidParameter
    from ..registry import Registry
    from ..ui.console_out import print_stats_line
    from ..ui.progress import load_model, stderr_console

    if prompt is None:
        raise InvalidParameter("no prompt given", hint="use -p 'your question', or -p - to read stdin")
    if prompt == "-":
        prompt = sys.stdin.read()
    registry = Registry.load()
    spec = registry.resolve(model)
    params = o.sampling_from(spec.defaults, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                             repeat_penalty=repeat_penalty, max_tokens=max_tokens, seed=seed)
    loaded = load_model(spec, kernels=kernels)
    if raw:
        tokens = prompt
    else:
        system = system if system is not None else spec.defaults.get("system")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        tokens = chat_prompt(loaded, messages)

    out = sys.stdout
    pieces, last = [], None
    for r in stream_generate(loaded, tokens, params):
        pieces.append(r.text)
        last = r
        if not as_json and r.text:
            out.write(r.text)
            out.flush()
    stats = last.stats
    if as_json:
        json.dump({
            "model": loaded.name, "text": "".join(pieces), "finish_reason": stats.finish_reason,
            "prompt_tokens": stats.prompt_tokens, "prompt_tps": stats.prompt_tps, "ttft_s": stats.ttft,
            "generation_tokens": stats.generation_tokens, "generation_tps": stats.generation_tps,
            "peak_memory_bytes": stats.peak_memory, "kernels": loaded.kernels, "backend": loaded.backend,
            "sampling": params.as_dict(),
        }, out)
        out.write("\n")
    else:
        if not "".join(pieces).endswith("\n"):
            out.write("\n")
        out.flush()
        print_stats_line(stderr_console(), stats)


def register(app: typer.Typer) -> None:
    app.command("generate", help="Generate a reply to one prompt (-p), streamed to stdout.")(generate_cmd)
