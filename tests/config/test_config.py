"""Tests of lpcompile.config: recipes, options parsing, validation."""

from __future__ import annotations

import dataclasses

import pytest

from lpcompile.config import OFF, ROLES, LowPrecConfig, QuantSpec, recipes

RECIPES = ["fp32", "fp8-e5m2", "fp8-e5m2-sr", "fp8-hybrid", "fp16", "bf16"]

# (weight/activation, error/weight_grad) per recipe, as docs/fp8.md and the paper describe them.
EXPECTED = {
    "fp32": (OFF, OFF),
    "fp8-e5m2": (QuantSpec("e5m2"), QuantSpec("e5m2", "nearest", "inf")),
    "fp8-e5m2-sr": (QuantSpec("e5m2"), QuantSpec("e5m2", "stochastic", "inf")),
    "fp8-hybrid": (QuantSpec("e4m3"), QuantSpec("e5m2", "nearest", "inf")),
    "fp16": (QuantSpec("fp16"), QuantSpec("fp16", "nearest", "inf")),
    "bf16": (QuantSpec("bf16"), QuantSpec("bf16", "nearest", "inf")),
}


def test_recipes_are_listed_with_descriptions():
    listed = recipes()
    assert list(listed)[: len(RECIPES)] == RECIPES  # later work may add more after these
    for name, description in listed.items():
        assert isinstance(description, str) and len(description) > 10, name


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_parses(name):
    fwd, bwd = EXPECTED[name]
    for config in (LowPrecConfig.from_recipe(name), LowPrecConfig.from_options({"recipe": name})):
        assert config.recipe == name
        assert (config.weight, config.activation) == (fwd, fwd)
        assert (config.error, config.weight_grad) == (bwd, bwd)
        assert config.quantizes == (name != "fp32")
        assert config.spec("error") is config.error


@pytest.mark.parametrize("name", list(recipes()))
def test_every_listed_recipe_builds_a_config(name):
    config = LowPrecConfig.from_options({"recipe": name})
    assert config.recipe == name and config == LowPrecConfig.from_recipe(name)
    assert all(isinstance(config.spec(role), QuantSpec) for role in ROLES)


def test_defaults():
    config = LowPrecConfig.from_options(None)
    assert config == LowPrecConfig.from_options({}) == LowPrecConfig()
    assert config.recipe == "fp32" and not config.quantizes
    assert config.executor == "inductor" and config.seed == 0
    assert config.exclude == () and config.keep_first_last is False


def test_unknown_recipe_names_it_and_lists_valid_ones():
    with pytest.raises(ValueError, match="fp9") as err:
        LowPrecConfig.from_options({"recipe": "fp9"})
    for name in RECIPES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="fp9"):
        LowPrecConfig.from_recipe("fp9")
    with pytest.raises(ValueError, match=r"unknown recipe \['fp8-e5m2'\]; valid recipes"):
        LowPrecConfig.from_options({"recipe": ["fp8-e5m2"]})  # was TypeError: unhashable


def test_unknown_option_key_names_it_and_lists_valid_ones():
    with pytest.raises(ValueError, match="wieght") as err:
        LowPrecConfig.from_options({"recipe": "fp8-e5m2", "wieght": "e4m3"})
    for key in ("recipe", "exclude", "keep_first_last", "seed", "executor", *ROLES):
        assert key in str(err.value)


@pytest.mark.parametrize(
    ("options", "named", "listed"),
    [
        ({"executor": "tvm"}, "tvm", "eager"),
        ({"recipe": "fp8-e5m2", "weight": "e9m9"}, "e9m9", "e5m2"),
        ({"recipe": "fp8-e5m2", "error": {"rounding": "up"}}, "up", "stochastic"),
        ({"recipe": "fp8-e5m2", "error": {"overflow": "wrap"}}, "wrap", "saturate"),
        ({"recipe": "fp8-e5m2", "error": {"fmtt": "e5m2"}}, "fmtt", "rounding"),
        ({"recipe": "fp8-e5m2", "weight": 3}, "3", "dict"),
        ({"seed": "abc"}, "abc", "int"),
        ({"recipe": "fp8-e5m2", "loss_scale_interval": 5}, "loss_scale_interval", "adaptive"),
        ({"matmul": "fp8"}, "fp8", "bf16"),
        ({"wrapper": "c"}, "'c'", "python"),
        ({"conv": "onednn"}, "'onednn'", "aten"),
        ({"cpp_opt_level": "O4"}, "'O4'", "O3"),
        ({"cpp_opt_level": "O2", "executor": "eager"}, "eager", "inductor"),
        ({"wrapper": "cpp", "executor": "eager"}, "eager", "inductor"),
        ({"wrapper": "python", "codegen": "triton"}, "triton", "inductor"),
        ({"recipe": "fp8-e5m2", "matmul": "bf16", "executor": "eager"}, "eager", "inductor"),
        ({"recipe": "fp8-e5m2", "matmul": "bf16", "codegen": "triton"}, "triton", "inductor"),
        ("fp8-e5m2-sr", "'fp8-e5m2-sr'", "options={'recipe': name}"),
        ({"recipe": "fp8-e5m2-als", "loss_scale_underflow": "0.01"}, "'0.01'", "(0, 1)"),
        ({"recipe": "fp8-e5m2-als", "loss_scale_interval": True}, "True", "positive int"),
        ({"recipe": "nvfp4", "wgrad_hadamard": 1}, "1", "bool"),
        ({"recipe": "nvfp4", "weight": None, "wgrad_hadamard": True}, "weight", "format"),
        ({"recipe": "fp8-tensorwise", "wgrad_hadamard": True}, "'tensorwise'", "per row or block"),
        (
            {"recipe": "nvfp4", "activation": {"scaling": "nvfp4_2d"}, "wgrad_hadamard": True},
            "nvfp4_2d",
            "row",
        ),
    ],
)
def test_bad_values_name_the_value_and_what_is_valid(options, named, listed):
    with pytest.raises(ValueError) as err:
        LowPrecConfig.from_options(options)
    assert named in str(err.value) and listed in str(err.value)


