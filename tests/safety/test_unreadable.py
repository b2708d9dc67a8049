"""A file or folder the user cannot read: one line naming it and the chmod that fixes it, never "choose a path you
can write to" (every permission error said that), and convert never blames its output for a source it could not
read. As root the kernel ignores the mode bits, so the real CLI runs under setpriv without the capabilities that
override them."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
from safety_cli import MLXINFER, assert_one_line_error, write_tiny_llama


def _denied(path) -> PermissionError:
    return PermissionError(errno.EACCES, "Permission denied", str(path))


@pytest.fixture
def restore_modes():
    changed = []

    def chmod(path, mode):
        changed.append((path, os.stat(path).st_mode))
        os.chmod(path, mode)
    yield chmod
    for path, mode in reversed(changed):
        os.chmod(path, mode)


def test_a_denied_read_is_told_apart_from_a_denied_write(tmp_path, restore_modes):
    from mlxinfer.fsutil import read_failure, write_failure

    secret, closed, locked = tmp_path / "weights.gguf", tmp_path / "closed", tmp_path / "locked"
    secret.write_bytes(b"GGUF")
    closed.mkdir()
    locked.mkdir()
    restore_modes(secret, 0)
    restore_modes(closed, 0)
    restore_modes(locked, 0o555)
    assert str(read_failure(_denied(secret))) == (
        f"cannot read the file {secret}: permission denied (make it readable: chmod u+r '{secret}')")
    assert str(read_failure(_denied(closed / "config.json"))) == (
        f"cannot read the folder {closed}: permission denied (make it readable: chmod u+rx '{closed}')")
    assert read_failure(_denied(locked / "new.safetensors")) is None  # a write into a folder without w
    wrote = write_failure(_denied(locked / "x"), locked, "the converted model")
    assert "cannot write the converted model" in str(wrote)
    # a source file convert could not read is said as such, not as a failure to write its output
    assert str(write_failure(_denied(secret), locked, "the converted model")).startswith("cannot read the file")


def _as_a_user(*args: str, cwd) -> subprocess.CompletedProcess:
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root ignores file modes and setpriv is not here to drop that")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    return subprocess.run([*prefix, *MLXINFER, *args], cwd=cwd, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)


def test_the_cli_names_what_it_cannot_read(tmp_path, restore_modes):
    model = write_tiny_llama(tmp_path / "model")
    restore_modes(model / "tokenizer.json", 0)
    proc = _as_a_user("convert", str(model), "-o", "out", "--bits", "8", "--no-eval", cwd=tmp_path)
    if proc.returncode == 0 and os.geteuid() == 0:
        pytest.skip("setpriv could not take root's override away here")
    assert_one_line_error(proc, f"cannot read the file {model / 'tokenizer.json'}", "chmod u+r")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    restore_modes(model, 0)
    assert_one_line_error(_as_a_user("show", str(model), cwd=tmp_path), f"cannot read the folder {model}",
                          "chmod u+rx")
