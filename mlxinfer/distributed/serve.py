"""``mlxinfer serve`` under ``mlx.launch``: rank 0 owns the HTTP port and the scheduler's decisions; the other
ranks replay them, so every rank runs the same model calls in the same order.

The scheduler (``serve.scheduler.Engine``) is deterministic once three things are fixed: which requests join
(and their prompt tokens and settings), which ones leave early (client gone, deadline passed), and when it stops.
Everything else — prefix-cache hits, prefill chunks, joining and leaving the batch, sampling (one seed for all
ranks), stop strings, token budgets — follows from those and the tokens, and every rank computes the same tokens
(tensor parallel all-reduces, pipeline parallel all-gathers the last stage's output). So at the start of each
engine round rank 0 broadcasts one message: empty (one 4-byte collective) when nothing changed, else the joining
jobs and the indices of the sequences leaving, as JSON; or "stop". Followers run the same ``Engine`` on those
messages with tickets that go nowhere.

Idle ticks: a rank waiting inside a collective spins a core (MLX's ring polls its sockets), so an idle server
does not wait in one. Rank 0 sends an empty round every ``IDLE_TICK`` seconds while there is no work and the
followers sleep in between; a request arriving when idle starts at the next tick (adds at most that much to its
first token), and a follower that died is noticed within the watchdog's timeout even with no request running.

One model call per evaluation: several sequences decode as one batched forward pass from two sequences on
(``batch_from`` at most 2), because separate per-sequence graphs evaluated together could order a pipeline's
sends and all-gathers differently on different ranks.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from ..serve.scheduler import Engine
from ..serve.schemas import ApiError, Job
from ..serve.sequence import Ticket
from .follow import broadcast_text
from .group import current, fail, lost_peer_line

IDLE_TICK = 0.1  # seconds between two empty rounds while no request runs


def _job_dict(job: Job) -> dict:
    return {"kind": job.kind, "prompt": list(job.prompt), "params": asdict(job.params),
            "max_tokens": job.max_tokens, "stop": list(job.stop), "logprobs": job.logprobs}


def _job(d: dict) -> Job:
    from ..engine.sampling import SamplingParams

    return Job(d["kind"], d["prompt"], SamplingParams(**d["params"]), d["max_tokens"], d["stop"], d["logprobs"])


class _Nowhere(Ticket):
    """A follower's copy of a request: same job, no client to tell."""

    def __init__(self, job: Job):
        super().__init__(job, None, None)

    def push(self, event: tuple) -> None:
        pass


class _Shared(Engine):
    """What leader and followers share: applying a round's decisions, then the same steps."""

    def __init__(self, loaded, metrics, **kw):
        kw["batch_from"] = min(kw.get("batch_from", 4), 2)  # one forward pass per step (see module docstring)
        super().__init__(loaded, metrics, **kw)
        self.world = current()

    def _drop(self, prefilling: list[int], batch: list[int]) -> None:
        for s in [self._prefilling[i] for i in prefilling]:
            self._prefilling.remove(s)
            self._finish(s, None)
        if batch:
            self._leave(batch, {i: None for i in batch})

    def _steps(self) -> None:
        try:
            if self._prefilling:
                self._prefill_step()
            if self._batch:
                self._decode_step()
        except Exception as e:  # noqa: BLE001 - as the one-process engine: the step's requests fail, not the server
            if lost_peer_line(e) is not None:
                raise
            self._fail_all(e)


class LeaderEngine(_Shared):
    """Rank 0's engine: the usual scheduler, whose decisions are broadcast at the start of every round."""

    def _run(self) -> None:
        try:
            self._lead()
        except Exception as e:  # noqa: BLE001 - a rank is gone: answer 503, then end the group with one line
            line = lost_peer_line(e)
            if line is None:
                line = f"rank 0 of {self.world.size}: internal error in the serving loop: {type(e).__name__}: {e}"
            self._lost(line)

    def _lead(self) -> None:
        watchdog = self.world.watchdog
        while True:
            with self._cond:
                if not (self._stopping or self._waiting or self._prefilling or self._batch):
                    watchdog.idle()  # no request: waiting is not a hang
                    self._cond.wait(IDLE_TICK)
                stopping = self._stopping
                new = []
                while self._waiting and len(self._prefilling) + len(self._batch) + len(new) < self.parallel:
                    new.append(self._waiting.popleft())
                expired = self._expired_waiting()
                self.metrics.queue_depth.set(len(self._waiting))
            watchdog.beat()
            if stopping:
                broadcast_text(None)
                break
            for t in expired:
                t.push(("error", self._ended_error(queued=True)))
            now = time.perf_counter()  # rank 0's call, sent to the others: the scheduler's own reaping rule
            drop = ([i for i, s in enumerate(self._prefilling) if self._gone(s, now)],
                    [i for i, s in enumerate(self._batch) if self._gone(s, now)])
            self._drop(*drop)
            joined = []
            for t in new:
                before = len(self._prefilling)
                try:
                    self._admit(t)  # skips a ticket cancelled meanwhile: only what joined is sent
                except Exception as e:  # noqa: BLE001 - as the one-process engine: this request fails
                    t.push(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}")))
                if len(self._prefilling) > before:
                    joined.append(_job_dict(t.job))
            msg = json.dumps({"drop": drop, "join": joined}) if joined or drop[0] or drop[1] else ""
            broadcast_text(msg)
            self._steps()
        self._fail_all(None)

    def _lost(self, line: str) -> None:
        """The clients of running and queued requests get a 503 naming the cause; then the process ends."""
        self.draining = True
        err = ApiError(503, line, code="rank_lost")
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        for s in [*self._prefilling, *self._batch]:
            s.ticket.push(("error", err))
        for t in waiting:
            t.push(("error", err))
        time.sleep(1.0)  # time for the HTTP side to send them
        fail(line)


class FollowerEngine(_Shared):
    """A follower's engine: no port, no queue; it runs rank 0's rounds until rank 0 says stop."""

    def follow(self) -> None:
        """Run in the main thread until rank 0 stops (its SIGTERM/Ctrl-C drain): then return (exit 0)."""
        watchdog = self.world.watchdog
        while True:
            if not (self._prefilling or self._batch):
                watchdog.idle()
            msg = broadcast_text(None)
            if msg is None:
                break
            if msg:
                plan = json.loads(msg)
                self._drop(*plan["drop"])
                for d in plan["join"]:
                    self._admit(_Nowhere(_job(d)))
            elif not (self._prefilling or self._batch):
                time.sleep(IDLE_TICK)  # an idle tick: rank 0 waits as long before the next round
                continue
            self._steps()
        self._fail_all(None)
