"""models.toml parsing, merging with the user's file, and model-argument resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxinfer.errors import ConfigError, ModelNotFound
from mlxinfer.registry import Registry


def _user(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "models.toml"
    p.write_text(text)
    return p


def test_packaged_registry_has_default_and_ten_hub_models():
    reg = Registry.load(user_file=Path("/nonexistent"))
    assert reg.default == "smollm2"
    spec = reg.spec("smollm2")
    assert spec.kind == "package" and spec.is_gguf and spec.path.exists()
    hub = [a for a in reg.aliases() if reg.spec(a).kind == "hub"]
    assert len(hub) >= 10
    assert all(reg.spec(a).repo.startswith("mlx-community/") for a in hub)


def test_user_file_overrides_and_adds(tmp_path):
    user = _user(tmp_path, """
[models.smollm2]
temperature = 0.0
system = "Be terse."

[models.mine]
hub = "me/my-model-4bit"
revision = "v2"
description = "mine"
""")
    reg = Registry.load(user_file=user)
    s = reg.spec("smollm2")
    assert s.kind == "package" and s.defaults["temperature"] == 0.0 and s.defaults["system"] == "Be terse."
    m = reg.spec("mine")
    assert (m.kind, m.repo, m.revision) == ("hub", "me/my-model-4bit", "v2")
    assert reg.origin("mine") == user


def test_user_source_replaces_packaged_source(tmp_path):
    model_dir = tmp_path / "dir"
    model_dir.mkdir()
    reg = Registry.load(user_file=_user(tmp_path, f'[models.smollm2]\npath = "{model_dir}"\n'))
    spec = reg.spec("smollm2")
    assert spec.kind == "path" and spec.path == model_dir


def test_invalid_toml_names_file_and_line(tmp_path):
    user = _user(tmp_path, "[models.x]\nhub = \n")
    with pytest.raises(ConfigError) as e:
        Registry.load(user_file=user)
    assert str(user) in str(e.value) and "line 2" in str(e.value)


def test_entry_without_source_names_the_key(tmp_path):
    user = _user(tmp_path, '[models.broken]\ndescription = "no source"\n')
    with pytest.raises(ConfigError, match=r"models\.broken has no source"):
        Registry.load(user_file=user)


def test_env_var_points_at_user_file(tmp_path, monkeypatch):
    user = _user(tmp_path, '[models.viaenv]\nhub = "a/b"\n')
    monkeypatch.setenv("MLXINFER_MODELS", str(user))
    assert "viaenv" in Registry.load().aliases()


def test_resolution_order(tmp_path):
    reg = Registry.load(user_file=Path("/nonexistent"))
    # 1. an existing path wins
    d = tmp_path / "org" / "name"
    d.mkdir(parents=True)
    assert reg.resolve(str(d)).kind == "path"
    # 2. aliases
    assert reg.resolve("qwen3-0.6b").repo == "mlx-community/Qwen3-0.6B-4bit"
    assert reg.resolve(None).alias == "smollm2"
    # 3. repo ids with revision
    spec = reg.resolve("someone/some-model@main")
    assert (spec.kind, spec.repo, spec.revision) == ("hub", "someone/some-model", "main")


def test_unknown_alias_suggests_closest():
    reg = Registry.load(user_file=Path("/nonexistent"))
    with pytest.raises(ModelNotFound, match="did you mean 'smollm2'"):
        reg.resolve("smolm2")


def test_missing_gguf_path():
    reg = Registry.load(user_file=Path("/nonexistent"))
    with pytest.raises(ModelNotFound, match="no such file"):
        reg.resolve("/tmp/does-not-exist.gguf")


@pytest.mark.parametrize("body, said", [
    ('default = 5', r"default must be an alias in quotes, not 5"),
    ('foo = 1', r"unknown top-level key\(s\): foo"),
    ('[models."x"]\npath = 5', r"models\.x\.path must be a non-empty string, not 5"),
    ('[models."x"]\npath = ["a"]', r"models\.x\.path must be a non-empty string, not an array"),
    ('[models."x"]\nhub = ""', r"models\.x\.hub must be a non-empty string"),
    ('[models."x"]\npackage = "p"\nfile = 5', r"models\.x\.file must be a non-empty string"),
    ('[models."x"]\nhub = "a/b"\nrevision = 5', r"models\.x\.revision must be a string, not 5"),
    ('[models."x"]\npath = "m"\nsystem = 5', r"models\.x\.system must be a string"),
    ('[models."x"]\npath = "m"\nchat_template = true', r"models\.x\.chat_template must be a string, not true"),
    ('[models."x"]\npath = "m"\ncontext = true', r"models\.x\.context must be a positive integer, not true"),
    ('[models."x"]\npath = "m"\nparams = true', r"models\.x\.params must be a string"),
    ('[models."x"]\npath = "m"\ntemperature = -5', r"models\.x: invalid temperature -5: must be"),
    ('[models."x"]\npath = "m"\ntop_p = true', r"models\.x: invalid top_p True: expected a number"),
    ('[models."x"]\npath = "m"\nmax_tokens = 0', r"models\.x: invalid max_tokens 0"),
])
def test_wrong_types_and_ranges_name_the_file_and_key(tmp_path, body, said):
    """A user's models.toml is input like a flag: a wrong type or range is one ConfigError naming the file, the
    entry and the key, never a TypeError deep in the loader (path = 5 crashed in Path(), default = 5 broke every
    command, context = true passed as 1)."""
    user = tmp_path / "models.toml"
    user.write_text(body + "\n")
    with pytest.raises(ConfigError, match=said) as e:
        Registry.load(user)
    assert str(user) in str(e.value)


def test_non_utf8_file_is_named(tmp_path):
    user = tmp_path / "models.toml"
    user.write_bytes(b'[models."x"]\npath = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"models\.toml: not valid UTF-8 \(byte \d+\)"):
        Registry.load(user)


def test_well_typed_entry_keeps_its_defaults(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text(f'default = "x"\n[models."x"]\npath = "{tmp_path}"\nparams = 135\ncontext = 64\n'
                    'temperature = 0\ntop_p = 1\nsystem = "Be brief."\n')  # resolve refuses a path that is not there
    spec = Registry.load(user).resolve(None)
    assert spec.context == 64 and spec.params == "135"
    assert spec.defaults == {"temperature": 0, "top_p": 1, "system": "Be brief."}


def test_unknown_alias_mentions_a_missing_models_file(tmp_path, monkeypatch):
    """MLXINFER_MODELS pointing nowhere (a typo) silently left only the packaged aliases."""
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("MLXINFER_MODELS", str(missing))
    with pytest.raises(ModelNotFound, match=f"MLXINFER_MODELS names {missing}, which does not exist"):
        Registry.load().resolve("my-own-model")


@pytest.mark.parametrize("name, ok", [
    ("mine-0.6b", True), ("my_model", True), ("mine3.2-1b", True), ("a", True),
    (".hidden", False), ("-x", False), ("a/b", False), ("a@b", False), ("a b", False), ("tab\tx", False),
    ("", False), ("x" * 101, False),
])
def test_one_alias_rule_for_models_toml_and_convert(tmp_path, name, ok):
    """convert --alias refused 'qwen3-0.6b' (dots), which the packaged models.toml itself uses."""
    from mlxinfer.convert.card import add_alias, check_alias
    from mlxinfer.errors import InvalidParameter
    from mlxinfer.registry import alias_problem

    assert (alias_problem(name) is None) == ok
    user = tmp_path / "models.toml"
    if ok:
        check_alias(name)
        add_alias(name, tmp_path, user_file=user)
        add_alias(name, tmp_path / "again", user_file=user, replace=True)  # found and replaced, quoted or not
        assert Registry.load(user_file=user).spec(name).path == (tmp_path / "again").resolve()
        return
    with pytest.raises(InvalidParameter) as err:
        check_alias(name)
    assert err.value.hint and "\t" not in str(err.value)
    user.write_text(f'[models."{name}"]\npath = "m"\n'.replace("\t", "\\t"))
    with pytest.raises(ConfigError, match=f"^{user}: alias .* (may|is)") as err:
        Registry.load(user_file=user)
    assert "rename that" in err.value.hint


def test_unknown_key_says_what_was_meant_and_where(tmp_path):
    """'temprature = 0.5' said only "unknown key(s): temprature"."""
    user = _user(tmp_path, '[models.X]\npath = "m"\ntemprature = 0.5\n')
    with pytest.raises(ConfigError) as err:
        Registry.load(user_file=user)
    assert err.value.args[0] == f"{user}: models.X has unknown key(s): temprature"
    assert err.value.hint == f"did you mean 'temperature'? fix it in {user}"
    _user(tmp_path, '[models.X]\npath = "m"\nzzz = 1\n')
    with pytest.raises(ConfigError) as err:
        Registry.load(user_file=user)
    assert "an entry may set" in err.value.hint and "temperature" in err.value.hint


@pytest.mark.parametrize("command", [["show", "gone"], ["rm", "gone", "--yes"], ["pull", "gone"],
                                     ["generate", "gone", "-p", "hi"]])
def test_an_alias_to_a_missing_path_says_so_everywhere(tmp_path, monkeypatch, capsys, command):
    """show said "not a model", rm "your own file, not a cache entry", pull "not a GGUF file or a model directory"."""
    from mlxinfer.cli.main import main

    user = _user(tmp_path, '[models."gone"]\npath = "/nonexistent/model"\n')
    monkeypatch.setenv("MLXINFER_MODELS", str(user))
    assert main(command) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: /nonexistent/model does not exist: alias 'gone' in {user} points there (fix its path in {user}, "
        "or remove its [models.\"gone\"] table)"]
