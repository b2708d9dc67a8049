"""No code from a model, ever: model directories and Hub repos that ask for custom Python are refused with one line
naming the file and field, nothing is imported, nothing is asked on stdin (a piped "y" answers nothing), and no .py
is fetched from the Hub, not even one that an auto_map in another repo names. Every crafted .py writes a marker
file when imported; no test may find it."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, run, write_tiny_llama

sys.path.insert(0, str(Path(__file__).parents[1] / "hub"))
from fakehub import FakeHub  # noqa: E402


def _evil_py(marker: Path, cls: str = "EvilTokenizer") -> str:
    return (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from transformers import PreTrainedTokenizerFast\n"
            f"class {cls}(PreTrainedTokenizerFast):\n    pass\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "MARKER-code-ran"


def _copy(tiny: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in tiny.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture
def custom_tokenizer_dir(tiny, tmp_path, marker) -> Path:
    """The reproduced bug: auto_map + tokenizer_class + tokenization_evil.py beside them."""
    d = _copy(tiny, tmp_path / "evil")
    _edit(d / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
          auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    (d / "tokenization_evil.py").write_text(_evil_py(marker))
    return d


def _env(tmp_path) -> dict:
    return {"HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "MLXINFER_CACHE": str(tmp_path / "mlxinfer"), "HF_HUB_OFFLINE": "1"}


def test_generate_with_y_on_stdin_runs_no_code(custom_tokenizer_dir, marker, tmp_path):
    proc = run("generate", str(custom_tokenizer_dir), "-p", "hi", "--max-tokens", "2", input="y\n",
               env=_env(tmp_path))
    assert_one_line_error(proc, "tokenizer_config.json", "'auto_map'", "tokenization_evil", "never runs code")
    assert not marker.exists()
    assert "Do you wish" not in proc.stdout + proc.stderr and proc.stdout == ""


def test_piped_chat_answers_no_question(custom_tokenizer_dir, marker, tmp_path):
    proc = run("chat", str(custom_tokenizer_dir), input="y\ny\nhello\n", env=_env(tmp_path))
    assert_one_line_error(proc, "tokenizer_config.json", "'auto_map'")
    assert not marker.exists()
    assert "Do you wish" not in proc.stdout


def test_switching_to_it_inside_chat_is_refused_and_the_chat_goes_on(tiny, custom_tokenizer_dir, marker, tmp_path):
    proc = run("chat", str(tiny), "--max-tokens", "2", input=f"/model {custom_tokenizer_dir}\ny\nhello\n",
               env=_env(tmp_path))
    assert not marker.exists()
    assert "auto_map" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert "Do you wish" not in proc.stdout


@pytest.mark.parametrize("case, needles", [
    ("tokenizer_class", ("tokenizer_config.json", "'tokenizer_class'", "EvilTokenizer", "tokenization_evil.py")),
    ("legacy_auto_map", ("tokenizer_config.json", "'auto_map'")),
    ("tokenizer_trust", ("tokenizer_config.json", "'trust_remote_code'")),
    ("config_trust", ("config.json", "'trust_remote_code'")),
    ("config_auto_tokenizer", ("config.json", "'auto_map'", "tokenizer")),
    ("config_auto_map_unknown_arch", ("config.json", "'auto_map'", "evilarch")),
    ("config_auto_map_mlx_lm_only", ("config.json", "'auto_map'", "transformers has no built-in 'kimi_k2'")),
    ("model_file", ("config.json", "'model_file'", "evil_model.py")),
    ("chat_template_type", ("tokenizer_config.json", "'chat_template_type'")),
])
def test_every_way_of_asking_for_code_is_refused(tiny, tmp_path, marker, case, needles):
    d = _copy(tiny, tmp_path / case)
    (d / "tokenization_evil.py").write_text(_evil_py(marker))
    (d / "evil_model.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    tok, cfg = d / "tokenizer_config.json", d / "config.json"
    edits = {
        "tokenizer_class": (tok, {"tokenizer_class": "EvilTokenizer"}),
        "legacy_auto_map": (tok, {"auto_map": ["tokenization_evil.EvilTokenizer", None]}),
        "tokenizer_trust": (tok, {"trust_remote_code": True}),
        "config_trust": (cfg, {"trust_remote_code": True}),
        "config_auto_tokenizer": (cfg, {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}),
        "config_auto_map_unknown_arch": (cfg, {"model_type": "evilarch",
                                               "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}),
        # mlx-lm has kimi_k2, transformers has not: transformers would need the code to read this config
        "config_auto_map_mlx_lm_only": (cfg, {"model_type": "kimi_k2",
                                              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}),
        "model_file": (cfg, {"model_file": "evil_model.py"}),
        "chat_template_type": (tok, {"chat_template_type": "..evil"}),
    }
    path, change = edits[case]
    _edit(path, **change)
    # Refused from the files alone, before any tokenizer or Hub call: the CLI runs in this process
    # (tests/in_process.py), where code that ran would write the marker as well; the tests around run real ones.
    proc = run_in_process("generate", str(d), "-p", "hi", "--max-tokens", "2", input="y\n", env=_env(tmp_path))
    line = assert_one_line_error(proc, *needles)
    assert str(d) in line
    assert not marker.exists()


def test_an_inert_config_auto_map_does_not_block_a_supported_model(tiny, tmp_path, marker):
    """Phi-3 or DeepSeek-V3 repos carry an auto_map for transformers' model classes: mlx-lm builds the model
    from model_type with its own code, so the model loads and the named .py is still never imported."""
    d = _copy(tiny, tmp_path / "inert")
    _edit(d / "config.json", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                       "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (d / name).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    proc = run("generate", str(d), "-p", "hi", "--max-tokens", "2", "--temp", "0", input="y\n", env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert "Do you wish" not in proc.stdout and "transformers" not in proc.stdout + proc.stderr


def test_the_tokenizer_guard_alone_runs_no_code(custom_tokenizer_dir, marker):
    """Defence in depth: even past the refusal, mlx-lm's tokenizer loader under the guard cannot run the .py,
    ask on stdin or reach the network."""
    from huggingface_hub import constants, get_session
    from huggingface_hub.errors import OfflineModeIsEnabled
    from mlx_lm.utils import load_tokenizer

    from mlxinfer.engine import trust

    saved_input, saved_offline = builtins.input, constants.HF_HUB_OFFLINE
    with trust._guarded():
        assert constants.HF_HUB_OFFLINE is True
        with pytest.raises(EOFError):
            input("Do you wish to run the custom code? [y/N] ")
        with pytest.raises(OfflineModeIsEnabled):  # huggingface_hub's client (transformers' too) refuses requests
            get_session().get("http://127.0.0.1:9/org/code/resolve/main/tokenization_evil.py")
        with pytest.raises(Exception):  # noqa: B017 - transformers refuses (ValueError); the type is its business
            load_tokenizer(custom_tokenizer_dir, {"trust_remote_code": False, "local_files_only": True})
    assert not marker.exists()
    assert builtins.input is saved_input and constants.HF_HUB_OFFLINE == saved_offline  # restored afterwards


def test_convert_refuses_it_too(custom_tokenizer_dir, marker, tmp_path):
    out = tmp_path / "out"
    proc = run("convert", str(custom_tokenizer_dir), "-o", str(out), input="y\n", env=_env(tmp_path))
    assert_one_line_error(proc, "tokenizer_config.json", "'auto_map'")
    assert not marker.exists() and not out.exists()


# -- over the Hub ----------------------------------------------------------------------------------------------
@pytest.fixture
def hub(tmp_path):
    h = FakeHub().start()
    yield h
    h.stop()


def test_hub_auto_map_naming_another_repo_fetches_and_runs_nothing(hub, tiny, tmp_path, marker):
    """tokenizer_config.json in org/model points at org/code--tokenization_evil.EvilTok: transformers would
    download org/code's .py and run it. The request for it must never reach the Hub."""
    files = {p.name: p for p in tiny.iterdir()}
    tok = json.loads((tiny / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="EvilTok", auto_map={"AutoTokenizer": ["org/code--tokenization_evil.EvilTok", None]})
    files["tokenizer_config.json"] = json.dumps(tok).encode()
    files["tokenization_evil.py"] = _evil_py(marker, "EvilTok").encode()  # in the repo too: never fetched
    hub.add_repo("org/model", files)
    hub.add_repo("org/code", {"tokenization_evil.py": _evil_py(marker, "EvilTok").encode(), "config.json": b"{}"})
    env = {**_env(tmp_path), "HF_HUB_OFFLINE": "", "HF_ENDPOINT": hub.endpoint}
    proc = run("generate", "org/model", "-p", "hi", "--max-tokens", "2", input="y\n", env=env)
    assert_one_line_error(proc, "tokenizer_config.json", "'auto_map'", "org/code")
    assert not marker.exists()
    paths = [p for _, p in hub.requests]
    assert paths and not any("org/code" in p or p.endswith(".py") for p in paths), paths
    # Refused from the small JSON files, before any weights were downloaded.
    assert not any(p.endswith(".safetensors") for m, p in hub.requests if m == "GET"), paths
