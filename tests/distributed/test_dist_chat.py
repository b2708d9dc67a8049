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
