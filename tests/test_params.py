"""params.yaml validation: the committed file is valid; unknown or mistyped keys are named."""

from pathlib import Path

import pytest
import yaml

from paco.core.dotted import set_dotted
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
    # the reference's PickScore: PickScore_v1's weights with the ViT-H processor (pickscore_scorer.py l.8-9)
    models = validate_params(paper, source="paper.yaml").models
    assert models.roles()["pickscore"] == "yuvalkirstain/PickScore_v1"
    assert models.processor_from == {"pickscore": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"}


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
    missing = {flag: str(tmp_path / "absent" / flag) for flag in ("items", "policy", "judge", "clip", "pickscore",
                                                                   "lora")}
    for stage, subtask, extra, key in (
            (grpo, "t2is", ("checkpoints", "plots", "metrics"), "grpo.t2is.rewards: unknown reward(s) ['clip_tt']"),
            (final_samples, "kontext_editing", ("base-judge", "out", "sheets", "metrics"),
             "final_samples.kontext_editing.rewards: unknown reward(s) ['consistency_for_editin']")):
        caplog.clear()
        argv = ["--params", str(path), "--subtask", subtask]
        for flag in (*missing, *extra):
            argv += [f"--{flag}", missing.get(flag, str(tmp_path / "absent" / flag))]
        assert stage.main(argv) == 2
        assert key in caplog.text and "absent" not in caplog.text  # before reading any input


def test_a_served_vllm_judge_needs_gpus_and_matching_processes():
    """``judge_endpoint.server``: engine vllm (url null) needs GPUs of its own; with ``gpus`` N > 0
    every grpo / final_samples member holds N + processes GPUs (named by key); an external URL
    asks nothing of the resources. The paper preset is 1 judge GPU + 7 trainer GPUs."""
    def with_server(server: dict, grpo_resources: dict | None = None, url=None) -> dict:
        raw = committed()
        raw["judge_endpoint"]["url"] = url
        raw["judge_endpoint"]["server"].update(server)
        for section, res in (("grpo", {"gpus": 8, "processes": 7}), ("final_samples", {"gpus": 2, "processes": 1}),
                             ("benchmark", {"gpus": 1})):  # a vLLM evaluator's GPU
            for item in raw[section].values():
                item["resources"].update(res)
        raw["grpo"]["t2is"]["resources"].update(grpo_resources or {})
        return raw

    vllm = {"engine": "vllm", "gpus": 1, "dtype": "bfloat16"}
    assert validate_params(with_server(vllm)).judge_endpoint.server.gpus == 1
    with pytest.raises(ParamsError, match="judge_endpoint.server.gpus is 0 with engine vllm"):
        validate_params(with_server({**vllm, "gpus": 0}))
    with pytest.raises(ParamsError, match="grpo.t2is.resources.processes 8: 7 processes expected: 8 GPUs minus "
                                          "judge_endpoint.server.gpus 1"):
        validate_params(with_server(vllm, {"processes": 8}))
    with pytest.raises(ParamsError, match="grpo.t2is.resources.gpus 1: more than judge_endpoint.server.gpus 1"):
        validate_params(with_server(vllm, {"gpus": 1, "processes": 1}))
    # the paco engine on the judge GPUs is checked alike; gpus 0 shares the stage's device as before
    with pytest.raises(ParamsError, match="grpo.t2is.resources.processes 8"):
        validate_params(with_server({"gpus": 1}, {"processes": 8}))
    assert validate_params(with_server({"gpus": 0}, {"processes": 8}))
    assert validate_params(with_server(vllm, {"processes": 8}, url="http://gpu-node:8000/v1"))
    paper = load_params(ROOT / "workflow/presets/paper.yaml")
    assert (paper.judge_endpoint.url, paper.judge_endpoint.server.engine, paper.judge_endpoint.server.gpus) == (
        None, "vllm", 1)
    assert {(k, g.resources.gpus, g.resources.processes) for k, g in paper.grpo.items()} == {
        (k, 8, 7) for k in paper.grpo}
    assert {(f.resources.gpus, f.resources.processes) for f in paper.final_samples.values()} == {(2, 1)}


# --------------------------------------------------------------------------------------------
# released checkpoints as inputs: judge_endpoint.model, final_samples.<k>.lora, their presets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "needle"), [
    ("data/models/nope", "judge_endpoint.model 'data/models/nope': 'nope' is not a models role"),
    ("data/reward_train/adapter", "judge_endpoint.model: Value error, judge_endpoint.model "
                                  "'data/reward_train/adapter': write data/reward_merge/model"),
    ("X-GenGroup/PaCo-Reward-7B", "judge_endpoint.model 'X-GenGroup/PaCo-Reward-7B': write data/reward_merge/model"),
])
def test_a_judge_model_is_the_trained_one_or_a_models_role(model, needle):
    raw = committed()
    raw["judge_endpoint"]["model"] = model
    with pytest.raises(ParamsError) as err:
        validate_params(raw, source="params.yaml")
    assert needle in str(err.value)
    raw["models"]["paco_reward"] = "X-GenGroup/PaCo-Reward-7B"
    raw["judge_endpoint"]["model"] = "data/models/paco_reward"
    assert validate_params(raw).judge_endpoint.model == "data/models/paco_reward"
    assert validate_params(committed()).judge_endpoint.model == "data/reward_merge/model"


