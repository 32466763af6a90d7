"""The one dotted-key walk (paco.core.dotted), and the one resources rule the launcher and the
Snakefile's jobs share (paco.core.launch.resources_at)."""

from __future__ import annotations

import pytest

from paco.core.dotted import DottedKeyError, get_dotted, set_dotted

TREE = {"grpo": {"t2is": {"rollout": {"noise_level": 0.7, "steps": None}, "rewards": ["judge"]}}}


def test_get_dotted_walks_mappings_and_names_the_missing_part():
    assert get_dotted(TREE, "grpo.t2is.rollout.noise_level") == 0.7
    assert get_dotted(TREE, "grpo.t2is.rollout.steps", 5) is None  # a value that is None is a value
    assert get_dotted(TREE, "grpo") is TREE["grpo"]
    with pytest.raises(DottedKeyError) as missing:
        get_dotted(TREE, "grpo.t2is.train.lr")
    assert (missing.value.key, missing.value.part, missing.value.parent) == ("grpo.t2is.train.lr", "train", "grpo.t2is")
    assert str(missing.value) == "'grpo.t2is.train.lr': no 'train' under 'grpo.t2is'"
    with pytest.raises(KeyError, match=r"'x': no 'x'$"):
        get_dotted(TREE, "x")
    with pytest.raises(KeyError, match=r"no '0' under 'grpo.t2is.rewards' \('grpo.t2is.rewards' is a list"):
        get_dotted(TREE, "grpo.t2is.rewards.0")  # a list is not walked into
    assert get_dotted(TREE, "grpo.t2is.rewards.0", "d") == "d" and get_dotted(TREE, "grpo.edit", None) is None


def test_set_dotted_adds_missing_mappings_and_keeps_the_rest():
    tree = {"grpo": {"t2is": {"rollout": {"noise_level": 0.7}}}}
    set_dotted(tree, "grpo.t2is.rollout.noise_level", 0.5)
    set_dotted(tree, "grpo.edit.train.lr", 1e-4)
    set_dotted(tree, "seed", 3)
    assert tree == {"grpo": {"t2is": {"rollout": {"noise_level": 0.5}}, "edit": {"train": {"lr": 1e-4}}}, "seed": 3}
    with pytest.raises(DottedKeyError, match=r"no 'x' under 'seed' \('seed' is a int"):
        set_dotted(tree, "seed.x", 1)


def test_the_launcher_and_the_snakefile_read_the_same_resources(tmp_path):
    import yaml

    from paco.core.launch import LaunchError, member_resources, resources_at
    from workflow.registry import by_name

    config = {"resources": {"default": {"processes": 1, "gpus": 0, "mem_mb": 100},
                            "stages": {"reasons": {"processes": 2}}},
              "grpo": {"t2is": {"resources": {"gpus": 4, "nodes": 2}}, "edit": {}}}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(config))
    expected = {"reasons": {"processes": 2, "gpus": 0, "mem_mb": 100},
                "grpo@t2is": {"processes": 1, "gpus": 4, "mem_mb": 100, "nodes": 2},
                "grpo@edit": {"processes": 1, "gpus": 0, "mem_mb": 100}}
    for name, want in expected.items():
        stage, key = by_name(name), name.partition("@")[2]
        member = next(m for m in stage.members(config) if m.key in (key or None, None))
        block = member.resolve(stage.resources_block, {})
        assert member.resources(config) == resources_at(config, block) == member_resources(str(params), block) == want
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**config, "grpo": {"t2is": {"resources": ["gpus"]}}}))
    with pytest.raises(LaunchError, match=r"--resources grpo.t2is.resources: .*bad.yaml holds no resources mapping"):
        member_resources(str(bad), "grpo.t2is.resources")
