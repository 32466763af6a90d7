"""params.yaml validation: the committed file is valid; unknown or mistyped keys are named."""

from pathlib import Path

import pytest
import yaml

from paco.core.params import Params, ParamsError, load_params, validate_params

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
        (("judge_endpoint", "top_logprobs"), 50, "exceeds server.max_logprobs 20"),
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


# --------------------------------------------------------------------------------------------
# strict types: no bool -> number, no str -> number, finite floats only
# --------------------------------------------------------------------------------------------


def _set(raw: dict, path: tuple, value) -> dict:
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("composites", "seeds_per_prompt"), True, "composites.seeds_per_prompt: Input should be a valid integer"),
        (("grpo", "t2is", "train", "clip_range"), True, "grpo.t2is.train.clip_range: Input should be a valid number"),
        (("prompts", "test_fraction"), "0.25", "prompts.test_fraction: Input should be a valid number (got '0.25', "
                                               "a string"),
        (("reward_train", "learning_rate"), float("inf"), "reward_train.learning_rate: Input should be a finite"),
        (("judge_endpoint", "timeout_s"), float("nan"), "judge_endpoint.timeout_s: Input should be a finite number"),
        (("grpo", "t2is", "aggregation", "delta"), float("inf"),
         "grpo.t2is.aggregation.delta: Input should be a finite number, or Input should be 'mean' or 'median'"),
        (("reward_train", "epochs"), 2.0, "reward_train.epochs: Input should be a valid integer (got 2.0)"),
        (("composites", "photos", "gutter_px"), [True, 2], "composites.photos.gutter_px.0: Input should be a valid"),
        (("composites", "photos", "levels"), [0, 1, "3", 7], "composites.photos.levels.2: Input should be a valid"),
        (("grpo", "t2is", "rewards", "clip_t"), True, "grpo.t2is.rewards.clip_t: Input should be a valid number"),
        (("grpo", "t2is", "rollout", "sigma_max"), True,
         "grpo.t2is.rollout.sigma_max: Input should be a valid number, or Input should be 'schedule' (got True)"),
        (("grpo", "t2is", "rollout", "sigma_max"), 1.0, "grpo.t2is.rollout.sigma_max: Input should be less than 1"),
        (("grpo", "t2is", "rollout", "sigma_max"), "0.98", "grpo.t2is.rollout.sigma_max"),
        (("reasons", "teacher", "fast"), 1, "reasons.teacher.fast: Input should be a valid boolean"),
        (("pairs", "annotations"), 3, "pairs.annotations: Input should be a valid string (got 3)"),
    ],
)
def test_types_are_strict_and_errors_name_the_dotted_key(path, value, needle):
    raw = _set(committed(), path, value)
    with pytest.raises(ParamsError) as err:
        validate_params(raw, source="params.yaml")
    assert needle in str(err.value)


def _leaves(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*prefix, i))
    else:
        yield prefix, node


