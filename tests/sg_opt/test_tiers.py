"""Tiers load from the packaged TOML, merge a user's file over it, and reject mistakes in a sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from sg_opt.tiers import Price, load_tiers, price_for
from targets.protocol import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tiers.toml"
    path.write_text(text)
    return path


def test_packaged_tiers_offline_by_default_normal_one_candidate_ultra_several():
    tiers = load_tiers()
    offline, normal, ultra = tiers.tier(), tiers.tier("normal"), tiers.tier("ultra")
    assert offline.name == "offline" and not offline.uses_llm and offline.budget_usd == 0
    assert normal.uses_llm and normal.candidates_per_iteration == 1
    assert set(normal.kinds) == {"knob", "kernel"}
    assert ultra.candidates_per_iteration > 1 and "kernel" in ultra.kinds
    assert ultra.reasoning_effort == "high" and ultra.budget_usd > normal.budget_usd
    assert tiers.price(ultra.model).output > tiers.price(normal.model).output  # the stronger model


def test_every_llm_tier_has_a_priced_model():
    tiers = load_tiers()
    for tier in tiers.tiers.values():
        if tier.uses_llm:
            price = tiers.price(tier.model)
            assert 0 < price.cached <= price.input < price.output


def test_user_file_overrides_fields_of_a_packaged_tier_and_adds_prices(tmp_path):
    path = write(tmp_path, '[tiers.normal]\nmodel = "llama3"\n\n[prices."*"]\ninput = 0\noutput = 0\n')
    tiers = load_tiers(path)
    normal = tiers.tier("normal")
    assert normal.model == "llama3" and normal.candidates_per_iteration == 1  # rest kept
    assert tiers.price("llama3") == Price(input=0, output=0)
    assert tiers.price("gpt-5").input == 1.25  # named prices still win over "*"


def test_user_file_may_add_a_complete_tier(tmp_path):
    path = write(tmp_path, 'default = "local"\n[tiers.local]\nmodel = "qwen"\nmax_iterations = 3\n'
                           'candidates_per_iteration = 2\nkinds = ["knob"]\nbudget_usd = 0\n')
    tiers = load_tiers(path)
    assert tiers.tier().name == "local" and tiers.tier().kinds == ("knob",)


@pytest.mark.parametrize("text, problem", [
    ("[tiers.normal\nmodel = 1", "not valid TOML"),
    ('[tiers.new]\nmodel = "m"\nkinds = ["knob"]\nbudget_usd = 1\ncandidates_per_iteration = 1\n',
     "tiers.new.max_iterations: Field required"),
    ('[tiers.normal]\nkinds = ["knob", "rewrite"]\n', "tiers.normal.kinds.1"),
    ('[tiers.normal]\nkinds = []\n', "tiers.normal.kinds"),
    ('[tiers.normal]\nbudget_usd = -1\n', "tiers.normal.budget_usd"),
    ('[tiers.normal]\nmax_iteration = 5\n', "tiers.normal.max_iteration: Extra inputs"),
    ('[prices.m]\ninput = 1\n', "prices.m.output: Field required"),
    ('default = "turbo"\n', "default tier 'turbo' is not defined"),
])
def test_bad_files_fail_with_one_sentence_naming_file_and_problem(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_tiers(path)
    message = str(info.value)
    assert str(path) in message and problem in message and "\n" not in message.strip()


def test_missing_file_and_unknown_tier_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tiers(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="unknown tier 'turbo'; known tiers: normal, offline, ultra"):
        load_tiers().tier("turbo")


def test_price_for_unknown_model_refuses_unless_a_star_default_exists():
    prices = {"a": Price(input=1, output=2)}
    with pytest.raises(ConfigError, match="model 'b' has no price"):
        price_for(prices, "b")
    star = Price(input=0, output=0)
    assert price_for(prices | {"*": star}, "b") is star
    assert Price(input=3, output=4).cached == 3  # no cached price: charged as full input


@pytest.mark.parametrize("unset", ['""', "false"])
def test_a_tiers_file_can_take_the_reasoning_effort_away_for_a_model_that_refuses_it(tmp_path, unset):
    tiers = load_tiers(write(tmp_path, f'[tiers.ultra]\nmodel = "llama3"\nreasoning_effort = {unset}\n'))
    assert tiers.tier("ultra").reasoning_effort is None and tiers.tier("normal").reasoning_effort == "medium"


def test_llm_tiers_repair_malformed_replies_and_rejected_kernels_and_a_file_can_change_how_often(tmp_path):
    tiers = load_tiers()
    assert tiers.tier("offline").kernel_repairs == 0
    assert tiers.tier("normal").reply_repairs >= 1 and tiers.tier("normal").kernel_repairs >= 1
    assert tiers.tier("ultra").kernel_repairs >= tiers.tier("normal").kernel_repairs
    mine = load_tiers(write(tmp_path, "[tiers.normal]\nkernel_repairs = 5\nreply_repairs = 0\n")).tier("normal")
    assert (mine.kernel_repairs, mine.reply_repairs) == (5, 0)
    with pytest.raises(ConfigError, match="tiers.normal.kernel_repairs"):
        load_tiers(write(tmp_path, "[tiers.normal]\nkernel_repairs = -1\n"))


def test_a_missing_price_tells_the_user_the_toml_table_to_add_on_the_command_line(tmp_path, monkeypatch):
    """Rich markup would take `[prices."m"]` for a style tag and print "add  (or a  default)"."""
    from typer.testing import CliRunner

    from sg_opt.cli import app

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-unused-123456")
    path = write(tmp_path, '[tiers.normal]\nmodel = "unpriced-model"\n')
    result = CliRunner().invoke(app, ["optimize", "--target", "tests.fixtures.agent_target:target", "--size", "tiny",
                                      "--tier", "normal", "--tiers", str(path), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2
    said = " ".join((result.stderr or result.output).split())
    assert 'add [prices."unpriced-model"] (or a [prices."*"] default)' in said
