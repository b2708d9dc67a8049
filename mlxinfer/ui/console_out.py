"""Small shared renderers: the stats line after a reply."""

from __future__ import annotations

from rich.console import Console



def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def stats_text(stats, context: tuple[int, int] | None = None, window: int | None = None) -> str:
    """'42 tokens 31.2 tok/s · prompt 12 tokens 150.3 tok/s · TTFT 0.08 s · context 120/8192 · peak 210 MB';
    ``window``: a rotating KV cache's size, once the conversation is longer ('context 154/8192, window 64')."""
    def n(count: int, word: str) -> str:
        return f"{count} {word}" + ("" if count == 1 else "s")

    parts = [
        # one token has no decode rate (it is timed between tokens): "1 token 0.0 tok/s" said otherwise
        n(stats.generation_tokens, "token") + (f" {stats.generation_tps:.1f} tok/s" if stats.generation_tokens > 1
                                               else ""),
        f"prompt {n(stats.prompt_tokens, 'token')} {stats.prompt_tps:.1f} tok/s",
        f"TTFT {stats.ttft:.2f} s",
    ]
    if context:
        parts.append(f"context {context[0]}/{context[1]}" + (f", window {window}" if window else ""))
    parts.append(f"peak {format_bytes(stats.peak_memory)}")
    if stats.finish_reason and stats.finish_reason != "stop":
        parts.append(stats.finish_reason)
    return " · ".join(parts)


def print_stats_line(console: Console, stats, context: tuple[int, int] | None = None) -> None:
    # soft_wrap: never cut mid-field (a terminal wraps by itself; a log keeps one line per reply)
    console.print(stats_text(stats, context), style="dim", markup=False, soft_wrap=True)
