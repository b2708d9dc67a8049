"""Rank 0 leads, the other ranks follow: what rank 0 reads (a prompt, a chat line, a slash command) is broadcast,
and every rank then runs the same code on the same input, so settings and sessions stay in step without a
separate protocol. Only rank 0 reads the terminal; ``mlx.launch`` copies stdin to every rank and never closes
it, so followers must not read it at all.
"""

from __future__ import annotations

from typing import Optional

from .group import current

_EOF = -1  # length sent when the leader's input ended


def _sum(values, dtype):
    import mlx.core as mx

    world = current()
    out = mx.distributed.all_sum(mx.array(values, dtype=dtype), group=world.group, stream=mx.cpu)
    mx.eval(out)
    return out


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (the others pass anything)."""
    import mlx.core as mx

    world = current()
    lo, hi = (value & 0xFFFF, value >> 16) if world.leader else (0, 0)
    out = _sum([lo, hi], mx.int32).tolist()
    return int(out[0]) | (int(out[1]) << 16)


def broadcast_text(text: Optional[str]) -> Optional[str]:
    """Rank 0's text (None: its input ended) on every rank."""
    import mlx.core as mx

    world = current()
    data = text.encode("utf-8") if world.leader and text is not None else b""
    n = broadcast_int(len(data) if world.leader and text is not None else (_EOF & 0xFFFFFFFF if world.leader else 0))
    if n == _EOF & 0xFFFFFFFF:
        return None
    if n == 0:
        return ""
    payload = list(data) if world.leader else [0] * n
    return bytes(_sum(payload, mx.uint8).tolist()).decode("utf-8")


class LeaderReader:
    """Rank 0's chat reader: reads as usual, then hands each line (or the end of input) to the followers."""

    def __init__(self, reader):
        self.reader = reader

    def read(self, *args) -> str:
        current().watchdog.idle()  # waiting for the user is not a hang
        try:
            text = self.reader.read(*args)
        except EOFError:
            broadcast_text(None)
            raise
        broadcast_text(text)
        return text

    def close(self) -> None:
        self.reader.close()


class FollowerReader:
    """A follower's chat reader: the leader's lines, as the leader read them."""

    def read(self, *_args) -> str:
        current().watchdog.idle()
        text = broadcast_text(None)
        if text is None:
            raise EOFError
        return text

    def close(self) -> None:
        pass


# ---- Ctrl-C during a chat reply -------------------------------------------------------------------------------
# Rank 0 decides for all: at every token and prefill-chunk boundary each rank sends its flags in one small
# all-reduce (rank 0: "the user pressed Ctrl-C"; followers: "a Ctrl-C reached me too", which happens only when it
# went to mlx.launch's whole process group) and every rank stops where the sum says so, at the same boundary.
_SIGINT = {"turn": None, "seen": False}


def _on_sigint(_signum, _frame) -> None:
    _SIGINT["seen"] = True
    turn = _SIGINT["turn"]
    if turn is not None:
        turn.cancel()


def agree_cancel(turn, cancel: bool) -> bool:
    """``engine.turn.AGREE`` under mlx.launch: rank 0's Ctrl-C stops the reply on every rank at this boundary."""
    import mlx.core as mx
    import signal

    world = current()
    if _SIGINT["turn"] is not turn:  # the turn's first boundary: a repeated Ctrl-C only cancels, never raises
        _SIGINT["turn"], _SIGINT["seen"] = turn, False
        try:
            signal.signal(signal.SIGINT, _on_sigint)  # the chat loop puts its own handler back after the turn
        except ValueError:  # not the main thread
            pass
    mine = [1 if cancel and world.leader else 0, 1 if _SIGINT["seen"] and not world.leader else 0]
    stop = any(_sum(mine, mx.int32).tolist())
    if stop:
        turn.cancel()
    return stop


def coordinate_ctrl_c() -> None:
    """Called once by chat under mlx.launch: turns agree on Ctrl-C at every token (``agree_cancel``)."""
    from ..engine import turn

    turn.AGREE = agree_cancel