def test_role_override_by_format_name():
    config = LowPrecConfig.from_options({"recipe": "fp8-e5m2", "weight": "e4m3fn"})
    assert config.weight == QuantSpec("e4m3", "nearest", "saturate")
    assert config.weight.fmt == "e4m3"  # normalised name
    assert config.activation == QuantSpec("e5m2")  # the other roles keep the recipe's
    # A format name turns on a role the recipe leaves off.
    assert LowPrecConfig.from_options({"recipe": "fp32", "activation": "bf16"}).activation == QuantSpec(
        "bf16"
    )


def test_role_override_dict_merges_onto_the_recipe_spec():
    config = LowPrecConfig.from_options({"recipe": "fp8-e5m2-sr", "error": {"fmt": "e4m3"}})
    assert config.error == QuantSpec("e4m3", "stochastic", "inf")
    config = LowPrecConfig.from_options({"recipe": "fp8-hybrid", "activation": {"rounding": "stochastic"}})
    assert config.activation == QuantSpec("e4m3", "stochastic", "saturate")
    assert config.weight == QuantSpec("e4m3", "nearest", "saturate")
    # A role the recipe leaves off has nothing to merge onto: the dict must name a format.
    with pytest.raises(ValueError, match="fmt"):
        LowPrecConfig.from_options({"recipe": "fp32", "weight": {"rounding": "stochastic"}})
    config = LowPrecConfig.from_options({"recipe": "fp32", "weight": {"fmt": "e5m2", "overflow": "inf"}})
    assert config.weight == QuantSpec("e5m2", "nearest", "inf")


@pytest.mark.parametrize("off", [None, False, {"fmt": None}])
def test_role_override_none_disables(off):
    config = LowPrecConfig.from_options({"recipe": "fp8-e5m2-sr", "weight_grad": off})
    assert config.weight_grad == OFF and not config.weight_grad.enabled
    assert config.error.enabled and config.quantizes
    quiet = LowPrecConfig.from_options({"recipe": "fp8-e5m2", **dict.fromkeys(ROLES)})
    assert not quiet.quantizes


def test_other_options():
    config = LowPrecConfig.from_options(
        {"recipe": "fp16", "exclude": "head.*", "keep_first_last": True, "seed": 7, "executor": "eager"}
    )
    assert config.exclude == ("head.*",)  # a single pattern becomes a tuple
    assert config.keep_first_last is True and config.seed == 7 and config.executor == "eager"
    assert LowPrecConfig.from_options({"exclude": ["a", "b.*"]}).exclude == ("a", "b.*")


def test_configs_are_frozen_and_hashable():
    config = LowPrecConfig.from_recipe("fp8-e5m2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.weight.fmt = "e4m3"
    assert hash(config) == hash(LowPrecConfig.from_recipe("fp8-e5m2"))


def test_options_dict_is_not_modified():
    options = {"recipe": "fp8-e5m2", "exclude": ["0"]}
    LowPrecConfig.from_options(options)
    assert options == {"recipe": "fp8-e5m2", "exclude": ["0"]}


def test_public_api_at_the_package_root():
    import torch

    import lpcompile

    assert set(lpcompile.recipes()) >= {"fp32", "fp8-e5m2-sr", "fp8-e5m2-als"}
    assert lpcompile.LowPrecConfig.from_options({"recipe": "fp16"}).error.fmt == "fp16"
    assert lpcompile.LossScaler("adaptive").get_scale() == 1.0
    assert lpcompile.stats(torch.nn.Linear(2, 2)) == []