def test_a_final_samples_lora_is_a_grpo_lora_of_the_same_model_or_a_released_one():
    raw = committed()
    raw["models"]["lora_a"] = "X-GenGroup/PaCo-FLUX.1-dev-Lora"
    raw["final_samples"]["released"] = {**raw["final_samples"]["t2is"], "lora": "data/models/lora_a"}
    params = validate_params(raw)  # no grpo.released: the LoRA is the models stage's
    assert "released" not in params.grpo and params.final_samples["released"].lora == "data/models/lora_a"
    for lora, needle in (
        ("data/models/lora_b", "final_samples.released.lora 'data/models/lora_b': 'lora_b' is not a models role"),
        ("data/grpo/nope/lora", "final_samples.released.lora 'data/grpo/nope/lora': there is no grpo.nope"),
        ("data/grpo/t2is/lora/", "final_samples.released.lora: Value error, lora 'data/grpo/t2is/lora/': write"),
        ("data/grpo/kontext_editing/lora", "final_samples.released: family/policy flux/policy_t2is differ from "
                                           "grpo.kontext_editing's flux_kontext/policy_kontext"),
    ):
        raw["final_samples"]["released"]["lora"] = lora
        with pytest.raises(ParamsError) as err:
            validate_params(raw, source="params.yaml")
        assert needle in str(err.value), lora
    # another member may sample grpo.t2is's LoRA; a member without a lora is named
    raw["final_samples"]["released"]["lora"] = "data/grpo/t2is/lora"
    assert validate_params(raw).final_samples["released"].lora == "data/grpo/t2is/lora"
    del raw["final_samples"]["released"]["lora"]
    with pytest.raises(ParamsError, match=r"final_samples\.released: Value error, lora is required: write "
                                          r"data/grpo/<subtask>/lora"):
        validate_params(raw, source="params.yaml")


