"""config.json is checked before mlx-lm builds anything: not an object, wrong types, absurd sizes and sizes that
contradict the safetensors headers actually present each get one line naming the file and field, exit 2, fast
(only the headers are read). Safetensors headers that lie about the data are refused the same way.

The CLI runs in this process (tests/in_process.py): these are checks of the files; tests/unit/test_cli_errors.py
refuses broken model files through the real process."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from in_process import run_in_process
from safety_cli import assert_one_line_error, write_tiny_llama

from mlxinfer.engine.model_checks import check_model_files, safetensors_header
from mlxinfer.errors import InvalidModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _copy(tiny: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in tiny.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _config(tiny: Path) -> dict:
    return json.loads((tiny / "config.json").read_text())


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


CASES = {
    # name: (config transform, needles in the one line)
    "json_list": (lambda c: [c], ("config.json", "JSON list")),
    "json_string": (lambda c: "llama", ("config.json", "JSON string")),
    "hidden_size_str": (lambda c: {**c, "hidden_size": "big"}, ("'hidden_size'", "'big'", "not a whole number")),
    "hidden_size_float": (lambda c: {**c, "hidden_size": 64.5}, ("'hidden_size'", "not a whole number")),
    "layers_bool": (lambda c: {**c, "num_hidden_layers": True}, ("'num_hidden_layers'", "not a whole number")),
    "no_model_type": (lambda c: _without(c, "model_type"), ("has no 'model_type'", "architecture")),
    "model_type_list": (lambda c: {**c, "model_type": ["llama"]}, ("'model_type'", "not an architecture name")),
    "layers_1e9": (lambda c: {**c, "num_hidden_layers": 10**9}, ("'num_hidden_layers'", "1000000000", "outside")),
    "hidden_zero": (lambda c: {**c, "hidden_size": 0}, ("'hidden_size'", "is 0")),
    "hidden_negative": (lambda c: {**c, "hidden_size": -64}, ("'hidden_size'", "-64")),
    "vocab_huge": (lambda c: {**c, "vocab_size": 10**12}, ("'vocab_size'", "outside")),
    "heads_zero": (lambda c: {**c, "num_attention_heads": 0}, ("'num_attention_heads'", "is 0")),
    "heads_vs_kv": (lambda c: {**c, "num_key_value_heads": 3}, ("'num_attention_heads'", "'num_key_value_heads'")),
    "eps_string": (lambda c: {**c, "rms_norm_eps": "tiny"}, ("'rms_norm_eps'", "not a positive number")),
    "text_config": (lambda c: {**c, "text_config": {"hidden_size": "big"}}, ("'text_config.hidden_size'",)),
    "quantization": (lambda c: {**c, "quantization": {"bits": "four", "group_size": 64}}, ("'quantization'",)),
    # plausible on their own, contradicted by the weights (256 x 64 embedding, 2 layers)
    "vocab_vs_weights": (lambda c: {**c, "vocab_size": 512}, ("vocab_size 512", "256 rows")),
    "hidden_vs_weights": (lambda c: {**c, "hidden_size": 128, "head_dim": 16}, ("hidden_size 128", "64 wide")),
    "layers_vs_weights": (lambda c: {**c, "num_hidden_layers": 40}, ("num_hidden_layers 40", "hold 2 layers")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_is_refused_in_one_line(tiny, tmp_path, case):
    transform, needles = CASES[case]
    d = _copy(tiny, tmp_path / case)
    (d / "config.json").write_text(json.dumps(transform(_config(tiny))))
    start = time.monotonic()
    proc = run_in_process("generate", str(d), "-p", "hi", "--max-tokens", "2")
    elapsed = time.monotonic() - start
    line = assert_one_line_error(proc, *needles)
    assert str(d) in line
    assert elapsed < 30, elapsed  # nothing big was built or allocated first


@pytest.mark.parametrize("case", sorted(CASES))
def test_checks_run_before_mlx_lm(tiny, tmp_path, case, monkeypatch):
    """The same refusals through the API, with mlx-lm's model builder made to fail the test if it is reached."""
    import mlx_lm.utils

    import mlxinfer

    def must_not_build(*a, **k):
        raise AssertionError("mlx-lm was asked to build the model")

    monkeypatch.setattr(mlx_lm.utils, "load_model", must_not_build)
    transform, needles = CASES[case]
    d = _copy(tiny, tmp_path / case)
    (d / "config.json").write_text(json.dumps(transform(_config(tiny))))
    with pytest.raises(InvalidModel) as e:
        mlxinfer.load(str(d), kernels="builtin")
    assert "\n" not in str(e.value) and needles[0].lower() in str(e.value).lower()


def test_the_tiny_model_itself_passes(tiny):
    assert check_model_files(tiny)["model_type"] == "llama"


