"""What mlxinfer writes gets the permissions any tool's files get (the umask's), not the owner-only modes of its
temp files (mkdtemp 0700, mkstemp 0600): a converted model another user or a service could not read. Chat sessions
stay owner-only: they hold conversations."""

from __future__ import annotations

import os
import stat

import pytest

from mlxinfer.fsutil import AtomicDir, atomic_write_text, current_umask


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_reads_without_changing_it(umask_027):
    assert current_umask() == 0o027 and current_umask() == 0o027


def test_published_directories_and_text_files_follow_the_umask(tmp_path, umask_027):
    with AtomicDir(tmp_path / "model") as d:
        (d.path / "config.json").write_text("{}")
        d.publish()
    assert _mode(tmp_path / "model") == 0o750
    atomic_write_text(tmp_path / "report.json", "{}")
    assert _mode(tmp_path / "report.json") == 0o640
    atomic_write_text(tmp_path / "session.json", "{}", private=True)
    assert _mode(tmp_path / "session.json") == 0o600


def test_an_alias_keeps_the_mode_of_models_toml(tmp_path, umask_027):
    from mlxinfer.convert.card import add_alias

    user = tmp_path / "models.toml"
    add_alias("first", tmp_path, user_file=user)
    assert _mode(user) == 0o640
    os.chmod(user, 0o644)
    add_alias("second", tmp_path, user_file=user)
    assert _mode(user) == 0o644 and "[models.second]" in user.read_text()
