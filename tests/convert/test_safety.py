"""Atomic output, --force, disk check, refusing pickle and remote code, --alias, the CLI, a fake-Hub source."""

from __future__ import annotations

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from mlxinfer.convert import ConvertOptions, InsufficientDisk, OutputExists, PickleRefused, convert
from mlxinfer.errors import InvalidModel, InvalidParameter


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_write_leaves_nothing(llama_src, tmp_path, exc):
    seen = []

    def boom(name: str) -> None:
        seen.append(name)
        if len(seen) == 20:
            raise exc("injected")

    with pytest.raises(exc):
        convert(str(llama_src), tmp_path / "out", ConvertOptions(bits=4, shard_bytes=20_000, eval=False),
                after_tensor=boom)
    assert len(seen) == 20  # it failed after several shards had been written
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_existing_output_is_never_touched_without_force(llama_src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")  # a model card: what --force may replace
    with pytest.raises(OutputExists, match="--force"):
        convert(str(llama_src), out, ConvertOptions(bits=4, eval=False))
    assert [p.name for p in out.iterdir()] == ["README.md"]
    # a failing --force run leaves the old directory as it was
    with pytest.raises(RuntimeError):
        convert(str(llama_src), out, ConvertOptions(bits=4, eval=False, force=True),
                after_tensor=lambda name: (_ for _ in ()).throw(RuntimeError("injected")))
    assert [p.name for p in out.iterdir()] == ["README.md"]
    r = convert(str(llama_src), out, ConvertOptions(bits=4, eval=False, force=True))
    assert (out / "README.md").read_text() != "mine" and (out / "config.json").exists() and r.out_dir == out
    # a file that is not part of a model: --force refuses and names it, nothing is touched
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExists, match=r"1 entry that is not a model file \(keep.txt\)"):
        convert(str(llama_src), out, ConvertOptions(bits=8, eval=False, force=True))
    assert (out / "keep.txt").read_text() == "mine" and (out / "config.json").exists()
    (out / "keep.txt").unlink()
    # not even with --force may the output be the source itself
    with pytest.raises(OutputExists, match="the source itself"):
        convert(str(out), out, ConvertOptions(dequantize=True, force=True))
    assert (out / "config.json").exists()
    assert _leftovers(tmp_path, "out") == []


