"""A rank killed mid-generation: the other exits within the timeout with one line naming the rank, never a hang."""

from __future__ import annotations

import os
import subprocess
import time

from dist_cli import launch_cmd, needs_launch, rank_pids, tiny_llama

pytestmark = needs_launch


def _generating(tmp_path, timeout: str) -> subprocess.Popen:
    """Two ranks generating from a tiny llama under mlx.launch, returned once their output has begun."""
    cmd = launch_cmd("generate", tiny_llama(tmp_path / "m"), "--raw", "-p", "tell me", "--temp", "1", "--seed", "3",
                     "--max-tokens", "480")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, "MLXINFER_DIST_TIMEOUT": timeout})
    os.set_blocking(proc.stdout.fileno(), False)
    out, start = b"", time.monotonic()
    while len(out) < 8 and time.monotonic() - start < 120 and proc.poll() is None:
        out += proc.stdout.read() or b""
        time.sleep(0.05)
    if len(out) < 8:
        proc.kill()
        proc.communicate()
        raise AssertionError("generation never started")
    return proc


def test_killing_a_rank_mid_generation_ends_the_other_with_one_line(tmp_path):
    proc = _generating(tmp_path, timeout="20")
    try:
        victims = rank_pids(proc.pid, 1)
        assert victims, "rank 1 not found"
        for pid in victims:
            os.kill(pid, 9)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 30  # within the timeout, not a hang
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = err.decode("utf-8", "replace")
    assert "Node with rank 1 exited with code -9" in err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    # Usually mlx.launch's SIGTERM comes first ("stopped: rank 1 ended"); the ring's own error ("lost rank 1")
    # may win the race. Either way: one line, naming rank 1.
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 of 2 ") and "rank 1" in errors[0][20:], err
    assert "Traceback" not in err


def test_watchdog_ends_a_rank_whose_peer_vanished_without_a_launcher(tmp_path):
    """Ranks started by hand (no mlx.launch to send SIGTERM): rank 0 is stuck in a collective with a dead peer,
    and the watchdog ends it after MLXINFER_DIST_TIMEOUT with one line."""
    import json

    from dist_cli import MLXINFER, free_port_pair

    model = tiny_llama(tmp_path / "m")
    port = free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    args = ["generate", model, "--raw", "-p", "tell me", "--temp", "1", "--seed", "3", "--max-tokens", "480"]
    procs = [subprocess.Popen([*MLXINFER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL,
                              env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                                   "MLXINFER_DIST_TIMEOUT": "10"}) for rank in (0, 1)]
    try:
        os.set_blocking(procs[0].stdout.fileno(), False)
        out, start = b"", time.monotonic()
        while len(out) < 8 and time.monotonic() - start < 120 and procs[0].poll() is None:
            out += procs[0].stdout.read() or b""
            time.sleep(0.05)
        assert len(out) >= 8, procs[0].stderr.read() if procs[0].poll() is not None else "no output"
        procs[1].kill()
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        assert time.monotonic() - killed < 40
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    err = err.decode("utf-8", "replace")
    assert procs[0].returncode != 0
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "rank 1" in errors[0], err
    assert "Traceback" not in err


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit may wait for a reaper that never comes in a container)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_end_soon_after_their_launcher_is_killed(tmp_path):
    """kill -9 on mlx.launch: no SIGTERM reaches the ranks and nobody reads their output. Each rank sees its
    parent gone and ends within seconds, not after MLXINFER_DIST_TIMEOUT (set long here, so only that check can
    end the rank waiting in a collective)."""
    proc = _generating(tmp_path, timeout="300")
    ranks: list[int] = []
    try:
        ranks = rank_pids(proc.pid, 0) + rank_pids(proc.pid, 1)
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while any(map(_running, ranks)) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        assert not any(map(_running, ranks)), "a rank outlived its launcher"
        assert time.monotonic() - killed < 20
    finally:
        for pid in ranks:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        proc.stdout.close()
        proc.stderr.close()


def test_only_a_launcher_parent_is_watched(monkeypatch):
    """A rank started by hand (its parent a shell, perhaps under nohup to outlive it) is not ended when that
    parent goes: only mlx.launch as the parent is watched."""
    import subprocess
    import sys

    from mlxinfer.distributed import group

    assert group._launcher_pid() is None  # pytest's parent is not mlx.launch
    code = "import os; from mlxinfer.distributed.group import _launcher_pid; print(_launcher_pid(), os.getppid())"
    fake = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"
    out = subprocess.run([sys.executable, "-c", fake, "mlx.launch"], capture_output=True, text=True).stdout.split()
    assert out[0] == out[1]  # a parent whose command line names mlx.launch is


def test_ctrl_c_in_the_launchers_terminal_ends_generate_on_every_rank_with_130(smollm2_dir):
    """generate has no per-token Ctrl-C agreement (chat does): rank 0 exits 130 at once and the follower, which
    got the SIGINT too, then fails in a collective, or MLX's ring leaves it waiting on a task that never ends.
    Either way it exits 130 like rank 0, within seconds (the watchdog's grace), not 1 or after the timeout."""
    import re

    from dist_cli import Terminal

    term = Terminal(launch_cmd("generate", "smollm2", "-p", "Write a long story about a dragon.", "--max-tokens",
                               "2000"), {**os.environ, "MLXINFER_DIST_TIMEOUT": "120"})
    try:
        assert term.until(lambda out: b"parallel over 2 ranks" in out, 120), bytes(term.out)
        start = len(term.out)
        assert term.until(lambda out: len(out) - start > 40, 60), bytes(term.out)  # the story streams
        term.write(b"\x03")
        sent = time.monotonic()
        assert term.wait(60) is not None, "the launcher did not end: a rank still runs"
        assert time.monotonic() - sent < 20  # the watchdog's grace at most, never its 120 s timeout
    finally:
        term.close()
    out = bytes(term.out).decode("utf-8", "replace")
    ends = dict(re.findall(r"rank (\d) exited with code (-?\d+)", out))
    assert ends == {"0": "130", "1": "130"}, out[-800:]


def test_ranks_started_ignoring_ctrl_c_keep_ignoring_it(smollm2_dir):
    """A script's background job (``mlx.launch … &``) starts with SIGINT ignored: a Ctrl-C typed for the script
    is not for it. Rank 0's Python keeps ignoring it; so must the followers (they installed a handler anyway,
    noted "interrupted" and left after the grace, and the launcher then ended rank 0 with 143)."""
    from dist_cli import Terminal

    term = Terminal(launch_cmd("generate", "smollm2", "-p", "Write a long story about a dragon.", "--max-tokens",
                               "180"), {**os.environ, "MLXINFER_DIST_TIMEOUT": "120"}, sigint_ignored=True)
    try:
        assert term.until(lambda out: b"parallel over 2 ranks" in out, 120), bytes(term.out)
        start = len(term.out)
        assert term.until(lambda out: len(out) - start > 40, 60), bytes(term.out)
        term.write(b"\x03")
        assert term.wait(4) is None, bytes(term.out)[-800:]  # past the watchdog's 3 s grace, still generating
        assert term.wait(120) == 0, bytes(term.out)[-800:]
    finally:
        term.close()
    out = bytes(term.out).decode("utf-8", "replace")
    assert "exited with code" not in out and "error:" not in out, out[-800:]  # mlx.launch exits 0 regardless