def test_quantized_embedding_width_is_unpacked(tmp_path):
    """A 4-bit embedding is stored as uint32 columns (8 values each); its width is compared unpacked."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256)
    model = llama.Model(args)
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {**vars(args), "quantization": {"group_size": 32, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert check_model_files(tmp_path)["hidden_size"] == 64
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128, "head_dim": 16}))
    with pytest.raises(InvalidModel, match="hidden_size 128 but model.embed_tokens.weight in the weights is 64 wide"):
        check_model_files(tmp_path)


def _write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("case, needle", [
    ("length_beyond_file", "header length"),
    ("offsets_beyond_file", "is truncated"),
    ("shape_larger_than_data", "inconsistent header entry"),
    ("not_json", "corrupt safetensors header"),
    ("negative_dim", "inconsistent header entry"),
])
def test_lying_safetensors_headers(tiny, tmp_path, case, needle):
    d = _copy(tiny, tmp_path / case)
    st = d / "model.safetensors"
    if case == "length_beyond_file":
        st.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    elif case == "offsets_beyond_file":
        _write_header(st, {"w": {"dtype": "F32", "shape": [1024, 1024], "data_offsets": [0, 4 << 20]}}, b"\0" * 64)
    elif case == "shape_larger_than_data":
        _write_header(st, {"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 64]}}, b"\0" * 64)
    elif case == "not_json":
        st.write_bytes(struct.pack("<Q", 8) + b"\xff\xfe{nope" + b"\0" * 64)
    else:
        _write_header(st, {"w": {"dtype": "F32", "shape": [-4, 4], "data_offsets": [0, 64]}}, b"\0" * 64)
    with pytest.raises(InvalidModel, match=needle):
        safetensors_header(st)
    proc = run_in_process("generate", str(d), "-p", "hi", "--max-tokens", "2")
    assert_one_line_error(proc, "model.safetensors", needle)


@pytest.mark.parametrize("content", ["[1, 2]", "not json", "\"a string\""])
def test_tokenizer_config_that_is_not_an_object(tiny, tmp_path, content):
    d = _copy(tiny, tmp_path / "tok")
    (d / "tokenizer_config.json").write_text(content)
    assert_one_line_error(run_in_process("generate", str(d), "-p", "hi", "--max-tokens", "2"),
                          "tokenizer_config.json is not a JSON object")


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_fifo_in_the_model_folder_is_refused_not_waited_on(tiny, tmp_path, name):
    """A FIFO where a model file should be blocked generate and show forever."""
    import os

    d = _copy(tiny, tmp_path / "m")
    (d / name).unlink()
    os.mkfifo(d / name)
    start = time.monotonic()
    commands = [("generate", str(d), "-p", "hi", "-n", "2")]
    if name != "tokenizer.json":  # show reads no tokenizer
        commands.append(("show", str(d)))
    for command in commands:
        result = run_in_process(*command)
        assert_one_line_error(result, f"{name} is not a regular file" if command[0] == "generate" or
                              name != "config.json" else "has no config.json")
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("change, needle", [
    (lambda d: (d / "config.json").write_text("[1, 2]"), "is a JSON list, not an object"),
    (lambda d: (d / "config.json").write_text(json.dumps({**_config(d), "architectures": 5})), None),
    (lambda d: (d / "config.json").write_text(json.dumps({**_config(d), "quantization": {"bits": 0,
                                                                                     "group_size": 64}})),
     "not bits 1..8"),
    (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 30) + b"{" * 30 + b"\0" * 8),
     "corrupt safetensors header"),
    (lambda d: (d / "extra.safetensors").write_bytes(struct.pack("<Q", 60) + json.dumps(
        {"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}).encode().ljust(60) + b"\0" * 4),
     "extra.safetensors"),
])
def test_show_on_malformed_files_is_one_line_never_an_internal_error(tiny, tmp_path, change, needle):
    d = _copy(tiny, tmp_path / "m")
    change(d)
    result = run_in_process("show", str(d))
    if needle is None:  # a bad 'architectures' is only not shown: the model_type stands in
        assert result.returncode == 0 and "llama" in result.stdout, result.stderr
    else:
        assert_one_line_error(result, needle)


def test_weights_and_quantization_configs_that_mlx_lm_would_trip_on_are_one_line(tiny, tmp_path):
    """A quantized weight stored as bytes beside its scales failed in the first matmul, and a GPTQ
    quantization_config over plain weights inside mlx-lm (UnboundLocalError): both were internal errors."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    d = _copy(tiny, tmp_path / "gptq")
    (d / "config.json").write_text(json.dumps({**_config(d), "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128}}))
    assert_one_line_error(run_in_process("generate", str(d), "-p", "hi", "-n", "2"), "does not fit mlx-lm's 'llama'")

    q = tmp_path / "q4"
    q.mkdir()
    cfg = _config(tiny)
    model = llama.Model(llama.ModelArgs(**{k: v for k, v in cfg.items() if k in llama.ModelArgs.__dataclass_fields__}))
    nn.quantize(model, group_size=32, bits=4)
    weights = dict(tree_flatten(model.parameters()))
    name = next(k for k in weights if k.endswith("down_proj.weight"))
    weights[name] = weights[name].view(mx.uint8)[..., : weights[name].shape[-1]]  # right shape, wrong dtype
    mx.save_safetensors(str(q / "model.safetensors"), weights)
    (q / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 32, "bits": 4}}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (q / f).write_bytes((tiny / f).read_bytes())
    assert_one_line_error(run_in_process("generate", str(q), "-p", "hi", "-n", "2"),
                          "down_proj.weight is stored as U8 beside its scales")


def test_convert_checks_config_json_as_the_loader_does(tiny, tmp_path):
    for text, needle in (("[1]", "is a JSON list, not an object"),
                         (json.dumps({**_config(tiny), "model_type": ["llama"]}), "not an architecture name")):
        d = _copy(tiny, tmp_path / f"c{len(text)}")
        (d / "config.json").write_text(text)
        assert_one_line_error(run_in_process("convert", str(d), "-o", str(tmp_path / f"o{len(text)}"), "--no-eval"),
                              needle)
