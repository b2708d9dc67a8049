"""mlxinfer.sources.hub against the fake Hub: downloads, cache re-use offline, and one clear error per failure."""

from __future__ import annotations

import json
import logging
import os

import pytest
from fakehub import TINY_REPO

from mlxinfer.errors import DownloadError, InvalidModel, MlxinferError, ModelNotFound
from mlxinfer.sources.hub import cached_path, download_model, hub_cache_dir

MODEL_FILES = {
    "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
}


def _downloads(hub) -> list[str]:
    return [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]


def test_download_reports_progress_and_fills_hf_home(fake_hub, hf_env, tiny_model_dir):
    calls = []
    path = download_model(TINY_REPO, progress=lambda *a: calls.append(a))

    assert path.is_relative_to(hf_env / "hub")  # HF_HOME honoured at call time
    assert {p.name for p in path.iterdir()} == MODEL_FILES
    assert (path / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    total = sum((tiny_model_dir / n).stat().st_size for n in MODEL_FILES)
    assert calls, "no progress reported"
    assert {stage for stage, _, _ in calls} == {"download"}
    assert all(t == total for _, _, t in calls)
    done = [d for _, d, _ in calls]
    assert done == sorted(done) and done[-1] == total
    assert len(calls) >= 2  # intermediate updates, not just the final one
    assert cached_path(TINY_REPO) == path


def test_only_mlx_files_are_downloaded(fake_hub, tiny_model_dir):
    files = {p.name: p for p in tiny_model_dir.iterdir()}
    files.update({
        "pytorch_model.bin": b"pickle bytes",
        "modeling_custom.py": b"raise SystemExit('remote code must never run')",
        "original/consolidated.safetensors": b"not needed",
        "consolidated.safetensors": b"a duplicate in another layout",
        "chat_template.jinja": b"{{ messages }}",
        "README.md": b"# card",
    })
    fake_hub.add_repo("org/mixed", files)
    path = download_model("org/mixed")
    assert {p.name for p in path.iterdir()} == MODEL_FILES | {"chat_template.jinja"}
    fetched = _downloads(fake_hub)
    assert not any(p.endswith((".bin", ".py", ".md", "consolidated.safetensors")) for p in fetched)


def test_second_run_offline_is_served_from_cache_without_requests(fake_hub, monkeypatch):
    first = download_model(TINY_REPO)
    fake_hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []
    assert download_model(TINY_REPO, progress=lambda *a: calls.append(a)) == first
    assert fake_hub.requests == [] and calls == []


def test_server_stopped_falls_back_to_cache(fake_hub):
    first = download_model(TINY_REPO, "v1")
    fake_hub.stop()  # connection refused from now on
    fake_hub.requests.clear()
    assert download_model(TINY_REPO, "v1") == first
    assert fake_hub.requests == []
    assert cached_path(TINY_REPO, "v1") == first
    assert cached_path(TINY_REPO) is None  # main was never downloaded


def test_hub_outage_uses_cache_or_says_it_cannot_reach_the_hub(fake_hub):
    first = download_model(TINY_REPO)
    fake_hub.status = 503
    assert download_model(TINY_REPO) == first
    with pytest.raises(DownloadError, match=r"org/other is not in the local cache .*answered HTTP 503"):
        download_model("org/other")


def test_revisions_are_separate_snapshots(fake_hub):
    main = download_model(TINY_REPO)
    v1 = download_model(TINY_REPO, "v1")
    assert main != v1 and main.parent == v1.parent
    assert (hub_cache_dir() / f"models--{TINY_REPO.replace('/', '--')}" / "refs" / "v1").read_text() == v1.name
    commit = download_model(TINY_REPO, v1.name)  # a commit hash is a revision too
    assert commit == v1


def test_cached_download_still_reports_completion(fake_hub):
    download_model(TINY_REPO)
    calls = []
    download_model(TINY_REPO, progress=lambda *a: calls.append(a))
    assert len(calls) == 1 and calls[0][1] == calls[0][2] > 0


def test_repo_not_found(fake_hub):
    with pytest.raises(ModelNotFound, match=r"Hub repo 'org/nope' not found at http://127\.0\.0\.1") as e:
        download_model("org/nope")
    assert "hf auth login" in str(e.value) and "\n" not in str(e.value)
    assert not (hub_cache_dir() / "models--org--nope").exists()  # nothing partial on disk


def test_revision_not_found(fake_hub):
    with pytest.raises(ModelNotFound, match=r"revision 'no-such-branch' not found in Hub repo 'mlx-test/tiny"):
        download_model(TINY_REPO, "no-such-branch")


def test_file_listed_but_missing(fake_hub, tiny_model_dir):
    fake_hub.add_model_dir("org/broken", tiny_model_dir, missing=("tokenizer.json",))
    with pytest.raises(DownloadError, match=r"org/broken: file 'tokenizer.json' is listed by the Hub but cannot be"):
        download_model("org/broken")
    assert cached_path("org/broken") is None  # the partial snapshot never counts as on disk


def test_connection_lost_mid_download_is_one_quiet_error(fake_hub, tiny_model_dir, caplog):
    fake_hub.add_model_dir("org/flaky", tiny_model_dir, dropped=("model.safetensors",))
    with pytest.raises(DownloadError, match=r"download of org/flaky failed: the connection dropped during the "
                                             r"download \(.*\)"):  # (it said "the Hub cannot be reached")
        download_model("org/flaky")  # huggingface_hub retries with resume a few times first (~5 s)
    # Its "Trying to resume download..." warnings would reach the terminal through its own stderr handler.
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub") and r.levelno >= logging.WARNING]
    assert cached_path("org/flaky") is None


def test_pickle_only_repo_is_refused_before_download(fake_hub):
    fake_hub.add_repo("org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04pickle"})
    with pytest.raises(MlxinferError, match=r"has only pickle weights \(pytorch_model\.bin\).*'mlxinfer convert'") as e:
        download_model("org/pickled")
    assert not isinstance(e.value, (ModelNotFound, DownloadError))
    assert _downloads(fake_hub) == [] and not (hub_cache_dir() / "models--org--pickled").exists()


