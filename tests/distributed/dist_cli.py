"""Run the real CLI under ``mlx.launch -n 2 --backend ring`` on 127.0.0.1 (and alone, for the reference).

Every subprocess has a timeout, so a hang fails the test instead of blocking CI. The ring's ports come from a
free range per call, so tests (and other test runs on the machine) do not collide.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "safety"))
from safety_cli import _write_byte_tokenizer  # noqa: E402

MLXINFER = [sys.executable, "-m", "mlxinfer"]
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which("mlx.launch")
needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch (MLX's distributed launcher) is not installed")
TIMEOUT = 150


def free_port_pair() -> int:
    """A port p with p and p+1 free (the ring listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 65000:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def launch_cmd(*args: str, n: int = 2) -> list[str]:
    return [LAUNCH, "-n", str(n), "--backend", "ring", "--starting-port", str(free_port_pair()),
            "--python", sys.executable, "--", "-m", "mlxinfer", *args]


def launch(*args: str, n: int = 2, input: str = "", env: dict | None = None,
           timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``mlxinfer ARGS`` on ``n`` ranks; ``input`` goes to mlx.launch's stdin (which copies it to every rank)."""
    return subprocess.run(launch_cmd(*args, n=n), capture_output=True, text=True, errors="replace", input=input,
                          timeout=timeout, env={**os.environ, "MLXINFER_DIST_TIMEOUT": "60", **(env or {})})


def single(*args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXINFER, *args], capture_output=True, text=True, errors="replace", input=input,
                          stdin=subprocess.DEVNULL if input is None else None, timeout=timeout, env=os.environ)


def json_line(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, out  # one record: the followers printed nothing
    return json.loads(lines[0])


def distributed_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "parallel over" in ln]
    assert len(lines) == 1, err
    return lines[0]


def tiny_llama(d: Path, layers: int = 4, heads: int = 4, kv_heads: int = 2, bits: int | None = None) -> str:
    """A tiny random llama (byte tokenizer) with even head counts, so tensor parallel can shard it; ``bits``:
    quantized (group 32) like the models people run."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    d.mkdir(parents=True, exist_ok=True)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                           vocab_size=256, max_position_embeddings=512)
    mx.random.seed(1)  # with this seed neither test prompt starts with the end token
    model = llama.Model(args)
    config = vars(args)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        config = {**config, "quantization": {"group_size": 32, "bits": bits}}
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(config))
    _write_byte_tokenizer(d)
    return str(d)


def rank_pids(launcher: int, rank: int) -> list[int]:
    """Our launcher's rank processes (found by their MLX_RANK; other test runs may have their own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if b"mlxinfer" in cmd and f"MLX_RANK={rank}".encode() in env and descends(parent, launcher):
            found.append(int(pid))
    return found


def descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


class Terminal:
    """A command with a pseudo-terminal of its own (its Ctrl-C goes to its process group only).

    Ctrl-C is on by default, as in a user's terminal, whatever the test run inherited: a shell's background job
    (CI started with ``&``) ignores SIGINT, every process it starts inherits that, and a Python started so never
    installs its KeyboardInterrupt handler. ``sigint_ignored=True`` starts the command that way on purpose."""

    def __init__(self, argv: list[str], env: dict, *, sigint_ignored: bool = False):
        import pty
        import signal

        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.SIG_DFL)
            os.execve(argv[0], argv, env)
        self.out = bytearray()

    def until(self, pred, timeout: float) -> bool:
        import select
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred(bytes(self.out)):
                return True
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.out.extend(os.read(self.fd, 65536))
                except OSError:
                    break
        return pred(bytes(self.out))

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float) -> int | None:
        """The exit status (os.waitstatus_to_exitcode), or None if still running after ``timeout`` seconds."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.until(lambda _out: False, 0.2)  # keep reading so the child never blocks on a full terminal
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        return None

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)
