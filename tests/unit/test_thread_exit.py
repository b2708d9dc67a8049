"""A thread that ran MLX work must not abort the process when it exits while Python finalizes.

MLX's per-thread PRNG key is freed by a C++ thread-local destructor that takes the GIL. CPython ends a thread that
asks for the GIL during finalization (``pthread_exit``), which inside that destructor is ``std::terminate``: the
process dies with "terminate called without an active exception" (SIGABRT) after doing everything right. It hit
``mlxinfer serve`` under ``mlx.launch`` after a clean SIGTERM drain: the engine thread, joined, was still running its
thread-local destructors when the interpreter began to finalize.

The script below makes that moment certain instead of rare: the worker sleeps through the start of finalization
(held open by a slow ``__del__`` collected then) and wakes to exit.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

SCRIPT = r"""
import gc, sys, threading, time
import mlx.core as mx
from mlxinfer.engine.backend import release_thread_state

def work():
    mx.eval(mx.random.categorical(mx.zeros((4, 8))))  # this thread's PRNG key now exists
    if sys.argv[1] == "release":
        release_thread_state()
    time.sleep(0.3)  # asleep when finalization starts; wakes to exit

class SlowTeardown:
    def __del__(self, time=time):
        time.sleep(1.0)  # collected during finalization; sleeps with the GIL released

gc.disable()
cycle = [SlowTeardown()]
cycle.append(cycle)
del cycle
threading.Thread(target=work, daemon=True).start()
time.sleep(0.05)
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)


def test_release_thread_state_lets_a_thread_exit_while_python_finalizes():
    control = _run("keep")
    if control.returncode == 0:
        pytest.skip("this MLX frees its thread state without the GIL: the abort cannot happen")
    assert "terminate called" in control.stderr, control.stderr  # the failure the helper exists for
    released = _run("release")
    assert released.returncode == 0 and "terminate" not in released.stderr, released.stderr


def test_the_serve_engine_thread_releases_its_mlx_state_last(monkeypatch):
    from mlxinfer.serve import scheduler

    seen: list[tuple[str, bool]] = []

    class Probe(scheduler.Engine):
        def __init__(self):  # no model: only the thread's life is under test
            self._thread = threading.Thread(target=self._thread_main, name="mlxinfer-engine", daemon=True)
            self.ran = False

        def _run(self):
            self.ran = True
            raise RuntimeError("the loop failed")  # the state is released on every way out

    def release():
        seen.append((threading.current_thread().name, probe.ran))

    monkeypatch.setattr(scheduler, "release_thread_state", release)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    probe = Probe()
    probe._thread.start()
    probe._thread.join(10)
    assert seen == [("mlxinfer-engine", True)]
