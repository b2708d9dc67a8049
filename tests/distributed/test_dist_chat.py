"""A piped chat under ``mlx.launch``: rank 0 reads the lines and broadcasts them, so prompts, slash commands and
settings reach the followers (a follower that missed ``/set max_tokens`` would keep decoding after rank 0
stopped, and the two would fall out of step); the followers print nothing; the replies equal one process's."""

from __future__ import annotations

import pytest
from dist_cli import distributed_line, launch, needs_launch, single, tiny_llama

pytestmark = needs_launch

# mlx.launch never passes the end of stdin on: a piped chat under it ends with /exit.
LINES = ("tell me a story\n/set max_tokens 5\n/set temp 1\n/set seed 11\nand another one\n/retry\n"
         "/system be brief\nthird\n/undo\n/clear\nfourth\n/exit\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_piped_chat_matches_one_process(tiny, strategy):
    args = ("chat", tiny, "--temp", "0", "--max-tokens", "16")
    ref = single(*args, input=LINES)
    assert ref.returncode == 0, ref.stderr
    proc = launch(*args, *(("--pipeline",) if strategy == "pipeline" else ()), input=LINES)
    assert "exited with code" not in proc.stderr, proc.stderr
    assert proc.stdout == ref.stdout  # every reply once: rank 1 printed nothing
    replies = ref.stdout.splitlines()
    assert len(replies) >= 5
    line = distributed_line(proc.stderr)
    assert f"{strategy} parallel over 2 ranks (ring), rank 0" in line
    for notice in ("set max_tokens = 5", "set seed = 11"):
        assert proc.stderr.count(notice) == 1, proc.stderr


def test_session_flag_is_refused_under_launch(tiny):
    proc = launch("chat", tiny, "--session", "notes", input="/exit\n", timeout=90)
    assert "error: --session is not available under mlx.launch" in proc.stderr
    assert proc.stderr.count("error:") == 1


def test_ctrl_c_on_rank_0_stops_the_reply_on_every_rank_and_the_chat_goes_on(tiny, tmp_path):
    """Ranks started by hand, rank 0 in a terminal of its own (a pty), so Ctrl-C reaches rank 0 only (under
    mlx.launch it reaches the launcher too, which stops relaying: docs/distributed.md). Rank 0's SIGINT stops the
    reply at a token boundary that every rank agrees on; the next turn then runs on both ranks (with rank 1 a
    token ahead or behind, its prompt would differ and the collectives would not line up) and /exit ends both."""
    import json
    import os
    import pty
    import re
    import select
    import subprocess
    import time

    from dist_cli import MLXINFER, free_port_pair

    port = free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    args = [*MLXINFER, "chat", tiny, "--plain", "--temp", "0", "--max-tokens", "400"]
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLXINFER_DIST_TIMEOUT": "20"}
    follower = subprocess.Popen(args, env={**env, "MLX_RANK": "1"}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid, fd = pty.fork()
    if pid == 0:  # the child: rank 0 with the pty as its terminal
        os.execve(args[0], args, {**env, "MLX_RANK": "0"})
    out = bytearray()

    def until(pred, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return True
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    out.extend(os.read(fd, 65536))
                except OSError:
                    return pred()
        return pred()

    try:
        assert until(lambda: b"parallel over 2 ranks" in out, 120), bytes(out)
        os.write(fd, b"another one\n")  # the tiny model's greedy reply: "kkkk..." (text that streams at once)
        start = len(out)
        assert until(lambda: out.count(b"kkkk", start) > 0, 60), bytes(out)  # the reply streams
        os.write(fd, b"\x03")  # Ctrl-C: the tty sends SIGINT to rank 0 (its foreground process)
        assert until(lambda: b"[interrupted]" in out, 30), bytes(out[-400:])
        mark = len(out)
        os.write(fd, b"/set max_tokens 6\nanother one\n")
        # The reply (six tokens) comes and the prompt after it: the second turn ran on both ranks.
        assert until(lambda: re.search(rb"max_tokens = 6\r\n>>> [^\r\n]+\r\n>>> ", bytes(out[mark:])), 60), \
            bytes(out[mark:])
        os.write(fd, b"/exit\n")
        assert follower.wait(60) == 0
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, bytes(out[-400:])
    finally:
        if follower.poll() is None:
            follower.kill()
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    text = bytes(out).decode("utf-8", "replace")
    assert text.count("[interrupted]") == 1 and "error:" not in text and "Traceback" not in text, text[-600:]
