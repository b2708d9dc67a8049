"""The process group mlxinfer runs in under ``mlx.launch``: rank, world size, backend, and the watchdog.

``setup()`` is called once by a command (chat, generate, bench) before the model loads. Outside ``mlx.launch``
it returns None and nothing changes. Inside, it joins the group, agrees on one random seed (so sampling draws
the same numbers on every rank), silences the terminal of every rank but 0 and starts a watchdog: a collective
that waits longer than the timeout (a rank died or cannot be reached) ends the process with one line instead
of a silent hang.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ..errors import MlxinferError

TIMEOUT_VAR = "MLXINFER_DIST_TIMEOUT"   # seconds a collective may wait before the watchdog ends the process
STRATEGY_VAR = "MLXINFER_PARALLEL"      # tensor | pipeline (the --pipeline flag sets pipeline)
DEFAULT_TIMEOUT = 120.0


class DistributedError(MlxinferError):
    """A rank is gone or cannot be reached, or the group cannot run this model."""


@dataclass
class World:
    group: object            # mx.distributed.Group
    rank: int
    size: int
    backend: str             # ring | jaccl | nccl | mpi
    strategy: str            # tensor | pipeline (what was asked; the plan may fall back to pipeline)
    timeout: float
    plan: dict = field(default_factory=dict)   # what the loader did: strategy, stage layers, fallbacks
    interrupted: bool = False  # a follower got SIGINT: Ctrl-C went to mlx.launch's whole group (see follow.py)
    watchdog: Optional["Watchdog"] = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def others(self) -> str:
        peers = [r for r in range(self.size) if r != self.rank]
        return f"rank {peers[0]}" if len(peers) == 1 else "one of ranks " + ", ".join(map(str, peers))


_WORLD: Optional[World] = None


RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # what each launcher tells a rank


def launched() -> bool:
    """True in a process started by ``mlx.launch`` (or by hand with MLX's rank variables)."""
    env = os.environ
    return any(k in env for k in RANK_VARIABLES) and (
        "MLX_HOSTFILE" in env or "MLX_JACCL_COORDINATOR" in env or "NCCL_HOST_IP" in env
        or "OMPI_COMM_WORLD_SIZE" in env or "MLX_IBV_DEVICES" in env)


def backend_name() -> str:
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return "jaccl"
    if "NCCL_HOST_IP" in env:
        return "nccl"
    if "MLX_HOSTFILE" in env:
        return "ring"
    return "mpi"


def current() -> Optional[World]:
    return _WORLD


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_VAR, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise DistributedError(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds", hint="e.g. 120") from None
    if not value > 0:
        raise DistributedError(f"{TIMEOUT_VAR}={raw!r} must be above 0", hint="e.g. 120")
    return value


def setup(pipeline: bool = False) -> Optional[World]:
    """Join the group when started by ``mlx.launch`` (None otherwise). Idempotent."""
    global _WORLD
    if _WORLD is not None or not launched():
        return _WORLD
    import mlx.core as mx

    strategy = "pipeline" if pipeline else os.environ.get(STRATEGY_VAR, "tensor").strip().lower() or "tensor"
    if strategy not in ("tensor", "pipeline"):
        raise DistributedError(f"{STRATEGY_VAR}={strategy!r} is not a strategy", hint="use tensor or pipeline")
    timeout = _timeout()
    name = backend_name()
    try:
        group = mx.distributed.init(strict=True, backend=name)
    except (RuntimeError, ValueError) as e:
        msg = (str(e).splitlines() or [""])[0]
        raise DistributedError(f"cannot join the {name} group: {msg}",
                               hint="check the hostfile and that every host runs the same mlxinfer") from None
    world = World(group=group, rank=group.rank(), size=group.size(), backend=name, strategy=strategy,
                  timeout=timeout)
    if not world.leader:
        silence()
        # Ctrl-C in mlx.launch's terminal reaches every rank (they share its process group): rank 0 acts for all;
        # a follower only notes it (it tells rank 0 that the launcher got it too). Started ignoring SIGINT (a
        # script's background job), it keeps ignoring it, as rank 0's Python does.
        if not sigint_ignored():
            signal.signal(signal.SIGINT, lambda _s, _f: setattr(world, "interrupted", True))
    world.watchdog = Watchdog(world)
    _stop_on_signals(world)
    _WORLD = world
    if world.size > 1:
        from .follow import broadcast_int

        # One seed for all: with a seed given the sampler reseeds anyway; without, the draws must still agree.
        seed = broadcast_int(int.from_bytes(os.urandom(4), "little") if world.leader else 0)
        mx.random.seed(seed)
    return world


def sigint_ignored() -> bool:
    """SIGINT was ignored when this process started (a non-interactive shell's ``&`` job): Ctrl-C in that
    terminal is not for it, so no handler may take it back."""
    try:
        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    except ValueError:
        return False


def silence() -> None:
    """Followers print nothing: stdout and stderr (the C++ ones too) go to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        os.dup2(devnull, fd)
    os.close(devnull)


class Watchdog:
    """Ends the process with one line when the group has made no progress for longer than the timeout.

    A forward pass beats (arms it and restarts the clock); waiting for the user (the leader at its prompt,
    followers for the leader's next line) calls ``idle()``, which disarms it until the next beat.
    """

    def __init__(self, world: World):
        self.world = world
        self._since: Optional[float] = None
        self.on_signals = True  # False when the command drains on SIGTERM itself (serve's rank 0)
        # A follower gets SIGINT only when Ctrl-C was typed in mlx.launch's terminal, which ends the run (rank 0
        # exits 130). If the main thread cannot end it (stuck in a collective whose peer is gone), the watchdog
        # does, after the grace. False where the run goes on after that Ctrl-C (serve's followers: rank 0 drains).
        self.ctrl_c_ends = True
        self._lock = threading.Lock()
        self._signals = _signal_pipe()
        # mlx.launch is a local rank's parent: when it is killed (-9) nobody reads the output or ends the ranks,
        # so a rank waiting in a collective would sit there until the timeout. Ranks started by hand (perhaps
        # under nohup, meant to outlive their shell) and remote ones (ssh hangs them up) are not watched.
        self._parent = _launcher_pid()
        self._thread = threading.Thread(target=self._watch, name="mlxinfer-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        with self._lock:
            self._since = time.monotonic()

    def idle(self) -> None:
        with self._lock:
            self._since = None

    def _watch(self) -> None:
        import select

        stopped_at, signum = None, 0
        while True:
            wait = min(1.0, self.world.timeout / 4)
            if self._signals is not None and select.select([self._signals], [], [], wait)[0]:
                got = os.read(self._signals, 64)
                term = [b for b in got if b in _STOP_SIGNALS]
                if term and stopped_at is None and self.on_signals:
                    stopped_at, signum = time.monotonic(), term[0]
                elif (_SIGINT in got and stopped_at is None and not self.world.leader and self.on_signals
                      and self.ctrl_c_ends):
                    stopped_at, signum = time.monotonic(), _SIGINT
            elif self._signals is None:
                time.sleep(wait)
            if stopped_at is not None and time.monotonic() - stopped_at > _SIGNAL_GRACE:
                # mlx.launch ends the others when a rank exits; a main thread stuck in a collective never gets to
                # run Python's handler for that signal, so the watchdog ends the process in its place.
                fail(_stopped_line(self.world), 128 + signum)
            if self._parent is not None and os.getppid() != self._parent:
                fail(f"rank {self.world.rank} of {self.world.size} stopped: the launcher that started it (pid "
                     f"{self._parent}) is gone")
            with self._lock:
                since = self._since
            if since is not None and time.monotonic() - since > self.world.timeout:
                fail(f"rank {self.world.rank} of {self.world.size} heard nothing from {self.world.others()} for "
                     f"{self.world.timeout:g} s while generating: a rank died or cannot be reached "
                     f"(raise {TIMEOUT_VAR} for slow links)")


def _launcher_pid() -> Optional[int]:
    """The parent's pid when the parent is mlx.launch (its command line names the launcher), else None."""
    ppid = os.getppid()
    if ppid <= 1:
        return None
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:  # no /proc (macOS): ask ps
        import subprocess

        try:
            command = subprocess.run(["ps", "-o", "command=", "-p", str(ppid)], capture_output=True, text=True,
                                     timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return ppid if ("mlx.launch" in command or "mlx._distributed_utils" in command) else None


_STOP_SIGNALS = {int(getattr(signal, n)) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)}  # not Ctrl-C: rank 0's
_SIGINT = int(signal.SIGINT)
_SIGNAL_GRACE = 3.0  # seconds the main thread has to handle a signal itself before the watchdog steps in


def _stopped_line(world: World) -> str:
    return (f"rank {world.rank} of {world.size} stopped: {world.others()} ended or cannot be reached "
            "(mlx.launch names its exit above)")


def _stop_on_signals(world: World) -> None:
    """mlx.launch sends SIGTERM to the other ranks when one exits: say which, once, and end at once (a rank's
    collectives cannot finish without it; under mlx.launch there is no session file to save)."""
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            try:
                signal.signal(getattr(signal, name), lambda signum, _f: fail(_stopped_line(world), 128 + signum))
            except ValueError:  # not the main thread
                return


def _signal_pipe() -> Optional[int]:
    """A pipe the C-level signal handler writes each signal number to (``signal.set_wakeup_fd``): the watchdog
    sees a SIGTERM even while the main thread is blocked in C++. None when it cannot be set (not the main thread,
    or someone else, e.g. an asyncio loop, owns the wakeup fd)."""
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)
            return None
        return r
    except (ValueError, OSError):
        return None


_FAILING = False  # set by the first fail(): whoever comes second (mlx.launch's SIGTERM, the watchdog) says nothing


def fail(line: str, code: int = 1) -> None:
    """Print one line (the leader only; followers are silent) and end the process now: the main thread may be
    blocked inside a collective that will never return. A second call while the first is ending the process
    returns at once, so a rank that lost its peer never prints a second line for the launcher's SIGTERM. A follower
    that got Ctrl-C itself exits 130 whatever ended it, as every rank does in one process."""
    global _FAILING
    if _FAILING:
        return
    _FAILING = True
    if _WORLD is not None and _WORLD.interrupted:
        # Ctrl-C ended this run (rank 0 said "interrupted"; a follower got it from the launcher's terminal): what
        # ends the process now (its peer gone, the launcher's SIGTERM while it exits) is a consequence.
        os._exit(130)
    try:
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def note_interrupted() -> None:
    """Rank 0 is ending on Ctrl-C: a SIGTERM from the launcher while it exits (a follower left first) must not
    turn its 130 into 143 with a second line."""
    if _WORLD is not None:
        _WORLD.interrupted = True


def interrupted_follower() -> bool:
    """A follower that got Ctrl-C (typed in mlx.launch's terminal): whatever error ends it now is a consequence
    (its peer gone, a kernel compiler MLX had started killed by the same SIGINT), and it exits 130 like rank 0."""
    return _WORLD is not None and not _WORLD.leader and _WORLD.interrupted


def lost_peer_line(e: BaseException) -> Optional[str]:
    """The one line for a backend error that means a peer is gone (None for any other error)."""
    world = _WORLD
    if world is None or not isinstance(e, RuntimeError):
        return None
    msg = (str(e).strip().splitlines() or [""])[0]
    if not msg.startswith(("[ring]", "[jaccl]", "[nccl]", "[mpi]")):
        return None
    return f"rank {world.rank} of {world.size} lost {world.others()}: {msg} (a rank died or the network dropped)"
