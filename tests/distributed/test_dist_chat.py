"""A piped chat under ``mlx.launch``: rank 0 reads the lines and broadcasts them, so prompts, slash commands and
settings reach the followers (a follower that missed ``/set max_tokens`` would keep decoding after rank 0
stopped, and the two would fall out of step); the followers print nothing; the replies equal one process's."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from dist_cli import (MLXINFER, Terminal, distributed_line, free_port_pair, launch, launch_cmd, needs_launch,
                      single, tiny_llama)

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
    assert line.startswith(f"distributed: {strategy} parallel over 2 ranks (ring), rank 0"), line
    for notice in ("set max_tokens = 5", "set seed = 11"):
        assert proc.stderr.count(notice) == 1, proc.stderr


def test_session_flag_is_refused_under_launch(tiny):
    proc = launch("chat", tiny, "--session", "notes", input="/exit\n", timeout=90)
    assert "error: --session is not available under mlx.launch" in proc.stderr
    assert proc.stderr.count("error:") == 1


def test_ctrl_c_on_rank_0_stops_the_reply_on_every_rank_and_the_chat_goes_on(tiny, tmp_path):
    """Ranks started by hand, rank 0 in a terminal of its own (a pty), so Ctrl-C reaches rank 0 only. Its SIGINT
    stops the reply at a token boundary that every rank agrees on; the next turn then runs on both ranks (with
    rank 1 a token ahead or behind, its prompt would differ and the collectives would not line up) and /exit
    ends both."""
    port = free_port_pair()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    args = [*MLXINFER, "chat", tiny, "--plain", "--temp", "0", "--max-tokens", "400"]
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLXINFER_DIST_TIMEOUT": "20"}
    follower = subprocess.Popen(args, env={**env, "MLX_RANK": "1"}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    term = Terminal(args, {**env, "MLX_RANK": "0"})
    try:
        assert term.until(lambda out: b"parallel over 2 ranks" in out, 120), bytes(term.out)
        start = len(term.out)
        term.write(b"another one\n")  # the tiny model's greedy reply: "kkkk..." (text that streams at once)
        assert term.until(lambda out: b"kkkk" in out[start:], 60), bytes(term.out)
        term.write(b"\x03")  # Ctrl-C: the tty sends SIGINT to rank 0 (its foreground process)
        assert term.until(lambda out: b"[interrupted]" in out, 30), bytes(term.out[-400:])
        mark = len(term.out)
        term.write(b"/set max_tokens 6\nanother one\n")
        # The reply (six tokens) comes and the prompt after it: the second turn ran on both ranks.
        reply = re.compile(rb"max_tokens = 6\r\n>>> [^\r\n]+\r\n>>> ")
        assert term.until(lambda out: reply.search(out[mark:]), 60), bytes(term.out[mark:])
        term.write(b"/exit\n")
        assert follower.wait(60) == 0
        assert term.wait(30) == 0, bytes(term.out[-400:])
    finally:
        if follower.poll() is None:
            follower.kill()
        term.close()
    text = bytes(term.out).decode("utf-8", "replace")
    assert text.count("[interrupted]") == 1 and "error:" not in text and "Traceback" not in text, text[-600:]


def test_ctrl_c_in_the_launchers_terminal_ends_every_rank(tiny):
    """Typed in mlx.launch's terminal, Ctrl-C reaches the launcher and every rank; the launcher stops relaying
    (its main thread ends with KeyboardInterrupt), so the ranks stop the reply together and exit 130 instead of
    waiting for input that cannot come."""
    term = Terminal(launch_cmd("chat", tiny, "--plain", "--temp", "0", "--max-tokens", "400"),
                    {**os.environ, "MLXINFER_DIST_TIMEOUT": "20"})
    try:
        assert term.until(lambda out: b"parallel over 2 ranks" in out, 120), bytes(term.out)
        start = len(term.out)
        term.write(b"another one\n")
        assert term.until(lambda out: b"kkkk" in out[start:], 60), bytes(term.out)
        term.write(b"\x03")
        assert term.wait(30) is not None, "the launcher did not end: a rank still runs"
    finally:
        term.close()
    out = bytes(term.out).decode("utf-8", "replace")
    # Both ranks end, as the launcher's threads saw them: 130 from the Ctrl-C; on a loaded machine the launcher may
    # reach a rank still unwinding with its own SIGTERM once the other has exited (-15), which is also an end.
    ends = re.findall(r"rank (\d) exited with code (-?\d+)", out)
    assert sorted(r for r, _ in ends) == ["0", "1"], out[-600:]
    assert "130" in {c for _, c in ends} and {c for _, c in ends} <= {"130", "-15"}, out[-600:]
