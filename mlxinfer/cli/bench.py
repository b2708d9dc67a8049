"""``mlxinfer bench``: measure prefill, decode, TTFT, latency percentiles, memory and effective bandwidth."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from . import options as o

MICRO_MAX_ROWS, MICRO_MAX_CONTEXT = 4096, 262_144
LIST_HELP = "llama-bench syntax: 512 | 128,256 | 128-512+128 | 64-1024*2"


def bench_cmd(
    models: Annotated[Optional[List[str]], typer.Argument(
        help="Models to benchmark: aliases, org/name or org/name@rev, MLX directories, .gguf files "
        "(default: the default alias)."
    )] = None,
    n_prompt: Annotated[str, typer.Option("--n-prompt", "-p", help=f"Prompt lengths. {LIST_HELP}")] = "512",
    n_gen: Annotated[str, typer.Option("--n-gen", "-n", help="Generation lengths (EOS ignored).")] = "128",
    n_depth: Annotated[str, typer.Option("--n-depth", "-d", help="Context depths already in the KV cache.")] = "0",
    batch: Annotated[Optional[str], typer.Option(
        "--batch", "-b", help="Batch sizes: aggregate decode tok/s through mlx-lm's BatchGenerator, e.g. 1,2,4,8."
    )] = None,
    prefix_cache: Annotated[Optional[str], typer.Option(
        "--prefix-cache", help="Shared-prefix lengths: TTFT of each prompt with a cold cache vs the prefix cached."
    )] = None,
    repetitions: Annotated[int, typer.Option("--repetitions", "-r", help="Timed runs per test.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs per test before timing.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random prompt tokens.")] = 0,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", help="Use this text's tokens (cycled) instead of random tokens."
    )] = None,
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", help="md | csv | json | jsonl to stdout, or a file path ending in one of those."
    )] = None,
    compare: Annotated[Optional[Path], typer.Option(
        "--compare", help="A saved -o json run: print ratios of this run against it."
    )] = None,
    peer: Annotated[Optional[str], typer.Option(
        "--peer", help="Also run the same workload through another engine (mlx-lm) and print ratios."
    )] = None,
    bandwidth: Annotated[Optional[float], typer.Option(
        "--bandwidth", help="Peak memory bandwidth in GB/s (default: Apple's table, or a cached copy probe)."
    )] = None,
    kernels: o.Kernels = "auto",
    microbench: Annotated[bool, typer.Option(
        "--microbench", help="Time the custom kernels against MLX's built-ins at 1B-8B decode shapes instead "
        "(MODELS: shape sets; -b: rows, -d: attention contexts, -r: timed evaluations)."
    )] = False,
    pipeline: Annotated[bool, typer.Option("--pipeline", help="Under mlx.launch: split the layers into stages "
                                           "(pipeline parallel) instead of tensor parallel.")] = False,
):
    """Benchmark local inference: prefill and decode separately, TTFT, per-token latency, memory, bandwidth."""
    from ..bench import report
    from ..bench.runner import BenchOptions, run_bench
    from ..bench.workload import parse_int_list
    from ..registry import Registry
    from ..ui.bench_view import BenchProgress, print_bench

    if microbench:
        return _microbench(models or [], n_depth, batch, repetitions, output, bandwidth,
                           unused={"--peer": peer, "--prefix-cache": prefix_cache, "--compare": compare,
                                   "--prompt-file": prompt_file})
    # Everything the user typed is checked here, before any model is loaded or any run starts.
    opts = BenchOptions(
        prompts=parse_int_list(n_prompt, "prompt length"), gens=parse_int_list(n_gen, "generation length"),
        depths=parse_int_list(n_depth, "depth", minimum=0),
        batches=parse_int_list(batch, "batch size") if batch is not None else None,
        prefixes=parse_int_list(prefix_cache, "prefix length") if prefix_cache is not None else [],
        repetitions=repetitions, warmup=warmup, seed=seed, prompt_file=prompt_file, peer=peer, kernels=kernels,
        bandwidth_gbps=bandwidth,
    ).validate()
    fmt, out_path = report.output_target(output)
    baseline = report.load_baseline(compare) if compare is not None else None
    from ..distributed import enter

    world = enter(pipeline)
    registry = Registry.load()
    specs = [registry.resolve(m) for m in (models or [None])]

    stream_jsonl = fmt == "jsonl" and out_path is None
    finished: list[dict] = []

    def on_record(record: dict) -> None:
        finished.append(record)
        if stream_jsonl:
            sys.stdout.write(report.to_jsonl([record]))
            sys.stdout.flush()

    try:
        with BenchProgress() as (progress, load):
            records = run_bench(specs, opts, load=load, progress=progress, on_record=on_record)
    except KeyboardInterrupt:
        if out_path is not None and finished:  # keep the tests that did finish
            report.write_atomic(out_path, report.render(finished, fmt, baseline))
            print(f"\nsaved the {len(finished)} finished records to {out_path}", file=sys.stderr)
        raise
    if world is not None:  # world size, strategy, per-rank peak memory, communication per token; rank 0 reports
        from ..distributed.bench import annotate

        records = annotate(records, world)
        if not world.leader:
            return

    if fmt is not None and out_path is None:
        if not stream_jsonl:
            sys.stdout.write(report.render(records, fmt, baseline))
        return
    if out_path is not None:
        report.write_atomic(out_path, report.render(records, fmt, baseline))
        if not sys.stdout.isatty():
            print(f"saved {len(records)} records to {out_path}", file=sys.stderr)
    if sys.stdout.isatty():
        print_bench(records, baseline, saved=out_path)
    elif out_path is None:
        sys.stdout.write(report.to_markdown(records, baseline))


def _microbench(names, n_depth, batch, repetitions, output, bandwidth, unused: dict) -> None:
    from ..bench import kernels as kb
    from ..bench import report
    from ..bench.workload import parse_int_list
    from ..errors import InvalidParameter
    from ..ui.bench_view import BenchProgress

    given = [flag for flag, value in unused.items() if value is not None]
    if given:
        raise InvalidParameter(f"{given[0]} does not apply to --microbench")
    from ..bench.runner import MAX_REPETITIONS

    if not 1 <= repetitions <= MAX_REPETITIONS:
        raise InvalidParameter(f"invalid repetitions {repetitions}: must be between 1 and {MAX_REPETITIONS}")
    names = kb.check_shape_sets(names)
    contexts = [d for d in parse_int_list(n_depth, "context", minimum=0) if d > 0] or [512, 4096, 16384]
    rows = parse_int_list(batch, "rows") if batch is not None else [1, 4]
    # Decode shapes: beyond these the buffers alone (rows x 14336 floats, a context of K and V) exhaust memory.
    for values, name, top in ((rows, "rows (-b)", MICRO_MAX_ROWS), (contexts, "context (-d)", MICRO_MAX_CONTEXT)):
        if max(values) > top:
            raise InvalidParameter(f"invalid {name} {max(values)} for --microbench: must be at most {top:,}")
    fmt, out_path = report.output_target(output)
    with BenchProgress() as (progress, _):
        records = kb.run_kernel_bench(names, rows=rows, contexts=contexts, repeat=repetitions,
                                      bandwidth_gbps=bandwidth, progress=progress)
    writers = {"md": kb.to_markdown, "csv": report.to_csv, "json": report.to_json, "jsonl": report.to_jsonl}
    text = writers[fmt or "md"](records)
    if out_path is not None:
        report.write_atomic(out_path, text)
        print(f"saved {len(records)} records to {out_path}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def register(app: typer.Typer) -> None:
    app.command("bench", help="Benchmark models: prefill/decode tok/s, TTFT, latency percentiles, memory, bandwidth.")(
        bench_cmd
    )
