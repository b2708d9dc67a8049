"""One chat reply being generated (``Session.send`` / ``retry`` make it): iterate it for the pieces, ``cancel()``
stops it at the next token or prefill chunk, and the session takes the outcome back when iteration ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..errors import Terminated
from .generate import Response, stream_generate

if TYPE_CHECKING:
    from .session import Session

# Prefill in small chunks in chat so a cancel lands within a few seconds even on a slow CPU prefill.
CHAT_PREFILL_STEP = 128

# Under mlx.launch (set by mlxinfer.distributed.follow): (turn, this rank's cancel flag) -> rank 0's decision, so
# every rank stops at the same token or prefill chunk. Called at each of those boundaries on every rank.
AGREE = None


class Cancelled(Exception):
    """Raised inside the prefill progress callback to stop a cancelled turn at a chunk boundary."""


class Turn:
    """One reply being generated. Iterate it for ``Response`` pieces; ``cancel()`` (e.g. from a SIGINT handler)
    stops it at the next token or prefill chunk. When iteration ends, however it ends, the reply is in the
    session's history (``interrupted`` if cut short) and the cache is re-synced to the tokens it really holds."""

    def __init__(self, session: "Session", tokens: list[int], reused: int, dropped: int, max_tokens: int):
        self.session = session
        self.tokens = tokens            # the full rendered prompt (history + generation prompt)
        self.reused = reused            # of which the cache already held this many
        self.dropped = dropped          # messages dropped from the start of the history to fit the context
        self.max_tokens = max_tokens    # this turn's limit (the setting, capped by the room left in the context)
        self.text = ""
        self.stats = None
        self.interrupted = False
        self.discarded = False          # cancelled before the first token: the exchange was removed
        self.error: Exception | None = None  # generation failed: the session is back where it was before
        self.terminated = False         # SIGTERM/SIGHUP: keep the exchange (marked interrupted) even if empty
        self.before: list[dict] = []    # the messages before this turn (restored if it fails)
        self.on_prefill = None          # optional callback(done, total) while the prompt is prefilled
        self._cancel = False
        self._started = False

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.reused

    def cancel(self) -> None:
        self._cancel = True

    def _progress(self, done: int, total: int) -> None:
        if self.on_prefill is not None:
            self.on_prefill(done, total)  # may cancel (the UI polls for Ctrl-C here)
        if self._stopping() and done < total:
            raise Cancelled  # the chunks done so far are complete in the cache and stay usable

    def _stopping(self) -> bool:
        return self._cancel if AGREE is None else AGREE(self, self._cancel)

    def __iter__(self) -> Iterator[Response]:
        s = self.session
        if self._started or s._turn is not self:  # a later send/retry/undo moved the conversation on
            from .session import SessionError

            raise SessionError("this turn was run already" if self._started else
                               "this turn was replaced by a later send or retry: run the latest one")
        self._started = True
        params = s.params.with_values(max_tokens=self.max_tokens)
        stream = stream_generate(
            s.loaded, self.tokens[self.reused:], params, cache=s._cache, prompt_progress=self._progress,
            prefill_step_size=CHAT_PREFILL_STEP, kv=s.kv,
        )
        broken = False
        try:
            while not self._stopping():
                try:
                    r = next(stream)
                except StopIteration:
                    break
                except Cancelled:
                    self._cancel = True
                    break
                except Exception as e:
                    # A failure (an MLX error, a sampler refusing a value): the turn is undone in _finish_turn.
                    self.error = e
                    raise
                except BaseException as e:
                    # Ctrl-C or SIGTERM inside the model call: a layer's cache may be half-updated.
                    broken = self._cancel = True
                    self.terminated = self.terminated or isinstance(e, Terminated)
                    raise
                self.text += r.text
                self.stats = r.stats
                yield r
        finally:
            # Read before close(): closing a suspended stream marks its stats "interrupted" itself.
            complete = self.stats is not None and self.stats.finish_reason in ("stop", "length")
            stream.close()
            self.interrupted = not complete and self.error is None
            if self.stats is not None and not complete:
                self.stats.finish_reason = "error" if self.error is not None else "interrupted"
            s._finish_turn(self, broken)
