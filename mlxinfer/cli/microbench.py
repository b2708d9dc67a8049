"""``mlxinfer microbench``: time the custom kernels against MLX's built-ins at the decode shapes of 1B-8B models."""

from __future__ import annotations

import sys
from typing import Annotated, List, Optional

import typer

MAX_ROWS, MAX_CONTEXT = 4096, 262_144  # beyond these the buffers alone (rows x 14336 floats, K and V) exhaust memory


def microbench_cmd(
    shape_sets: Annotated[Optional[List[str]], typer.Argument(
        help="Shape sets to time (default: all): llama-3.2-1b, llama-3.2-3b, llama-3.1-8b.", show_default=False,
    )] = None,
    rows: Annotated[str, typer.Option("--rows", "-m", help="Rows (tokens) of the matmul/SwiGLU shapes.")] = "1,4",
    context: Annotated[str, typer.Option("--context", "-c", help="Attention contexts (KV length).")] = "512,4096,16384",
    repetitions: Annotated[int, typer.Option(
        "--repetitions", "-r", help="Timed evaluations per kernel (median).")] = 10,
    threads: Annotated[Optional[str], typer.Option(
        "--threads", "-t", help="Native CPU kernel worker threads to sweep, e.g. 1,2,4 (default: as set now).",
    )] = None,
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", help="md | csv | json | jsonl to stdout, or a file path ending in one of those."
    )] = None,
):
    """Kernel micro-benchmark: custom kernels vs MLX built-ins, microseconds per call, speedup, max abs error."""
    run_microbench(shape_sets or [], rows=rows, contexts=context, repetitions=repetitions, threads=threads,
                   output=output)


def run_microbench(names: list[str], *, rows: str, contexts: str, repetitions: int, threads: str | None,
                   output: str | None, bandwidth: float | None = None, before_run=None,
                   alias: bool = False) -> None:
    """Check everything, then run and write. ``before_run`` is called once the input is known good (the
    deprecated ``bench --microbench`` prints its notice there); ``alias``: name that command's flags in errors."""
    from ..bench import kernels as kb
    from ..bench import report
    from ..bench.runner import MAX_REPETITIONS, check_threads
    from ..bench.workload import parse_int_list
    from ..errors import InvalidParameter
    from ..fsutil import atomic_write_text
    from ..ui.bench_view import BenchProgress

    if not 1 <= repetitions <= MAX_REPETITIONS:
        raise InvalidParameter(f"invalid repetitions {repetitions}: must be between 1 and {MAX_REPETITIONS}")
    names = kb.check_shape_sets(names)
    row_list = parse_int_list(rows, "rows")
    context_list = [d for d in parse_int_list(contexts, "context", minimum=0) if d > 0] or [512, 4096, 16384]
    flags, where = (("-b", "-d"), "--microbench") if alias else (("--rows", "--context"), "microbench")
    for values, name, top in ((row_list, f"rows ({flags[0]})", MAX_ROWS),
                              (context_list, f"context ({flags[1]})", MAX_CONTEXT)):
        if max(values) > top:
            raise InvalidParameter(f"invalid {name} {max(values)} for {where}: must be at most {top:,}")
    thread_list = parse_int_list(threads, "thread count") if threads is not None else None
    check_threads(thread_list)
    fmt, out_path = report.output_target(output)
    if before_run is not None:
        before_run()
    with BenchProgress() as (progress, _):
        records = kb.run_kernel_bench(names, rows=row_list, contexts=context_list, repeat=repetitions,
                                      bandwidth_gbps=bandwidth, threads=thread_list, progress=progress)
    # Kernel records have their own fields: the CSV holds every one of them.
    writers = {"md": kb.to_markdown, "csv": lambda rs: report.to_csv(rs, all_columns=True), "json": report.to_json,
               "jsonl": report.to_jsonl}
    text = writers[fmt or "md"](records)
    if out_path is not None:
        atomic_write_text(out_path, text)
        print(f"saved {len(records)} records to {out_path}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def register(app: typer.Typer) -> None:
    app.command("microbench", help="Time the custom kernels against MLX's built-ins at 1B-8B decode shapes.",
                epilog="Examples: mlxinfer microbench · "
                "mlxinfer microbench llama-3.2-1b -m 1 -c 4096 -t 1,2 -o json.")(
        microbench_cmd
    )
