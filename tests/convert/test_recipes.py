"""Recipe rules: layer selectors, matching, TOML parsing and validation (no model needed)."""

from __future__ import annotations

import pytest

from mlxinfer.convert import recipes as R
from mlxinfer.errors import ConfigError, InvalidParameter


def test_selectors_follow_llama_cpp():
    # llama.cpp's use_more_bits for 32 layers: first/last 4, and every third layer in between
    sensitive = [i for i in range(32) if R.layer_selected("sensitive", i, 32)]
    assert sensitive == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(32) if R.layer_selected("edges", i, 32)] == [0, 1, 2, 3, 28, 29, 30, 31]
    assert [i for i in range(4) if R.layer_selected("first", i, 4)] == [0]  # at least one layer
    assert [i for i in range(4) if R.layer_selected("last", i, 4)] == [3]
    assert [i for i in range(10) if R.layer_selected([0, -1], i, 10)] == [0, 9]
    assert [i for i in range(10) if R.layer_selected("2-4", i, 10)] == [2, 3, 4]
    assert not R.layer_selected("first", None, 10)  # lm_head / embeddings have no layer


def test_matching_and_first_rule_wins():
    recipe = R.parse_recipe({
        "default": {"bits": 4},
        "rule": [
            {"match": "model.layers.*.mlp.down_proj", "layers": [0], "bits": 8},
            {"match": "down_proj", "bits": 6},
            {"match": "q_proj", "quantize": False},
        ],
    }, "t.toml")
    s = R.setting_for
    assert s(recipe, "model.layers.0.mlp.down_proj", 4).bits == 8
    assert s(recipe, "model.layers.1.mlp.down_proj", 4).bits == 6
    assert s(recipe, "model.layers.1.self_attn.q_proj", 4) is None
    assert s(recipe, "model.layers.1.self_attn.k_proj", 4) == R.QuantSetting(4, 64)
    assert not R.path_matches("proj", "model.layers.1.self_attn.q_proj")  # a bare name matches whole parts


@pytest.mark.parametrize("name", ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"])
def test_builtin_recipes_mean_what_mlx_lm_means(name):
    """Same name, same layers, same widths as mlx_lm.convert's own recipe (issue #16); the rules that describe it
    in the model card agree with it too."""
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=24, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, tie_word_embeddings=False))
    r = R.BUILTIN[name]
    R.validate(r)
    ours, theirs = R.predicate(r, model), mixed_quant_predicate_builder(name, model, group_size=64)
    compared = 0
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized"):
            continue
        mine = ours(path, module)
        got = r.default.as_dict() if mine is True else mine
        assert got == theirs(path, module), path
        assert R.setting_for(r, path, 24).as_dict() == got, path
        compared += 1
    assert compared == 1 + 1 + 24 * 7  # embeddings, lm_head, 7 projections per layer
    low, high = (int(b) for b in name.split("_")[1:])
    assert ours("model.embed_tokens", model.model.embed_tokens) is True  # mlx-lm keeps embeddings at the low width
    assert theirs("lm_head", None)["bits"] == high and r.default.bits == low


def test_overrides():
    r = R.BUILTIN["mixed_4_6"].with_overrides(None, 32, None)
    assert r.default == R.QuantSetting(4, 32) and R.setting_for(r, "lm_head", 8) == R.QuantSetting(6, 32)
    assert R.uniform(None, None, "mxfp4").default == R.QuantSetting(4, 32, "mxfp4")
    assert R.uniform(8, None, None).default == R.QuantSetting(8, 64)


@pytest.mark.parametrize("doc, match", [
    ({"default": {"bits": "four"}}, "integer"),
    ({"rule": [{"bits": 4}]}, "needs match"),
    ({"rule": [{"match": "x", "layers": "middle"}]}, "layers must be"),
    ({"rule": [{"match": "x", "colour": "red"}]}, "unknown key"),
    ({"rules_typo": []}, "unknown key"),
])
def test_bad_toml_recipes(doc, match):
    with pytest.raises(ConfigError, match=match):
        R.parse_recipe(doc, "bad.toml")


def test_validation_of_rule_settings(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[[rule]]\nmatch = "lm_head"\nbits = 7\n')
    with pytest.raises(InvalidParameter, match="rule 1"):
        R.validate(R.load_recipe(str(f)))
    f.write_text('[[rule]]\nmatch = "lm_head"\nbits = [\n')
    with pytest.raises(ConfigError, match="invalid TOML"):
        R.load_recipe(str(f))
    assert "affine" in R.available_modes()


_PATHS = ["model.embed_tokens", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]


@pytest.mark.parametrize("rule, match", [
    ({"match": "nomatch_xyz"}, r"^t.toml rule 1 \(match 'nomatch_xyz'\) selects no layer of this model \("),
    ({"match": "down_proj", "layers": [0, 99]}, r"names layer 99, but this model has layers 0-1 \(use 0 to 1"),
    ({"match": "down_proj", "layers": "1-5"}, "names layer 5, but this model has layers 0-1"),
    ({"match": "down_proj", "layers": [-3]}, "names layer -3"),
    ({"match": "lm_head", "layers": "first"}, r"selects no layer of this model \('lm_head' has no layer number"),
])
def test_a_rule_that_selects_nothing_is_refused(rule, match):
    """Such a rule was accepted and did nothing (exit 0, "1 rules" in the report)."""
    recipe = R.parse_recipe({"rule": [{"match": "lm_head", "bits": 8}, {**rule, "bits": 6}]}, "t.toml")
    with pytest.raises(ConfigError, match=match.replace("rule 1", "rule 2")) as err:
        R.check_rules_select(recipe, _PATHS, 2)
    assert err.value.hint
    R.check_rules_select(R.parse_recipe({"rule": [{"match": "down_proj", "layers": [0, -2]}]}, "t.toml"), _PATHS, 2)
