"""Rendering for ``mlxinfer bench``: the progress bar while it runs and the Rich tables of the results."""

from __future__ import annotations

from pathlib import Path


class BenchProgress:
    """A Rich progress bar on stderr (only on a terminal) driving both model loading and the benchmark."""

    def __enter__(self):
        from ..engine.loader import load
        from .progress import stderr_console, warn_native_kernels

        console = stderr_console()
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                console=console, transient=True)
            self.bar.start()
        tasks: dict[str, int] = {}

        def progress(what: str, done: int, total: int) -> None:
            if self.bar is not None:
                if "bench" not in tasks:
                    tasks["bench"] = self.bar.add_task(what, total=total)
                self.bar.update(tasks["bench"], description=what, completed=done, total=total)

        def load_progress(stage: str, done: int, total: int) -> None:
            if self.bar is not None:
                if stage not in tasks:
                    tasks[stage] = self.bar.add_task(stage.capitalize(), total=max(total, 1))
                self.bar.update(tasks[stage], completed=done, total=max(total, 1))
                if done >= total:
                    self.bar.remove_task(tasks.pop(stage))

        def load_model(spec, kernels):
            try:
                loaded = load(spec, kernels=kernels, progress=load_progress)
                warn_native_kernels(loaded, kernels, console)
                return loaded
            finally:
                for stage in [k for k in tasks if k != "bench"]:
                    if self.bar is not None:
                        self.bar.remove_task(tasks.pop(stage))

        return progress, load_model

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False


def print_bench(records: list[dict], baseline, saved: Path | None) -> None:
    from rich.cells import cell_len
    from rich.console import Console
    from rich.table import Table

    from ..bench import report

    console = Console(highlight=False)

    def table(title, columns, rows, numeric_from: int):
        t = Table(title=title, title_justify="left", header_style="bold")
        for i, c in enumerate(columns):
            t.add_column(c, justify="right" if i >= numeric_from else "left", no_wrap=True)
        for row in rows:
            t.add_row(*row)
        widths = [max(cell_len(str(v)) for v in (c, *(r[i] for r in rows))) for i, c in enumerate(columns)]
        if sum(widths) + 3 * len(widths) + 1 <= console.width:  # cells, padding and borders on one line each
            console.print(t)
            return
        # Too wide for this terminal: Rich cut every cell ("pp16+…" on each row, "8.2/1…" at 80 columns), so
        # each row is printed as a block of "column  value" lines instead.
        if title:
            console.print(title, style="bold", markup=False)
        for row in rows:
            block = Table(show_header=False, box=None, pad_edge=False)
            block.add_column(style="bold", no_wrap=True)
            block.add_column(overflow="fold")
            for c, v in zip(columns, row):
                block.add_row(" ".join(c.split()), v)
            console.print(block)
            console.print()

    for line in report.provenance_lines(records):
        console.print(line, style="dim", markup=False)
    columns, rows = report.summary_table(records, compact=True)
    table(None, columns, rows, columns.index("test") + 1)
    peer = report.peer_rows(records)
    if peer:
        table("mlxinfer vs mlx-lm (ratio = mlxinfer / mlx-lm)", report.PEER_COLUMNS, peer, 3)
    if baseline is not None:
        rows = report.compare_rows(records, baseline)
        if rows:
            table("against the baseline (ratio = this run / baseline)", report.COMPARE_COLUMNS, rows, 4)
        else:
            console.print("no test in the baseline matches this run's tests", style="yellow")
    for line in report.depth_chart(records):
        console.print(line, markup=False)
    if saved is not None:
        console.print(f"saved {len(records)} records to {saved}", style="dim", markup=False)
