"""Exit codes as promised, through the real CLI in a subprocess: usage errors 2 with click's usage line, output
that cannot be written 2 with one line, a broken pipe silent, undecodable argv 2, Ctrl-C 130, SIGTERM 143, never
a traceback; and the stats line stays one line when stderr is not a terminal."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import MLXINFER, assert_one_line_error, error_lines, run, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # A long context so a reply can run for as long as a signal test needs; `chatty`: greedy never samples EOS
    # and every token is a visible ASCII byte, so output starts at once (the tests stop it long before the limit).
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", chatty=True, max_position_embeddings=100_000)


@pytest.fixture
def env(tmp_path) -> dict:
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"), "MLXINFER_CACHE": str(tmp_path / "mlxcache")}


def long_reply(tiny: Path) -> list[str]:
    return [*MLXINFER, "generate", str(tiny), "-p", "hello", "--temp", "0", "-n", "90000"]


@pytest.mark.parametrize("runner, args, message", [
    (run, ("generate", "--bogus"), "No such option: --bogus"),
    # the same handler: in this process (tests/in_process.py), without a subprocess each
    (run_in_process, ("bench", "--bogus"), "No such option: --bogus"),
    (run_in_process, ("generate", "-p"), "Option '-p' requires an argument"),
    (run_in_process, ("generate", "x", "-n", "many"), "Invalid value for '--max-tokens'"),
], ids=["process-generate-bogus", "bench-bogus", "missing-value", "bad-int"])
def test_usage_errors_are_one_line_with_exit_2(env, runner, args, message):
    """click's own output is four lines (usage, a hint, a blank, the message); ours is one, as every error is."""
    proc = runner(*args, env=env)
    lines = error_lines(proc)
    assert proc.returncode == 2, lines
    command = args[0]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(f"(see: mlxinfer {command} --help)")
    assert message.lower() in lines[0].lower(), lines
    assert "Traceback" not in proc.stderr


def test_stdout_on_a_full_device_is_one_line(tiny, env):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*MLXINFER, "generate", str(tiny), "-p", "hello", "-n", "5"], stdout=full,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, timeout=120)
    assert_one_line_error(proc, "no space left on the device")


def test_stdout_closed_is_one_line(tiny, env):
    command = "exec 1>&-; exec " + shlex.join([*MLXINFER, "generate", str(tiny), "-p", "hello", "-n", "5"])
    proc = subprocess.run(["sh", "-c", command], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          env=env, timeout=120)
    assert_one_line_error(proc, "the stream is closed")


def test_a_broken_pipe_is_silent(tiny, env, tmp_path):
    """`mlxinfer generate ... | head -c 1`: head exits after one byte; mlxinfer must stop without a word."""
    err = tmp_path / "stderr"
    command = f"{shlex.join(long_reply(tiny))} 2>{shlex.quote(str(err))} | head -c 1"
    # A session of its own, so that on a timeout the whole pipeline is killed, not only the shell.
    proc = subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert len(stdout) == 1
    assert err.read_text() == ""


def test_undecodable_argv_is_one_line(env):
    proc = subprocess.run([*MLXINFER, "generate", b"ab\xffc"], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=120, errors="replace")
    assert_one_line_error(proc, r"argument 'ab\xffc' is not valid UTF-8")


def _signal_mid_reply(tiny: Path, env: dict, signum: int) -> tuple[subprocess.Popen, str, bytes]:
    """Start a long reply, send ``signum`` once its first bytes are on stdout; (process, stderr, stdout)."""
    # SIGINT back to its default in the child: a shell starts background jobs with it ignored, and Python then
    # installs no KeyboardInterrupt handler (the test would wait for a reply of 90000 tokens).
    proc = subprocess.Popen(long_reply(tiny), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read(1)))
    reader.start()
    reader.join(timeout=120)  # until the reply has begun
    try:
        assert out and out[0], "no reply within 120 s"
        first = out.pop()
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))
        reader.start()
        proc.send_signal(signum)
        proc.wait(timeout=60)
        stderr = proc.stderr.read().decode("utf-8", "replace")
    finally:
        _kill_group(proc)
        reader.join(timeout=10)
    return proc, stderr, first + b"".join(out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)


@pytest.mark.parametrize("signum, code, word", [
    (signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated"),
])
def test_signals_during_generate(tiny, env, signum, code, word):
    proc, stderr, stdout = _signal_mid_reply(tiny, env, signum)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, lines)
    assert "Traceback" not in stderr and lines == [word], lines
    assert 0 < len(stdout) < 90000  # stopped part-way, what was written stays written


def test_stats_line_is_one_line_when_stderr_is_not_a_terminal(tiny, env):
    """Rich used to wrap it at 80 columns (its default off a terminal), mid-field; with COLUMNS=30 too."""
    proc = run("generate", str(tiny), "-p", "hello", "--temp", "0", "-n", "5", env={**env, "COLUMNS": "30"})
    assert proc.returncode == 0, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, lines
    assert lines[0].startswith("5 tokens ") and " · TTFT " in lines[0] and lines[0].endswith("length"), lines
    assert len(lines[0]) > 80


if sys.platform != "linux":  # /dev/full is Linux's
    test_stdout_on_a_full_device_is_one_line = pytest.mark.skip("needs /dev/full")(
        test_stdout_on_a_full_device_is_one_line)


def test_a_usage_error_is_said_once_under_the_launcher(env):
    """mlx.launch starts every rank with the same arguments: each printed the same usage error (two lines for
    one mistake); rank 0 alone says it, every rank still exits 2."""
    for rank, said in (("0", True), ("1", False)):
        proc = subprocess.run([*MLXINFER, "generate", "--bogus"], capture_output=True, text=True, timeout=60,
                              env={**env, "MLX_RANK": rank, "MLX_HOSTFILE": "/nonexistent/hosts.json"},
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 2
        assert ("no such option: --bogus" in proc.stderr) is said, proc.stderr
