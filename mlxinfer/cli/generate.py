"""``mlxinfer generate``: one prompt in, one reply out (streamed), stats on stderr."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from . import options as o

MAX_STDIN_BYTES = 128 << 20  # ~30M tokens of text: beyond any context, so not worth holding in memory


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
    kv_bits: o.KvBits = None,
    max_kv_size: o.MaxKvSize = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the reply and stats.")] = False,
    kernels: o.Kernels = "auto",
    pipeline: Annotated[bool, typer.Option("--pipeline", help="Under mlx.launch: split the layers into stages "
                                           "(pipeline parallel) instead of tensor parallel.")] = False,
):
    """Generate a reply to one prompt."""
    from ..engine.generate import stream_generate
    from ..engine.prompts import prompt_tokens
    from ..engine.kv_options import kernel_note
    from ..engine.settings import resolve_kv
    from ..errors import InvalidParameter
    from ..registry import Registry
    from ..ui.console_out import print_stats_line
    from ..ui.progress import load_model, stderr_console, tokenize_progress

    if prompt is None:
        raise InvalidParameter("no prompt given", hint="use -p 'your question', or -p - to read stdin")
    if raw and system is not None:  # it was dropped without a word: a system prompt lives in the chat template
        raise InvalidParameter("--system needs the chat template, which --raw leaves out",
                               hint="drop one of them, or write the system text into the raw prompt")
    from ..distributed import describe, enter

    world = enter(pipeline)
    if world is not None and prompt == "-":  # mlx.launch copies stdin to the ranks but never closes it
        raise InvalidParameter("-p - cannot read stdin under mlx.launch (it never passes the end of input on)",
                               hint="give the prompt with -p 'text' or -p \"$(cat file)\"")
    if prompt == "-":
        prompt = read_stdin()
    if not prompt.strip():
        raise InvalidParameter("the prompt is empty", hint="give some text with -p, or pipe it with -p -")
    registry = Registry.load()
    spec = registry.resolve(model)
    flags = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
                 max_tokens=max_tokens, seed=seed)
    kv_flags = dict(kv_bits=kv_bits, max_kv_size=max_kv_size)
    o.sampling_from(spec.defaults, **flags)  # what needs no model is refused before the model loads
    resolve_kv(spec.defaults, None, kv_flags)
    loaded = load_model(spec, kernels=kernels)
    if world is not None:
        stderr_console().print(f"distributed: {describe(world)}", markup=False, soft_wrap=True)
    params = o.sampling_from(spec.defaults, loaded=loaded, **flags)
    kv = resolve_kv(spec.defaults, None, kv_flags, loaded=loaded)
    note = kernel_note(loaded.model, kv)
    if note and not as_json:  # the custom kernels' part that steps aside for this cache, said once
        stderr_console().print(f"kernels: {note}", markup=False, soft_wrap=True)
    if not raw:
        system = system if system is not None else spec.defaults.get("system")
    # Checked against the context before any prefill: a prompt that cannot fit is refused, not truncated.
    with tokenize_progress() as progress:
        tokens, room = prompt_tokens(loaded, prompt, raw=raw, system=None if raw else system,
                                     max_tokens=params.max_tokens, fixed_max_tokens=max_tokens is not None,
                                     progress=progress)
    run_params = params.with_values(max_tokens=room)  # the reply stops where the context ends

    out = sys.stdout
    pieces, last = [], None
    for r in stream_generate(loaded, tokens, run_params, kv=kv, completion=raw):
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
            "sampling": params.as_dict(), "kv_cache": {**kv.as_dict(), "kernel_note": note},
        }, out)
        out.write("\n")
    else:
        if not "".join(pieces).endswith("\n"):
            out.write("\n")
        out.flush()
        print_stats_line(stderr_console(), stats,
                         context=(stats.prompt_tokens + stats.generation_tokens, loaded.context_length))


def read_stdin() -> str:
    """The prompt from stdin, decoded strictly (undecodable bytes are named by position, not replaced), without
    the newlines that end it."""
    from ..errors import InvalidParameter

    if sys.stdin is None:
        raise InvalidParameter("stdin is closed", hint="pipe the prompt in, or pass it with -p 'text'")
    data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1) if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    if len(data) > MAX_STDIN_BYTES:
        raise InvalidParameter(f"the prompt on stdin is over {MAX_STDIN_BYTES >> 20} MB, more than any model's "
                               "context holds", hint="shorten the prompt")
    try:
        # The newlines that end a file or `echo "..." |` are not part of the prompt: kept, they made `-p -` another
        # prompt than `-p "..."` (38 tokens, not 37, and another greedy answer).
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise InvalidParameter(f"stdin is not valid UTF-8: {e.reason} at byte {e.start}",
                               hint="convert it first, e.g. iconv -f latin1 -t utf-8") from None


def register(app: typer.Typer) -> None:
    app.command("generate", help="Generate a reply to one prompt (-p), streamed to stdout.")(generate_cmd)
