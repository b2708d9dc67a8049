"""``mlxinfer serve``: an OpenAI-compatible local server (continuous batching, prefix cache, metrics, limits)."""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated, List, Optional

import typer

from ..serve.prefix_cache import DEFAULT_MB as DEFAULT_PREFIX_MB
from . import options as o
from .chat import Pipeline

MAX_PARALLEL = 1024  # sequences in one batch: far past where batched decode gains, on any one machine


def _warn(line: str) -> None:
    """The engine's warnings (an error it recovered from), one line on stderr beside uvicorn's log."""
    print(f"mlxinfer serve: warning: {line}", file=sys.stderr, flush=True)


def serve_cmd(
    model: o.Model = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback needs "
                                      "--api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    parallel: Annotated[int, typer.Option("--parallel", "-P", help="Sequences decoded together at most.")] = 8,
    queue_size: Annotated[int, typer.Option("--queue-size", help="Requests waiting for a slot at most "
                                            "(more get 429).")] = 32,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="MLXINFER_API_KEY", show_envvar=True,
                                                   help="Require 'Authorization: Bearer KEY'.")] = None,
    max_body: Annotated[int, typer.Option("--max-body", help="Largest request body in bytes (more get 413).")]
    = 1 << 20,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds a request may take, queue included "
                                           "(0 = no limit).")] = 600.0,
    grace: Annotated[float, typer.Option("--grace", help="Seconds running requests get to finish after "
                                         "SIGTERM, SIGINT or SIGHUP.")] = 30.0,
    prefix_cache_mb: Annotated[int, typer.Option("--prefix-cache-mb", help="Memory for the prefix cache "
                                                 "(0 = off).")] = DEFAULT_PREFIX_MB,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Prompt tokens prefilled between two "
                                               "decode steps, per waiting prompt per decoding stream (at most "
                                               "2048).")] = 256,
    batch_from: Annotated[int, typer.Option("--batch-from", help="Decode as one batch from this many sequences "
                                            "on (fewer each run the single-sequence fast path).")] = 2,
    allow_origin: Annotated[Optional[List[str]], typer.Option(
        "--allow-origin", help="A web origin (e.g. http://localhost:3000) whose pages may call the API from a "
        "browser (CORS); repeatable, '*' for any.")] = None,
    temp: o.Temp = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    min_p: o.MinP = None,
    repeat_penalty: o.RepeatPenalty = None,
    max_tokens: o.MaxTokens = None,
    seed: o.Seed = None,
    kernels: o.Kernels = "auto",
    pipeline: Pipeline = False,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level: warning, info (one line "
                                           "per request), debug.")] = "warning",
):
    """Serve MODEL over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models), /health and /metrics.
    Sampling flags override what requests ask for; --max-tokens caps every request."""
    from ..engine.settings import resolve
    from ..errors import InvalidParameter
    from ..registry import Registry
    from ..serve.app import ServeOptions
    from ..serve.prefill import ROUND_MAX
    from ..serve.runner import check_bind, serve
    from ..ui.progress import load_model

    for name, value, low in (("--parallel", parallel, 1), ("--queue-size", queue_size, 0), ("--max-body", max_body, 1),
                             ("--prefill-chunk", prefill_chunk, 1),
                             ("--batch-from", batch_from, 1), ("--prefix-cache-mb", prefix_cache_mb, 0)):
        if value < low:
            raise InvalidParameter(f"invalid {name} {value}: must be >= {low}")
    for origin in allow_origin or []:  # a browser sends scheme://host[:port] and nothing else: others never match
        if origin != "*" and not re.fullmatch(r"https?://[^/\s?#]+", origin):
            raise InvalidParameter(f"invalid --allow-origin {origin!r}",
                                   hint="give scheme://host[:port], e.g. http://localhost:3000, or '*'")
    if parallel > MAX_PARALLEL:  # (100000000 was taken: the banner said "parallel 100000000")
        raise InvalidParameter(f"invalid --parallel {parallel}: must be at most {MAX_PARALLEL}",
                               hint="a few per core is where batched decode stops gaining on a CPU; tens on a GPU")
    if prefill_chunk > ROUND_MAX:
        raise InvalidParameter(f"invalid --prefill-chunk {prefill_chunk}: must be at most {ROUND_MAX}")
    for name, value in (("--timeout", timeout), ("--grace", grace)):
        if not value >= 0:
            raise InvalidParameter(f"invalid {name} {value}: must be >= 0 seconds")
    if log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise InvalidParameter(f"invalid --log-level {log_level!r}", hint="warning, info or debug")
    from ..distributed import enter

    world = enter(pipeline)  # under mlx.launch: rank 0 serves, the others follow (docs/distributed.md)
    if world is None or world.leader:
        port = check_bind(host, port, api_key)  # --port 0: the free port it found, so the banner names it
    registry = Registry.load()
    spec = registry.resolve(model)
    flags = {k: v for k, v in dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
                                   max_tokens=max_tokens, seed=seed).items() if v is not None}
    resolve(spec.defaults, None, flags)  # bad flag values fail here, before the model loads
    loaded = load_model(spec, kernels=kernels)
    resolve(spec.defaults, None, flags, loaded=loaded)
    if world is None:  # (under mlx.launch every rank would have to take part in the same step)
        _first_step(loaded)
    engine_opts = dict(parallel=parallel, queue_size=queue_size, timeout=timeout or None,
                       prefix_cache_bytes=prefix_cache_mb << 20, prefill_chunk=prefill_chunk, batch_from=batch_from)
    if world is not None:
        from ..distributed import describe
        from ..distributed.serve import FollowerEngine, LeaderEngine
        from ..serve.metrics import Metrics

        print(f"distributed: {describe(world)}", file=sys.stderr, flush=True)
        if not world.leader:
            world.watchdog.ctrl_c_ends = False  # a Ctrl-C in the launcher's terminal: rank 0 drains, then stops us
            FollowerEngine(loaded, Metrics(), **engine_opts).follow()
            return
        world.watchdog.on_signals = False  # SIGTERM/Ctrl-C drain (uvicorn's handler), then rank 0 stops the rest
    opts = ServeOptions(api_key=api_key, max_body=max_body, parallel=parallel, queue_size=queue_size,
                        timeout=timeout or None, prefix_cache_bytes=prefix_cache_mb << 20,
                        prefill_chunk=prefill_chunk, batch_from=batch_from, flags=flags,
                        allow_origins=list(allow_origin or []), bind_host=host, on_warning=_warn,
                        **({"engine_class": LeaderEngine} if world is not None else {}))
    shown = f"[{host}]" if ":" in host else host
    print(f"mlxinfer serve: {loaded.name} ({loaded.kernels}) on http://{shown}:{port}/v1 — parallel {parallel}, "
          f"queue {queue_size}{', API key required' if api_key else ''} (Ctrl-C or SIGTERM to stop)",
          file=sys.stderr, flush=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    serve(loaded, opts, host=host, port=port, grace=grace, log_level=log_level)
    print("mlxinfer serve: stopped", file=sys.stderr, flush=True)


def _first_step(loaded) -> None:
    """One token through the engine before the port opens: a model whose output is not finite (corrupt weights)
    stops the server here with one line instead of answering every request with garbage, and the first request
    does not pay the kernels' one-time costs."""
    from ..engine.generate import stream_generate
    from ..engine.sampling import SamplingParams

    tok = loaded.tokenizer
    first = next((t for t in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None))
                  if isinstance(t, int)), 0)
    for _ in stream_generate(loaded, [first], SamplingParams(temperature=0, max_tokens=1), ignore_eos=True):
        pass


def register(app: typer.Typer) -> None:
    app.command("serve", help="Serve a model over an OpenAI-compatible HTTP API (continuous batching).")(serve_cmd)
