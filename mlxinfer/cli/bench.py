"""``mlxinfer bench``: measure prefill, decode, TTFT, latency percentiles, memory and effective bandwidth."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from . import options as o

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
        "--batch", "-b", help="Batch sizes: aggregate decode tok/s through the server's scheduler, e.g. 1,2,4,8."
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
        "--compare", help="A saved -o json or jsonl run: print ratios of this run against it."
    )] = None,
    peer: Annotated[Optional[str], typer.Option(
        "--peer", help="Also run the same workload through another engine (mlx-lm) and print ratios."
    )] = None,
    bandwidth: Annotated[Optional[float], typer.Option(
        "--bandwidth", help="Peak memory bandwidth in GB/s (default: Apple's table, else a cached read probe)."
    )] = None,
    kernels: o.Kernels = "auto",
    kv_bits: o.KvBits = None,
    max_kv_size: o.MaxKvSize = None,
    threads: Annotated[Optional[str], typer.Option(
        "--threads", "-t", help="Native CPU kernel worker threads to sweep, e.g. 1,2,4 (a threads column; "
        "default: MLXINFER_THREADS or all cores). Set in this process between runs; MLX's built-in ops and the "
        "mlx-lm peer have no thread setting."
    )] = None,
    llama_bench: Annotated[bool, typer.Option(
        "--llama-bench", help="llama-bench's tests and table: ppP (prompt, one token out) and tgN (generation "
        "after a one-token prompt) as separate rows of model | size | params | backend | threads | test | t/s; "
        "-p 0 / -n 0 skip them."
    )] = False,
    csv_all: Annotated[bool, typer.Option(
        "--csv-all", help="CSV with every field of the records (raw samples included), not the curated columns."
    )] = False,
    microbench: Annotated[bool, typer.Option(
        "--microbench", help="Deprecated: use `mlxinfer microbench` (MODELS: shape sets; -b: rows, -d: contexts).",
        hidden=True,
    )] = False,
    pipeline: Annotated[bool, typer.Option("--pipeline", help="Under mlx.launch: split the layers into stages "
                                           "(pipeline parallel) instead of tensor parallel.")] = False,
):
    """Benchmark local inference: prefill and decode separately, TTFT, per-token latency, memory, bandwidth."""
    from ..bench import report
    from ..bench.runner import BenchOptions, run_bench
    from ..bench.workload import parse_int_list
    from ..errors import InvalidParameter
    from ..registry import Registry
    from ..ui.bench_view import BenchProgress, print_bench

    if microbench:
        return _microbench(models or [], n_depth, batch, repetitions, output, bandwidth,
                           unused={"--peer": peer, "--prefix-cache": prefix_cache, "--compare": compare,
                                   "--prompt-file": prompt_file, "-t": threads, "--kv-bits": kv_bits,
                                   "--max-kv-size": max_kv_size})
    # Everything the user typed is checked here, before any model is loaded or any run starts.
    low = 0 if llama_bench else 1  # llama-bench: -p 0 / -n 0 skip the pp / tg tests
    opts = BenchOptions(
        prompts=parse_int_list(n_prompt, "prompt length", minimum=low),
        gens=parse_int_list(n_gen, "generation length", minimum=low),
        depths=parse_int_list(n_depth, "depth", minimum=0),
        batches=parse_int_list(batch, "batch size") if batch is not None else None,
        prefixes=parse_int_list(prefix_cache, "prefix length") if prefix_cache is not None else [],
        repetitions=repetitions, warmup=warmup, seed=seed, prompt_file=prompt_file, peer=peer, kernels=kernels,
        bandwidth_gbps=bandwidth, llama=llama_bench, kv_bits=kv_bits, max_kv_size=max_kv_size,
        threads=parse_int_list(threads, "thread count") if threads is not None else None,
    ).validate()
    from ..bench.runner import check_threads, threads_warning
    from ..fsutil import atomic_write_text

    check_threads(opts.threads, opts.kernels)
    if (warning := threads_warning(opts.threads)) is not None:
        print(f"warning: {warning}", file=sys.stderr)

    def render(records: list[dict]) -> str:
        return report.render(records, fmt, baseline, llama=llama_bench, csv_all=csv_all)

    fmt, out_path = report.output_target(output)
    if csv_all and fmt != "csv":
        raise InvalidParameter("--csv-all shapes CSV output: add -o csv (or -o FILE.csv)")
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
            atomic_write_text(out_path, render(finished))
            print(f"\nsaved the {len(finished)} finished records to {out_path}", file=sys.stderr)
        raise
    if world is not None:  # world size, strategy, per-rank peak memory, communication per token; rank 0 reports
        from ..distributed.bench import annotate

        records = annotate(records, world)
        if not world.leader:
            return

    if fmt is not None and out_path is None:
        if not stream_jsonl:
            sys.stdout.write(render(records))
        return
    if out_path is not None:
        atomic_write_text(out_path, render(records))
        if not sys.stdout.isatty() or llama_bench:
            print(f"saved {len(records)} records to {out_path}", file=sys.stderr)
    if sys.stdout.isatty() and not llama_bench:
        print_bench(records, baseline, saved=out_path)
    elif out_path is None or llama_bench:  # llama-bench prints its Markdown table on a terminal too
        sys.stdout.write(report.render(records, "md", baseline, llama=llama_bench))


def _microbench(names, n_depth, batch, repetitions, output, bandwidth, unused: dict) -> None:
    """The deprecated ``bench --microbench``: ``mlxinfer microbench`` with -b as --rows and -d as --context."""
    from ..errors import InvalidParameter
    from .microbench import run_microbench

    given = [flag for flag, value in unused.items() if value is not None]
    if given:
        raise InvalidParameter(f"{given[0]} does not apply to --microbench")

    def notice() -> None:
        print("warning: `bench --microbench` is deprecated: use `mlxinfer microbench` (-b is --rows there, "
              "-d is --context)", file=sys.stderr)

    run_microbench(names, rows=batch if batch is not None else "1,4", contexts=n_depth, repetitions=repetitions,
                   threads=None, output=output, bandwidth=bandwidth, before_run=notice, alias=True)


_EPILOG = ("Examples: mlxinfer bench smollm2 -p 512 -n 128 -t 1,2,4 --llama-bench · mlxinfer bench -p 512 -n 128 "
           "-d 0,4096 --peer mlx-lm -o run.json · mlxinfer bench --compare run.json · mlxinfer bench -o csv.")


def register(app: typer.Typer) -> None:
    app.command("bench", help="Benchmark models: prefill/decode tok/s, TTFT, latency percentiles, memory, bandwidth.",
                epilog=_EPILOG)(bench_cmd)
