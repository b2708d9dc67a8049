"""Rich progress for the slow parts of loading: Hub download (bytes), GGUF import (tensors), weight load."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn,
)

_LABELS = {"download": "Downloading", "import": "Importing GGUF", "write": "Writing MLX weights", "load": "Loading",
           "convert": "Converting tensors", "eval": "Quality check", "tokenize": "Tokenizing the prompt"}


def stderr_console() -> Console:
    console = Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")), highlight=False)
    if not console.is_terminal:  # a log file or a pipe: lines stay whole, not cut at Rich's default 80 columns
        console.soft_wrap = True
    return console


@contextmanager
def load_progress(console: Console | None = None, enabled: bool | None = None) -> Iterator:
    """Yield a ``progress(stage, done, total)`` callback that drives a transient Rich progress display."""
    console = console or stderr_console()
    if enabled is None:
        enabled = console.is_terminal
    if not enabled:
        yield None
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
    with Progress(*columns, TextColumn("{task.fields[extra]}"), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(_LABELS.get(stage, stage), total=max(total, 1), extra="")
            extra = ""
            if stage == "download" and total > 1:
                extra = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB"
            bar.update(tasks[stage], completed=done, total=max(total, 1), extra=extra)

        yield progress


@contextmanager
def tokenize_progress(console: Console | None = None) -> Iterator:
    """A ``progress(stage, done, total)`` callback for tokenizing a long prompt: a bar on a terminal, one plain
    notice line otherwise (engine code calls it only for prompts long enough to take a while)."""
    console = console or stderr_console()
    if console.is_terminal:
        with load_progress(console, enabled=True) as progress:
            yield progress
        return
    said: list[bool] = []

    def notice(_stage: str, done: int, total: int) -> None:
        if not said and done < total:
            said.append(True)
            console.print(f"tokenizing a long prompt ({total:,} characters)...", markup=False, soft_wrap=True)

    yield notice


def load_model(model: str | None, *, kernels: str = "auto", registry=None, console: Console | None = None):
    """Load a model with a progress display on the terminal (none when stderr is not one)."""
    from ..engine.loader import load

    with load_progress(console) as progress:
        loaded = load(model, kernels=kernels, progress=progress, registry=registry)
    warn_native_kernels(loaded, kernels, console)
    return loaded


_WARNED: set[str] = set()


def warn_native_kernels(loaded, kernels: str = "auto", console: Console | None = None) -> None:
    """One line (once per process) when the CPU native kernels are off although nobody asked for that, e.g. a build
    for another MLX version: decode then runs several times slower, which must not go unnoticed. Also one for an
    MLXINFER_PREFILL or MLXINFER_DECODE value they ignore."""
    from ..kernels.patch import resolve_mode

    if loaded.backend != "cpu" or resolve_mode(kernels) == "builtin":
        return
    from ..native import problem, settings_problem

    line = problem() if loaded.kernels == "builtin" else settings_problem() if loaded.kernels == "cpu-native" else None
    if line and line not in _WARNED:
        _WARNED.add(line)
        (console or stderr_console()).print(f"warning: {line}", style="yellow", markup=False, soft_wrap=True)


def is_interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()