#: what each released preset changes in paper.yaml (dotted key -> value; None: the key is removed)
RELEASED_PRESETS = {
    "paper_released_judge.yaml": {
        "models.paco_reward": "X-GenGroup/PaCo-Reward-7B",
        "judge_endpoint.model": "data/models/paco_reward",
    },
    "paper_released_loras.yaml": {
        "models.paco_reward": "X-GenGroup/PaCo-Reward-7B",
        "models.lora_paco_flux": "X-GenGroup/PaCo-FLUX.1-dev-Lora",
        "models.lora_paco_kontext": "X-GenGroup/PaCo-FLUX.1-Kontext-Lora",
        "models.lora_paco_qwen_edit": "X-GenGroup/PaCo-Qwen-Image-Edit-Lora",
        **{f"models.allow_patterns.{role}": ["adapter_config.json", "adapter_model.safetensors",
                                             "pytorch_lora_weights.safetensors"]
           for role in ("lora_paco_flux", "lora_paco_kontext", "lora_paco_qwen_edit")},
        "judge_endpoint.model": "data/models/paco_reward",
        "grpo": {},
        "final_samples.t2is.lora": "data/models/lora_paco_flux",
        "final_samples.kontext_editing.lora": "data/models/lora_paco_kontext",
        "final_samples.qwen_editing.lora": "data/models/lora_paco_qwen_edit",
        "final_samples.t2is_bench.lora": "data/models/lora_paco_flux",
        "final_samples.kontext_editing_bench.lora": "data/models/lora_paco_kontext",
        "final_samples.qwen_editing_bench.lora": "data/models/lora_paco_qwen_edit",
    },
}


@pytest.mark.parametrize("name", sorted(RELEASED_PRESETS))
def test_released_presets_are_the_paper_preset_with_their_changes(name):
    """Each released preset is paper.yaml plus the changes listed here, no more (no drift), and
    validates and renders for both engines."""
    from paco.core.params.base import read_params_yaml
    from workflow import registry

    expected = read_params_yaml(ROOT / "workflow/presets/paper.yaml")
    for dotted, value in RELEASED_PRESETS[name].items():
        set_dotted(expected, dotted, value)
    preset = read_params_yaml(ROOT / "workflow/presets" / name)
    assert preset == expected
    params = load_params(ROOT / "workflow/presets" / name)
    assert params.judge_endpoint.model == "data/models/paco_reward"
    stages = registry.render_dvc(preset)["stages"]
    assert "${judge_endpoint.model}" in stages["final_samples"]["do"]["deps"]
    members = {m.dvc_name: m for s in registry.STAGES for m in s.members(preset)}
    for key, cfg in params.final_samples.items():
        m = members[f"final_samples@{key}"]
        assert {cfg.lora, "data/models/paco_reward"} <= set(m.deps(preset))


def test_several_nodes_are_for_gpu_stages():
    """``nodes`` > 1 needs GPUs and a GPU accelerate config: ``cpu`` (``use_cpu: true``) would run
    every node's processes on CPU."""
    raw = committed()
    raw["grpo"]["t2is"]["resources"].update(nodes=2, gpus=8, processes=8, accelerate_config="ddp")
    raw["resources"]["stages"]["reward_train"] = {**raw["resources"]["stages"]["reward_train"], "nodes": 2, "gpus": 4,
                                                  "accelerate_config": "zero2"}
    params = validate_params(raw)
    assert (params.grpo["t2is"].resources.nodes, params.resources.for_stage("reward_train").nodes) == (2, 2)
    assert params.resources.default.nodes == 1
    for path in (("grpo", "t2is", "resources"), ("resources", "stages", "reward_train")):
        for change, message in (({"gpus": 0, "accelerate_config": "ddp"}, "nodes 2 with gpus 0"),
                                ({"gpus": 8, "accelerate_config": "cpu"}, "nodes 2 with accelerate_config cpu")):
            raw = committed()
            node = raw
            for key in path:
                node = node[key]
            node.update(nodes=2, **change)
            with pytest.raises(ParamsError, match=r"\.".join(path) + ": Value error, " + message):
                validate_params(raw)


