"""Habits from Ollama and shells: `mlxinfer MODEL "prompt"` answers once; shell completion; examples in --help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxinfer.cli.main import _with_default_command

EXE = Path(sys.executable).parent / "mlxinfer"


@pytest.mark.parametrize("argv, expected", [
    ([], ["chat"]),
    (["qwen3-0.6b", "--temp", "0"], ["chat", "qwen3-0.6b", "--temp", "0"]),
    (["smollm2", "Why?"], ["generate", "smollm2", "-p", "Why?"]),
    (["smollm2", "Why?", "--temp", "0"], ["generate", "smollm2", "-p", "Why?", "--temp", "0"]),
    (["pull", "smollm2"], ["pull", "smollm2"]),
    (["--install-completion"], ["--install-completion"]),
])
def test_argument_forms(argv, expected):
    assert _with_default_command(argv) == expected


@pytest.mark.slow
def test_model_then_prompt_answers_once(smollm2_dir):
    proc = subprocess.run([sys.executable, "-m", "mlxinfer", "smollm2", "What is the capital of France?", "--temp",
                           "0", "--max-tokens", "12"], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "tok/s" in proc.stderr


@pytest.mark.skipif(not EXE.exists(), reason="the mlxinfer console script is not installed in this environment")
def test_bash_completion_completes_commands():
    env = {**os.environ, "_MLXINFER_COMPLETE": "complete_bash", "COMP_WORDS": "mlxinfer pu", "COMP_CWORD": "1"}
    proc = subprocess.run([str(EXE)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["pull"], (proc.stdout, proc.stderr)
    # Typer detects the parent shell unless told not to; CI runs under sh, which it does not support.
    env = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    script = subprocess.run([str(EXE), "--show-completion", "bash"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert script.returncode == 0 and "complete -o default -F _mlxinfer_completion mlxinfer" in script.stdout


@pytest.mark.parametrize("command, example", [
    ("models", "mlxinfer models --json"), ("pull", "mlxinfer pull smollm2"), ("rm", "--yes"),
    ("show", "mlxinfer show smollm2"),
])
def test_help_shows_examples(command, example):
    """The help text in this process (tests/in_process.py); `models --help` also as the real process."""
    from in_process import run_in_process

    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    proc = run_in_process(command, "--help", env=env)
    assert proc.returncode == 0 and "Examples" in proc.stdout and example in proc.stdout, proc.stdout
    if command == "models":
        real = subprocess.run([sys.executable, "-m", "mlxinfer", command, "--help"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env})
        assert real.returncode == 0 and real.stderr == "" and example in real.stdout, real.stdout
