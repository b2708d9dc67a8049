"""Rank 0 leads, the other ranks follow: what rank 0 reads (a prompt, a chat line, a slash command) is broadcast,
and every rank then runs the same code on the same input, so settings and sessions stay in step without a
separate protocol. Only rank 0 reads the terminal; ``mlx.launch`` copies stdin to every rank and never closes
it, so followers must not read it at all.
"""

from __future__ import annotations

from typing import Optional

from .group import current, sigint_ignored

_EOF = -1  # length sent when the leader's input ended
_CTRL_C = -2  # length sent when Ctrl-C interrupted the leader's prompt


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
    if n == _CTRL_C & 0xFFFFFFFF:
        raise KeyboardInterrupt
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
        except KeyboardInterrupt as e:
            from ..errors import Terminated

            if isinstance(e, Terminated):
                raise
            broadcast_int(_CTRL_C & 0xFFFFFFFF)  # the followers check with rank 0 whether they got it too
            _end_if_whole_group(False)
            raise
        broadcast_text(text)
        return text

    def close(self) -> None:
        self.reader.close()


class FollowerReader:
    """A follower's chat reader: the leader's lines, as the leader read them."""

    def read(self, *_args) -> str:
        while True:
            current().watchdog.idle()
            try:
                text = broadcast_text(None)
            except KeyboardInterrupt:  # Ctrl-C at rank 0's prompt: end with it if it reached the whole group
                _end_if_whole_group(False)
                continue
            if text is None:
                raise EOFError
            return text

    def close(self) -> None:
        pass


# ---- Ctrl-C ----------------------------------------------------------------------------------------------------
# Rank 0 decides for all. During a reply each token and prefill-chunk boundary sends every rank's flags in one small
# all-reduce (rank 0: "the user pressed Ctrl-C"; followers: "a Ctrl-C reached me too") and every rank stops where
# the sum says so, at the same boundary, and the chat goes on. A follower gets SIGINT only when Ctrl-C went to
# mlx.launch's whole process group, i.e. was typed in its terminal: then mlx.launch itself has stopped relaying
# input and output (its main thread ends with KeyboardInterrupt), so every rank ends the chat (exit 130) rather
# than wait for input that can no longer come.
_TURN = {"turn": None}
_LATE = 0.3  # seconds a follower's SIGINT may trail rank 0's (each handles it once its collective returns)


def _on_sigint(_signum, _frame) -> None:
    world = current()
    if not world.leader:
        world.interrupted = True
    elif _TURN["turn"] is not None:
        _TURN["turn"].cancel()


def _whole_group(already: bool) -> bool:
    """After rank 0's Ctrl-C: did a follower get it too (a Ctrl-C typed in mlx.launch's terminal)?"""
    import time

    import mlx.core as mx

    if already:
        return True
    time.sleep(_LATE)
    world = current()
    return bool(_sum([0 if world.leader else int(world.interrupted)], mx.int32).tolist()[0])


def _end_if_whole_group(already: bool) -> None:
    if _whole_group(already):
        import signal

        from ..errors import Terminated

        raise Terminated(int(signal.SIGINT))


def agree_cancel(turn, cancel: bool) -> bool:
    """``engine.turn.AGREE`` under mlx.launch: rank 0's Ctrl-C stops the reply on every rank at this boundary."""
    import signal

    import mlx.core as mx

    world = current()
    if _TURN["turn"] is not turn:  # the turn's first boundary: a repeated Ctrl-C only cancels, never raises
        _TURN["turn"] = turn
        try:
            if world.leader or not sigint_ignored():  # a background job's follower keeps ignoring Ctrl-C
                signal.signal(signal.SIGINT, _on_sigint)  # the chat loop puts its own handler back after the turn
        except ValueError:  # not the main thread
            pass
    mine = [1 if cancel and world.leader else 0, 0 if world.leader else int(world.interrupted)]
    leader, followers = _sum(mine, mx.int32).tolist()
    if leader or followers:
        turn.cancel()
        _end_if_whole_group(followers > 0)
        return True
    return False


def coordinate_ctrl_c() -> None:
    """Called once by chat under mlx.launch: turns agree on Ctrl-C at every token (``agree_cancel``)."""
    from ..engine import turn

    turn.AGREE = agree_cancel