@pytest.mark.parametrize(
    "files, message",
    [
        ({"model.safetensors": b"x", "tokenizer.json": b"{}"}, r"org/bad has no config\.json"),
        ({"config.json": b"{}", "README.md": b"hi"}, r"org/bad has no model\*\.safetensors weights"),
        ({"config.json": b"{}", "consolidated.safetensors": b"x"}, r"org/bad has no model\*\.safetensors weights"),
        ({"config.json": b"{}", "model-Q4_K_M.gguf": b"GGUF"}, r"org/bad has GGUF files but no safetensors"),
    ],
)
def test_repo_without_config_or_weights_is_invalid(fake_hub, files, message):
    fake_hub.add_repo("org/bad", files)
    with pytest.raises(InvalidModel, match=message):
        download_model("org/bad")
    assert _downloads(fake_hub) == []


def test_gated_repo_suggests_login_and_accepts_hf_token(fake_hub, tiny_model_dir, monkeypatch):
    repo = fake_hub.add_model_dir("org/gated", tiny_model_dir, gated=True)
    with pytest.raises(DownloadError, match=r"'org/gated' is gated.*hf auth login.*HF_TOKEN"):
        download_model("org/gated")
    monkeypatch.setenv("HF_TOKEN", repo.token)
    assert (download_model("org/gated") / "config.json").is_file()


def test_token_saved_under_hf_home_is_used(fake_hub, tiny_model_dir, hf_env):
    repo = fake_hub.add_model_dir("org/gated", tiny_model_dir, gated=True)
    hf_env.mkdir(parents=True, exist_ok=True)
    (hf_env / "token").write_text(repo.token + "\n")  # what 'hf auth login' writes
    assert (download_model("org/gated") / "config.json").is_file()


def test_refused_network_with_empty_cache(hf_env, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(DownloadError) as e:
        download_model("org/never-downloaded")
    msg = str(e.value)
    assert msg.startswith("org/never-downloaded is not in the local cache and the Hub cannot be reached (")
    assert f"127.0.0.1:{port}" in msg and msg.endswith("connect once or set HF_ENDPOINT")
    assert cached_path("org/never-downloaded") is None


def test_offline_with_empty_cache(hf_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"not in the local cache .*\(HF_HUB_OFFLINE is set\)"):
        download_model("org/never-downloaded")


def test_incomplete_cache_offline_is_reported(fake_hub, monkeypatch):
    path = download_model(TINY_REPO)
    os.remove(path / "tokenizer.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"cached copy of mlx-test/tiny-llama-4bit is incomplete"):
        download_model(TINY_REPO)
    assert cached_path(TINY_REPO) is None


def test_invalid_repo_id():
    with pytest.raises(ModelNotFound, match="not a valid Hub repo id"):
        download_model("org/bad name!")


def test_hf_endpoint_is_read_per_call(fake_hub, monkeypatch, tiny_model_dir):
    from fakehub import FakeHub

    other = FakeHub()
    other.add_model_dir("org/elsewhere", tiny_model_dir)
    other.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", other.endpoint)
        assert json.loads((download_model("org/elsewhere") / "config.json").read_text())["vocab_size"] == 49152
        assert fake_hub.requests == [] and other.requests
    finally:
        other.stop()