def test_every_number_in_params_yaml_refuses_bools_and_non_finite_values():
    import copy

    base = committed()
    numbers = [(p, v) for p, v in _leaves(base) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert len(numbers) > 80
    for path, value in numbers:
        key = ".".join(str(p) for p in path)
        for bad in ([True, float("inf"), float("-inf"), float("nan")] if isinstance(value, float) else [True]):
            with pytest.raises(ParamsError) as err:
                validate_params(_set(copy.deepcopy(base), path, bad))
            assert f"  {key}: " in str(err.value), (key, bad, str(err.value))


def test_ints_are_accepted_for_floats_and_new_values_validate():
    raw = committed()
    _set(raw, ("reward_train", "learning_rate"), 1)
    _set(raw, ("grpo", "t2is", "rollout", "sigma_max"), 0.98)
    _set(raw, ("grpo", "t2is", "aggregation", "method"), "harmonic_mean_reference")
    params = validate_params(raw)
    assert params.reward_train.learning_rate == 1.0 and isinstance(params.reward_train.learning_rate, float)
    assert params.grpo["t2is"].rollout.sigma_max == 0.98
    assert params.grpo["t2is"].aggregation.method == "harmonic_mean_reference"
    assert validate_params(committed()).grpo["t2is"].rollout.sigma_max == "schedule"


def test_exponent_floats_without_a_dot_load_as_numbers(tmp_path):
    """YAML 1.2 (DVC) reads 3e-4 as a float; PyYAML's 1.1 resolver would give the string '3e-4'."""
    raw = committed()
    raw["reward_train"]["learning_rate"] = "__LR__"
    text = yaml.safe_dump(raw, sort_keys=False)
    path = tmp_path / "params.yaml"
    path.write_text(text.replace("__LR__", "3e-4"))
    assert load_params(path).reward_train.learning_rate == 3e-4
    path.write_text(text.replace("__LR__", "-1E+2"))
    with pytest.raises(ParamsError, match=r"reward_train.learning_rate: Input should be greater than 0 \(got -100.0\)"):
        load_params(path)
    path.write_text(text.replace("__LR__", "'3e-4'"))  # quoted: a string, refused
    with pytest.raises(ParamsError, match=r"reward_train.learning_rate: Input should be a valid number"):
        load_params(path)


# --------------------------------------------------------------------------------------------
# the whole file: unknown sections, and `python -m paco.core.params`
# --------------------------------------------------------------------------------------------


def _write(tmp_path, raw) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_misspelled_top_level_section_is_an_error(tmp_path):
    raw = committed()
    raw["reward_trian"] = raw["reward_train"]
    with pytest.raises(ParamsError, match="(?m)^  reward_trian: Extra inputs are not permitted$"):
        load_params(_write(tmp_path, raw))


def test_cli_ok_and_errors(tmp_path, capsys):
    from paco.core.params.cli import main

    assert main([str(ROOT / "params.yaml")]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and out.startswith(f"{ROOT / 'params.yaml'}: OK") and err == ""

    raw = committed()
    raw["reward_trian"] = {"epochs": 3}
    raw["grpo"]["t2is"]["train"]["learning_rate"] = float("inf")
    marker = tmp_path / "check" / "ok.json"
    assert main([str(_write(tmp_path, raw)), "--out", str(marker)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert "  reward_trian: Extra inputs are not permitted" in err
    assert "  grpo.t2is.train.learning_rate: Input should be a finite number (got inf)" in err
    assert not marker.exists()

    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "no such params file" in capsys.readouterr().err

    # the marker does not change with the (valid) values, so a stage depending on it does not rerun
    raw = committed()
    path = _write(tmp_path, raw)
    assert main([str(path), "--out", str(marker)]) == 0
    first = marker.read_bytes()
    raw["models"]["seed"] = 7
    _write(tmp_path, raw)
    assert main([str(path), "--out", str(marker)]) == 0
    capsys.readouterr()
    assert b'"valid": true' in first and marker.read_bytes() == first
    raw["models"]["seed"] = "7"
    _write(tmp_path, raw)
    assert main([str(path), "--out", str(marker)]) == 2 and not marker.exists()  # no stale marker


def test_cli_module_exit_code_without_traceback(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {seed: true}\nreward_trian: {}\n")
    proc = subprocess.run([sys.executable, "-m", "paco.core.params", str(bad)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "  models.seed: Input should be a valid integer (got True)" in proc.stderr
    assert "  reward_trian: Extra inputs are not permitted" in proc.stderr


# --------------------------------------------------------------------------------------------
# reward names: the schema checks their shape, params_check and the stages the names
# --------------------------------------------------------------------------------------------


def _misspelled_rewards() -> dict:
    raw = committed()
    raw["grpo"]["t2is"]["rewards"]["clip_tt"] = raw["grpo"]["t2is"]["rewards"].pop("clip_t")
    raw["final_samples"]["kontext_editing"]["rewards"] = ["consistency_for_editin"]
    return raw


def test_the_schema_checks_the_rewards_shape_not_their_names():
    validate_params(_misspelled_rewards())  # names are not the schema's business (it imports no rewards)
    for path, value in ((("grpo", "t2is", "rewards"), {}), (("final_samples", "t2is", "rewards"), [])):
        with pytest.raises(ParamsError) as err:
            validate_params(_set(committed(), path, value), source="params.yaml")
        assert f"  {'.'.join(path)}: Value error, no rewards: name at least one" in str(err.value)


def test_check_reward_names_names_the_dotted_key():
    from paco.grpo.rewards import REWARDS, check_reward_names

    check_reward_names(["consistency", "clip_t"], "final_samples.t2is.rewards")
    check_reward_names({"pickscore": 1.0}, "grpo.t2is.rewards")
    with pytest.raises(ParamsError) as err:
        check_reward_names({"clip_tt": 1.0, "consistency": 0.2}, "grpo.t2is.rewards", source="p.yaml")
    assert str(err.value) == ("p.yaml: invalid parameters\n  grpo.t2is.rewards: unknown reward(s) ['clip_tt']; "
                              f"registered: {sorted(REWARDS)}")


def test_params_check_and_the_reward_stages_refuse_unknown_reward_names(tmp_path, caplog, capsys):
    """``python -m paco.core.params`` passes a misspelled reward (it checks all but the names);
    the ``params_check`` stage (rerun by ``dvc repro`` on any edit of the file) and the stages
    that compute the rewards fail at their start, exit code 2, naming the dotted key."""
    from paco.core.params.cli import main as check_params
    from stages import final_samples, grpo, params_check

    path = _write(tmp_path, _misspelled_rewards())
    assert check_params([str(path)]) == 0
    capsys.readouterr()
    out = tmp_path / "params_check" / "params.json"
    assert params_check.main(["--params", str(path), "--out", str(out)]) == 2 and not out.exists()
    assert "  grpo.t2is.rewards: unknown reward(s) ['clip_tt']" in caplog.text
    missing = {flag: str(tmp_path / "absent" / flag) for flag in ("items", "policy", "judge", "clip", "lora")}
    for stage, subtask, extra, key in (
            (grpo, "t2is", ("checkpoints", "plots", "metrics"), "grpo.t2is.rewards: unknown reward(s) ['clip_tt']"),
            (final_samples, "kontext_editing", ("out", "sheets", "metrics"),
             "final_samples.kontext_editing.rewards: unknown reward(s) ['consistency_for_editin']")):
        caplog.clear()
        argv = ["--params", str(path), "--subtask", subtask]
        for flag in (*missing, *extra):
            argv += [f"--{flag}", missing.get(flag, str(tmp_path / "absent" / flag))]
        assert stage.main(argv) == 2
        assert key in caplog.text and "absent" not in caplog.text  # before reading any input
