"""``convert -o`` pointed where a careless hand points it: nothing is ever lost.

Empty, ``.``, the current directory, home, ``/``, the source and any folder around or inside it are refused
with ``--force`` too; ``--force`` replaces only a directory of model files and names what would have been lost
otherwise; a path below a file, in /proc or on a read-only file system gets one line naming that. Every case runs
the CLI (the 22 refused -o values in this process, the others as a real process) and checks that the files it
could have touched are byte for byte as before."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, run, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (content) and folder (None) below ``root``."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def world(tmp_path, tiny):
    """A working directory with the user's files, a home with files, and a copy of the tiny model inside a
    project folder: the places a bad -o could destroy."""
    work, home, project = tmp_path / "work", tmp_path / "home", tmp_path / "project"
    for d, name in ((work, "notes.txt"), (home, ".bashrc"), (project, "plan.md")):
        d.mkdir()
        (d / name).write_text(f"precious {name}\n")
    shutil.copytree(tiny, project / "model")
    return {"work": work, "home": home, "project": project, "source": project / "model", "root": tmp_path}


def _convert(world, out: str, *extra: str, source: Path | None = None, runner=run) -> subprocess.CompletedProcess:
    return runner("convert", str(source or world["source"]), "-o", out, "--bits", "4", "--no-eval", *extra,
               cwd=world["work"], env={"HOME": str(world["home"])})


REFUSED = {
    # name: (-o relative to the world, needles in the one line)
    "empty": (lambda w: "", ["-o is empty"]),
    "dot": (lambda w: ".", ["current directory"]),
    "cwd absolute": (lambda w: str(w["work"]), ["current directory"]),
    "cwd parent": (lambda w: "..", ["holds the current directory"]),
    "home tilde": (lambda w: "~", ["home directory"]),
    "home absolute": (lambda w: str(w["home"]) + "/", ["home directory"]),
    "root": (lambda w: "/", ["root directory"]),
    "the source": (lambda w: str(w["source"]), ["the source itself"]),
    "the source's parent": (lambda w: str(w["project"]), ["holds the source"]),
    "inside the source": (lambda w: str(w["source"] / "sub"), ["inside the source"]),
    "a symlink to the source": (lambda w: _link(w, w["source"]), ["the source itself"]),
}


def _link(world, target: Path) -> str:
    link = world["root"] / "link"
    link.symlink_to(target)
    return str(link)


@pytest.mark.parametrize("force", [True, False], ids=["force", "noforce"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_dangerous_outputs_are_refused(world, case, force):
    out_of, needles = REFUSED[case]
    before = snapshot(world["root"])
    # Refused before any work: the CLI runs in this process (tests/in_process.py), the cases below in a real one.
    proc = _convert(world, out_of(world), *(["--force"] if force else []), runner=run_in_process)
    assert_one_line_error(proc, *needles)
    after = snapshot(world["root"])
    after.pop("link", None)
    before.pop("link", None)
    assert after == before  # nothing lost, nothing half-written


def test_gguf_source_folder_is_refused(world, tmp_path):
    """The folder holding a .gguf source is the source's parent too."""
    gguf = world["project"] / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    before = snapshot(world["root"])
    proc = _convert(world, str(world["project"]), "--force", source=gguf)
    assert_one_line_error(proc, "holds the source")
    assert snapshot(world["root"]) == before


def test_force_refuses_a_directory_with_other_files(world):
    out = world["root"] / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "train.py").write_text("print(1)")
    before = snapshot(world["root"])
    proc = _convert(world, str(out), "--force")
    line = assert_one_line_error(proc, "3 entries that are not model files", "data/", "notes.txt", "train.py")
    assert "choose another -o" in line
    assert snapshot(world["root"]) == before


def test_force_replaces_a_previous_model_output(world):
    """The positive case: a directory holding only model files (a previous conversion) is replaced."""
    out = world["root"] / "out"
    first = _convert(world, str(out))
    assert first.returncode == 0, first.stderr
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    again = _convert(world, str(out))
    assert_one_line_error(again, "already exists", "--force")
    replaced = _convert(world, str(out), "--force", "--bits", "8")
    assert replaced.returncode == 0, replaced.stderr
    assert '"bits": 8' in (out / "config.json").read_text()
    assert not [p for p in world["root"].iterdir() if p.name.startswith(".out.")]


def test_output_below_a_file(world):
    (world["work"] / "file.txt").write_text("x")
    before = snapshot(world["root"])
    proc = _convert(world, str(world["work"] / "file.txt" / "out"))
    assert_one_line_error(proc, "file.txt is a file, not a directory")
    assert snapshot(world["root"]) == before


def test_output_in_proc(world):
    proc = _convert(world, "/proc/mlxinfer-out")
    line = assert_one_line_error(proc, "virtual file system")
    assert "disk space" not in line


def _mount_read_only(where: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
                        capture_output=True).returncode == 0
    return ok


def test_output_on_a_read_only_file_system(world):
    ro = world["root"] / "ro"
    if not _mount_read_only(ro):
        pytest.skip("needs root and mount to make a read-only file system")
    try:
        proc = _convert(world, str(ro / "out"))
        assert_one_line_error(proc, "read-only file system")
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