def test_disk_space_is_checked_first(llama_src, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(InsufficientDisk, match="GB needed"):
        convert(str(llama_src), tmp_path / "out", ConvertOptions(bits=4, eval=False))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_pickle_checkpoints_are_refused(llama_src, tmp_path):
    src = tmp_path / "pt"
    src.mkdir()
    shutil.copy(llama_src / "config.json", src / "config.json")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(PickleRefused, match="never loads pickle"):
        convert(str(src), tmp_path / "out")
    with pytest.raises(PickleRefused):
        convert(str(src / "pytorch_model.bin"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_remote_code_is_refused(llama_src, tmp_path):
    src = tmp_path / "remote"
    shutil.copytree(llama_src, src)
    config = json.loads((src / "config.json").read_text())
    (src / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
    config.update(model_type="custom_thing", auto_map={"AutoModelForCausalLM": "modeling_custom.Custom"})
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidModel, match="remote code"):
        convert(str(src), tmp_path / "out")
    config.update(model_type="llama", model_file="modeling_custom.py")
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidModel, match="never runs code"):
        convert(str(src), tmp_path / "out")


def test_python_files_are_not_copied(llama_src, tmp_path):
    src = tmp_path / "withpy"
    shutil.copytree(llama_src, src)
    (src / "modeling_extra.py").write_text("x = 1\n")
    r = convert(str(src), tmp_path / "out", ConvertOptions(bits=8, eval=False))
    assert not list(r.out_dir.glob("*.py"))


@pytest.mark.parametrize("opts, match", [
    (dict(bits=7), r"^7 bits is not supported"),
    (dict(bits=0), r"--bits 0 is not supported"),
    (dict(bits=8, group_size=0), r"--group-size 0 is not supported"),
    (dict(recipe="mixed_4_6", bits=8), r"--recipe mixed_4_6 keeps its sensitive layers at 6 bits: --bits 8"),
    (dict(group_size=48), "group size 48"),
    (dict(mode="mxfp4", bits=8), "mxfp4.*needs 4 bits"),
    (dict(mode="nonsense"), "not supported by this MLX"),
    (dict(recipe="mixed_9_9"), "unknown recipe"),
    (dict(recipe="rules/nope.toml"), "the recipe file rules/nope.toml does not exist"),  # was "unknown recipe"
    (dict(bits=4, dequantize=True), "cannot be combined"),
    (dict(dequantize=True, requantize=True), "--requantize cannot be combined with --dequantize"),
    (dict(bits=8, revision="main"), "--revision main applies to Hub sources only"),
    (dict(dtype="float64"), "float64"),
    (dict(bits=8, alias=""), r"^--alias is empty"),  # was skipped: converted, no alias added, exit 0
])
def test_bad_options_fail_before_any_work(llama_src, tmp_path, opts, match):
    with pytest.raises(InvalidParameter, match=match):
        convert(str(llama_src), tmp_path / "out", ConvertOptions(**opts))
    assert list(tmp_path.iterdir()) == []


def test_revision_given_twice_must_agree(tmp_path, monkeypatch):
    """org/name@v1 --revision main used main without a word."""
    from mlxinfer.sources import hub

    fetched = []
    monkeypatch.setattr(hub, "download_model", lambda repo, rev, **k: fetched.append(rev) or 1 / 0)
    with pytest.raises(InvalidParameter, match=r"^mlx-test/tiny@v1 names revision v1 and --revision names main"):
        convert("mlx-test/tiny@v1", tmp_path / "out", ConvertOptions(dequantize=True, revision="main"))
    assert fetched == [] and list(tmp_path.iterdir()) == []
    with pytest.raises(ZeroDivisionError):  # the same revision twice is no conflict
        convert("mlx-test/tiny@v1", tmp_path / "out", ConvertOptions(dequantize=True, revision="v1"))
    assert fetched == ["v1"]


def test_dequantize_needs_a_quantized_source(llama_src, tmp_path):
    with pytest.raises(InvalidParameter, match="not quantized"):
        convert(str(llama_src), tmp_path / "out", ConvertOptions(dequantize=True))
    assert list(tmp_path.iterdir()) == []


def test_mxfp4_mode(llama_src, tmp_path):
    from mlxinfer.convert.recipes import available_modes

    if "mxfp4" not in available_modes():
        pytest.skip("this MLX has no mxfp4")
    r = convert(str(llama_src), tmp_path / "out", ConvertOptions(mode="mxfp4", eval_tokens=128))
    q = json.loads((r.out_dir / "config.json").read_text())["quantization"]
    assert q == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert r.quality.kl_mean < 3.0
    # a mixed recipe over mxfp4: the 6-bit layers cannot be mxfp4 and use affine; mlx-lm loads the mix
    r = convert(str(llama_src), tmp_path / "mix", ConvertOptions(recipe="mixed_4_6", mode="mxfp4", eval=False))
    q = json.loads((r.out_dir / "config.json").read_text())["quantization"]
    assert q["mode"] == "mxfp4" and q["lm_head"] == {"group_size": 64, "bits": 6, "mode": "affine"}
    from mlx_lm import load

    model, _ = load(str(r.out_dir))
    modes = {p: m.mode for p, m in model.named_modules() if hasattr(m, "mode")}
    assert modes["lm_head"] == "affine" and modes["model.layers.1.self_attn.q_proj"] == "mxfp4"


def test_cli_convert_alias_and_errors(llama_src, tmp_path, monkeypatch, capsys):
    from mlxinfer.cli.main import main
    from mlxinfer.registry import Registry

    user = tmp_path / "models.toml"
    user.write_text("# my models\n[models.other]\nhub = \"org/other\"  # keep me\n")
    monkeypatch.setenv("MLXINFER_MODELS", str(user))
    out = tmp_path / "conv"
    rc = main(["convert", str(llama_src), "-o", str(out), "--recipe", "mixed_4_6", "--eval-tokens", "64",
               "--alias", "tiny4", "--shard-size", "100KB"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "bits per weight" in captured.out and "KL divergence" in captured.out and "tiny4" in captured.out
    text = user.read_text()
    assert text.startswith("# my models\n[models.other]\nhub = \"org/other\"  # keep me\n")
    reg = Registry.load()
    assert reg.resolve("tiny4").path == out and reg.resolve("other").repo == "org/other"
    # an existing alias or output is refused (exit 2, one line), and --force replaces both
    rc = main(["convert", str(llama_src), "-o", str(tmp_path / "conv2"), "--bits", "8", "--no-eval",
               "--alias", "tiny4"])
    assert rc == 2 and "already exists" in capsys.readouterr().err
    assert not (tmp_path / "conv2").exists()
    rc = main(["convert", str(llama_src), "-o", str(out), "--bits", "8", "--no-eval"])
    assert rc == 2 and "--force" in capsys.readouterr().err
    rc = main(["convert", str(llama_src), "-o", str(tmp_path / "conv2"), "--bits", "8", "--no-eval",
               "--alias", "tiny4", "--force"])
    assert rc == 0
    assert Registry.load().resolve("tiny4").path == tmp_path / "conv2"
    assert user.read_text().count("[models.tiny4]") == 1
    # the alias is a source too: converting it again works through the registry
    rc = main(["convert", "tiny4", "-o", str(tmp_path / "conv3"), "--dequantize", "--no-eval"])
    assert rc == 0, capsys.readouterr().err
    import mlxinfer

    assert mlxinfer.load("tiny4", kernels="builtin").quantization.startswith("8-bit")


def test_alias_file_that_cannot_be_written_is_refused_before_converting(llama_src, tmp_path, monkeypatch, capsys):
    """A read-only config folder: the model was converted, then the alias failed (exit 2) and the output stayed,
    so a rerun said "already exists". Now it is checked first. (os.access is faked: root writes anywhere.)"""
    import os

    from mlxinfer.cli.main import main
    from mlxinfer.convert import card

    config = tmp_path / "config"
    config.mkdir()
    monkeypatch.setenv("MLXINFER_MODELS", str(config / "mlxinfer" / "models.toml"))  # its folder not made yet
    real = os.access
    monkeypatch.setattr(card.os, "access", lambda p, mode: False if Path(p) == config else real(p, mode))
    rc = main(["convert", str(llama_src), "-o", str(tmp_path / "out"), "--bits", "8", "--no-eval", "--alias", "ro"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: cannot add alias 'ro': {config} is not writable (for "
                               f"{config / 'mlxinfer' / 'models.toml'}) (drop --alias, or set MLXINFER_MODELS "
                               "to a file in a writable folder)"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config"]


def test_fake_hub_source(llama_src, tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent.parent / "hub"))
    fakehub = pytest.importorskip("fakehub")
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = fakehub.FakeHub()
    files = {p.name: p for p in llama_src.iterdir()}
    files["pytorch_model.bin"] = b"pickle bytes that must never be downloaded"
    files["modeling_x.py"] = b"raise SystemExit"
    repo = hub.add_repo("org/tiny-llama", files, revisions=("main",))
    hub.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    try:
        r = convert("org/tiny-llama", tmp_path / "out", ConvertOptions(bits=4, eval_tokens=64))
    finally:
        hub.stop()
    sha = repo.revisions["main"]
    assert r.source.repo == "org/tiny-llama" and r.source.revision == sha
    config = json.loads((r.out_dir / "config.json").read_text())
    assert config["mlxinfer"]["converted"]["revision"] == sha
    card = (r.out_dir / "README.md").read_text()
    assert "base_model: org/tiny-llama" in card and sha in card
    fetched = {p.rsplit("/", 1)[-1] for m, p in hub.requests if "/resolve/" in p}
    assert "pytorch_model.bin" not in fetched and "modeling_x.py" not in fetched


def test_a_source_without_tokenizer_files_is_refused_before_writing(llama_src, tmp_path):
    """It converted with exit 0 into a model that `generate` could not load."""
    src = tmp_path / "notok"
    shutil.copytree(llama_src, src)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink()
    with pytest.raises(InvalidModel, match="has no tokenizer files") as err:
        convert(str(src), tmp_path / "out", ConvertOptions(bits=4, eval_tokens=16))
    assert "\n" not in str(err.value) and err.value.hint
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_quality_check_failure(llama_src, tmp_path, monkeypatch):
    import mlxinfer.engine.trust as trust

    def broken(*a, **k):  # transformers' own words, six lines of them
        raise ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library "
                         "serialization file, \n(2) a slow tokenizer instance to convert or \n(3) ...")

    monkeypatch.setattr(trust, "load_tokenizer", broken)
    src = llama_src
    # on by default (a small model): a failing check is a note (one line), the conversion is kept
    r = convert(str(src), tmp_path / "auto", ConvertOptions(bits=4, eval_tokens=16))
    assert r.quality is None and any("quality check skipped" in n and "(3) ..." in n for n in r.notes)
    assert not any("\n" in n for n in r.notes)
    assert (r.out_dir / "config.json").exists()
    # asked for with --eval: it is an error, and nothing is left behind
    with pytest.raises(InvalidModel, match="--no-eval"):
        convert(str(src), tmp_path / "asked", ConvertOptions(bits=4, eval=True, eval_tokens=16))
    assert not (tmp_path / "asked").exists() and _leftovers(tmp_path, "asked") == []


def test_non_finite_source_fails_and_leaves_nothing(llama_src, tmp_path):
    """A NaN in the source's weights: the report would have said "KL nan, top-1 agreement 100%" and kept a model
    that answers nothing; the conversion fails instead, whether or not --eval was asked for."""
    import mlx.core as mx

    src = tmp_path / "nan"
    shutil.copytree(llama_src, src)
    shard = sorted(src.glob("model*.safetensors"))[0]
    weights = mx.load(str(shard))
    name = next(k for k in weights if k.endswith("norm.weight"))
    weights[name] = mx.full(weights[name].shape, float("nan"), dtype=weights[name].dtype)
    mx.save_safetensors(str(shard), weights, metadata={"format": "pt"})
    with pytest.raises(InvalidModel, match="source model's output is not finite"):
        convert(str(src), tmp_path / "out", ConvertOptions(bits=4, eval_tokens=16))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def test_stale_temp_dirs_of_dead_processes_are_removed(llama_src, tmp_path):
    import subprocess

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free: a killed conversion
    from mlxinfer.fsutil import MARKER

    stale = tmp_path / f".out.tmp-{dead.pid}-abcd1234"
    stale.mkdir()
    (stale / MARKER).touch()  # what AtomicDir writes into its temp dirs
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    alive = tmp_path / f".out.tmp-{1}-efgh5678"  # pid 1 is alive (and not ours): never touched
    alive.mkdir()
    (alive / MARKER).touch()
    # A user's folders named like ours, with a dead pid, but without the marker, or with a name mkdtemp never makes.
    lookalike = tmp_path / f".out.old-{dead.pid}-notes123"
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("precious")
    backup = tmp_path / f".out.tmp-{dead.pid}-backup"
    backup.mkdir()
    (backup / MARKER).touch()
    convert(str(llama_src), tmp_path / "out", ConvertOptions(bits=4, eval=False))
    assert not stale.exists() and alive.exists()
    assert (lookalike / "notes.txt").read_text() == "precious" and backup.is_dir()
    assert not (tmp_path / "out" / MARKER).exists()  # the published folder carries no marker


_SLOW_CLI = """
import sys, time
import mlxinfer.convert.writer as w
real = w.write_shards
def slow(*a, **k):
    def tick(name):
        print("tensor", name, flush=True)
        time.sleep(0.2)
    return real(*a, **{**k, "after_tensor": tick})
w.write_shards = slow
from mlxinfer.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_killed_cli_leaves_nothing(llama_src, tmp_path, sig):
    import os
    import signal
    import subprocess

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI, "convert", str(llama_src), "-o", str(out), "--bits", "4", "--no-eval"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job may inherit SIG_IGN
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent.parent)},
    )
    assert proc.stdout.readline().startswith("tensor")
    proc.send_signal(getattr(signal, sig))
    proc.communicate(timeout=60)
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_side_files_linked_outside_the_source_are_refused(llama_src, tmp_path):
    """A cloned repo whose LICENSE links to a private file: convert copied that file (0644) into the output, a
    folder people publish. Links inside the source, or a Hub snapshot's links to its repo's blobs, still work."""
    import os

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    os.chmod(secret, 0o600)
    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    (src / "LICENSE").symlink_to(secret)
    with pytest.raises(InvalidModel, match="links to .*secret.txt, outside the model folder"):
        convert(str(src), tmp_path / "out", ConvertOptions(bits=4, eval=False))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []

    (src / "LICENSE").unlink()
    (src / "docs").mkdir()
    (src / "docs" / "LICENSE.txt").write_text("MIT")
    (src / "LICENSE").symlink_to(src / "docs" / "LICENSE.txt")  # inside: copied as a file
    hub = tmp_path / "models--org--tiny"
    (hub / "blobs").mkdir(parents=True)
    snap = hub / "snapshots" / "abc123"
    shutil.copytree(src, snap, symlinks=False)
    (snap / "LICENSE").unlink()
    (hub / "blobs" / "f00d").write_text("Apache-2.0")
    (snap / "LICENSE").symlink_to("../../blobs/f00d")
    for source, text in ((src, "MIT"), (snap, "Apache-2.0")):
        out = tmp_path / f"out-{source.name}"
        convert(str(source), out, ConvertOptions(bits=4, eval=False))
        assert (out / "LICENSE").read_text() == text and not (out / "LICENSE").is_symlink()
