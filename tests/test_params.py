"""params.yaml validation: the committed file is valid; unknown or mistyped keys are named."""

from pathlib import Path

import pytest
import yaml

from paco.params import Params, ParamsError, load_params, validate_params

ROOT = Path(__file__).resolve().parents[1]


def committed() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_committed_params_validate_and_set_every_field():
    raw = committed()
    params = validate_params(raw)
    # every section and field of the schema is spelled out in params.yaml (no hidden defaults)
    dumped = params.model_dump(by_alias=True)
    for section, fields in dumped.items():
        assert section in raw, section
        for key in fields:
            assert key in raw[section], f"{section}.{key} missing from params.yaml"


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("subfigures", "tolerence"), 0.1, "subfigures.tolerence: Extra inputs are not permitted"),
        (("composites", "photos", "gutter"), [0, 2], "composites.photos.gutter: Extra inputs"),
        (("prompts", "test_fraction"), "a quarter", "prompts.test_fraction"),
        (("pairs", "ranking"), "clip", "pairs.ranking"),
        (("nonsense",), {}, "nonsense: Extra inputs are not permitted"),
        (("composites", "photos", "levels"), [0, 1, 2, 3], "tied rankings"),
        (("composites", "seeds_per_prompt"), 3, "seeds_per_prompt is 3"),
        (("judge", "top_logprobs"), 50, "exceeds server.max_logprobs 20"),
        (("reward_train", "augment", "crop_scale"), [0.9, 0.5], "crop_scale [0.9, 0.5]"),
    ],
)
def test_bad_keys_are_named(path, value, needle):
    raw = committed()
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ParamsError) as err:
        validate_params(raw, source="params.yaml")
    assert needle in str(err.value)


def test_load_params_errors(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ParamsError, match="top level must be a mapping"):
        load_params(bad)


def test_params_are_immutable():
    params = Params()
    with pytest.raises(Exception):
        params.prompts.seed = 3  # frozen: stages cannot mutate shared config


def test_paper_preset_validates_and_mirrors_the_default_sections():
    paper = yaml.safe_load((ROOT / "workflow/presets/paper.yaml").read_text())
    validate_params(paper, source="paper.yaml")
    assert set(paper) == set(committed())
    assert paper["models"]["judge_base"] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert paper["composites"]["generate"]["height"] == 1024
