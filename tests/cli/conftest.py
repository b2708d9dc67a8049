"""Fixtures for the chat CLI tests: an environment with private XDG dirs, and chat processes in a pty."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from chat_pty import Pty  # noqa: E402


@pytest.fixture(scope="session")
def chat_env(tmp_path_factory):
    """Environment for chat processes: private XDG dirs, one shared import cache for the whole test run."""
    root = tmp_path_factory.mktemp("chat-env")
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    env.setdefault("MLXINFER_CACHE", str(tmp_path_factory.getbasetemp() / "mlxinfer-cache"))
    env.update({
        "XDG_DATA_HOME": str(root / "data"), "XDG_STATE_HOME": str(root / "state"),
        "XDG_CONFIG_HOME": str(root / "config"), "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1",
        "COLUMNS": "140", "LINES": "40", "PYTHONUNBUFFERED": "1",
    })
    env["_ROOT"] = str(root)
    return env


@pytest.fixture
def pty(chat_env):
    opened: list[Pty] = []

    def start(*args: str, timeout: float = 60) -> Pty:
        p = Pty(list(args), chat_env, timeout)
        opened.append(p)
        return p

    yield start
    for p in opened:
        p.close()