# --------------------------------------------------------------------------------------------
# benchmark.<subtask> (issue 27): each a final_samples member's, its evaluators served or reached
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    (lambda b, raw: raw["benchmark"].update(nope=b), r"benchmark\.nope: no final_samples\.nope"),
    (lambda b, raw: b.update(dataset="edits"), r"benchmark\.t2is: Value error, protocol 't2is' scores dataset "
                                                r"'prompts', not 'edits'"),
    (lambda b, raw: b.update(seeds_per_prompt=5), r"benchmark\.t2is\.seeds_per_prompt 5 exceeds final_samples\.t2is"
                                                  r"\.seeds_per_prompt 4"),
    (lambda b, raw: b["evaluators"]["base"].update(model="data/models/nobody"),
     r"benchmark\.t2is\.evaluators\.base\.model 'data/models/nobody': 'nobody' is not a models role"),
    (lambda b, raw: b["evaluators"]["base"].update(model=None), r"url is null \(the stage serves the evaluator\) "
                                                                r"but no model is given"),
    (lambda b, raw: b["evaluators"]["base"].update(model="data/grpo/t2is/lora"), r"write data/reward_merge/model"),
    (lambda b, raw: b.update(evaluators={}), r"no evaluator"),
    (lambda b, raw: b["resources"].update(processes=2), r"resources\.processes 2, nodes 1: the benchmark is one process"),
    (lambda b, raw: b["resources"].update(nodes=2, gpus=1, accelerate_config="ddp"),
     r"resources\.processes 1, nodes 2: the benchmark is one process on one node"),
    (lambda b, raw: b.update(evaluators={"Qwen-7B": b["evaluators"]["base"]}), r"evaluator names \['Qwen-7B'\]"),
    (lambda b, raw: raw["judge_endpoint"].update(url="http://judge:8000/v1", server={**raw["judge_endpoint"]["server"],
                                                                                  "engine": "vllm", "gpus": 2}),
     r"benchmark\.t2is\.resources\.gpus 0: 2 needed to serve an evaluator with judge_endpoint\.server\.engine vllm"),
])
def test_a_benchmark_member_is_a_final_samples_members_with_usable_evaluators(change, message):
    raw = committed()
    assert set(raw["benchmark"]) <= set(raw["final_samples"])
    change(raw["benchmark"]["t2is"], raw)
    with pytest.raises(ParamsError, match=message):
        validate_params(raw)


def test_benchmark_evaluators_with_urls_need_no_model_nor_gpus():
    raw = committed()
    raw["judge_endpoint"]["server"].update(engine="vllm", gpus=1)
    for member in raw["benchmark"].values():
        for ev in member["evaluators"].values():
            ev.update(model=None, url="http://gpu-node:8000/v1")
    # grpo / final_samples then need the judge's GPU: not the point here
    raw["judge_endpoint"]["url"] = "http://judge:8000/v1"
    assert validate_params(raw).benchmark["t2is"].evaluators["base"].model is None


def test_the_paper_presets_benchmark_with_the_papers_evaluators():
    from workflow import registry

    for name in ("paper.yaml", "paper_released_judge.yaml", "paper_released_loras.yaml"):
        raw = yaml.safe_load((ROOT / "workflow/presets" / name).read_text())
        params = validate_params(raw, source=name)
        # the benchmarks score their own members, which sample the whole case sets natively; the
        # subtasks' own members keep the held-out split for the reward figures
        assert set(params.benchmark) == {f"{k}_bench" for k in ("t2is", "kontext_editing", "qwen_editing")}
        for key in params.benchmark:
            samples, held_out = params.final_samples[key], params.final_samples[key.removesuffix("_bench")]
            assert (samples.split, held_out.split) == ("all", "test")
            assert samples.lora == held_out.lora and samples.policy == held_out.policy
        assert params.final_samples["t2is_bench"].resolution == "native"
        assert params.final_samples["t2is_bench"].seeds_per_prompt == 1
        assert params.models.roles()["evaluator_qwen"] == "Qwen/Qwen2.5-VL-7B-Instruct"
        assert params.models.roles()["evaluator_gemma"] == "google/gemma-3-4b-it"
        for member in params.benchmark.values():
            assert {e.model for e in member.evaluators.values()} == {"data/models/evaluator_qwen",
                                                                     "data/models/evaluator_gemma"}
        assert params.benchmark["kontext_editing_bench"].gedit.scoring == "reply"
        deps = registry.render_dvc(raw)["stages"]["benchmark"]["do"]["deps"]
        assert {"data/models/evaluator_gemma", "data/models/evaluator_qwen"} <= set(deps)
