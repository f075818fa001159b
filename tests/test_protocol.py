"""Knob domains, config parsing and target resolution: bad input gets one clear sentence."""

import pytest

from sg_opt.config import build_overrides, load_config_file, parse_sets
from targets.haste_rec.knobs import KNOB_SPACE
from targets.protocol import ConfigError, Knob
from targets.registry import resolve_target


def test_knob_domains_are_enforced():
    knob = Knob("x", "int", 2, why="w", category="data", numerics="exact", low=0, high=4)
    assert knob.parse("3") == 3
    for bad in ("5", "-1", "two", "2.5"):
        with pytest.raises(ConfigError, match="knob x"):
            knob.parse(bad)
    flag = Knob("f", "bool", False, why="w", category="data", numerics="exact")
    assert flag.parse("true") is True and flag.parse("0") is False
    with pytest.raises(ConfigError):
        flag.validate("yes")


def test_bad_category_or_class_is_rejected():
    with pytest.raises(ValueError):
        Knob("x", "bool", False, why="w", category="speed", numerics="exact")
    with pytest.raises(ValueError):
        Knob("x", "bool", False, why="w", category="data", numerics="roughly")


def test_parse_sets_types_values_per_knob():
    values = parse_sets(["precision=bf16", "data_workers=2", "pin_memory=true", "group_size=16"], KNOB_SPACE)
    assert values == {"precision": "bf16", "data_workers": 2, "pin_memory": True, "group_size": 16}


@pytest.mark.parametrize("item,words", [
    ("nosuchknob=1", "unknown knob"),
    ("precision=fp8", "precision"),
    ("data_workers=3", "data_workers"),
    ("precision", "name=value"),
])
def test_bad_sets_fail_with_one_sentence(item, words):
    with pytest.raises(ConfigError, match=words):
        parse_sets([item], KNOB_SPACE)


def test_constraints_are_checked():
    with pytest.raises(ConfigError, match="dense needs embedding_placement device"):
        build_overrides(KNOB_SPACE, None, ["embedding_placement=host"])
    assert build_overrides(KNOB_SPACE, None, ["embedding_placement=host", "embedding_grad_mode=fused"])


def test_config_file(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[knobs]\nprecision = "bf16-autocast"\ndata_workers = 2\n')
    assert load_config_file(good) == {"precision": "bf16-autocast", "data_workers": 2}
    flat = tmp_path / "flat.toml"
    flat.write_text('precision = "bf16"\n')
    assert build_overrides(KNOB_SPACE, str(flat), ["precision=fp32"]) == {"precision": "fp32"}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("precision = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config_file(broken)


def test_resolve_target_by_name_path_and_errors():
    assert resolve_target("haste-rec").name == "haste-rec"
    assert resolve_target("tests.fixtures.faulty_target:target").name == "faulty"
    with pytest.raises(ConfigError, match="unknown target"):
        resolve_target("nope")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_target("no_such_module:thing")
    with pytest.raises(ConfigError, match="no attribute"):
        resolve_target("tests.fixtures.faulty_target:missing")


def test_single_process_values_are_refused_on_several_ranks_and_never_tuned_there():
    """A torch.distributed session has no path for the fused tail loss, the packed batches or the dense CUDA
    graphs: on several ranks they are one clear sentence, never a run that measures without them, and no proposer
    is offered a knob left with one value there."""
    config = KNOB_SPACE.resolve({"data_workers": 2, "pack_batches": True})
    KNOB_SPACE.check_ranks(config, 1)
    with pytest.raises(ConfigError, match="pack_batches = True runs on one process only.*takes false"):
        KNOB_SPACE.check_ranks(config, 2)
    tail = KNOB_SPACE["tail_backend"]
    assert tail.values(2) == ("torch", "slots", "triton") and "triton-fused-loss" in tail.domain(1)
    one, two = ({k.name for k in KNOB_SPACE.tunable(r)} for r in (1, 2))
    assert {"pack_batches", "dense_cuda_graph"} <= one - two and "embedding_cache_prefetch" in two
    assert "tail_backend" in two and "embedding_sharding" in two - one
    with pytest.raises(ValueError, match="its default must run on several ranks"):
        Knob("x", "bool", False, why="w", category="data", numerics="exact", single_process=(False,))
