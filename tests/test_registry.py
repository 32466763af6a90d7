"""One DAG, two engines: dvc.yaml is the registry's rendering, and DVC and Snakemake agree."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workflow import code_deps, registry
from workflow.code_digests import CODE_STAGE
from workflow.stage import interpolate, model_roles

ROOT = Path(__file__).resolve().parents[1]


def test_committed_dvc_yaml_is_the_rendered_registry():
    assert (ROOT / "dvc.yaml").read_text() == registry.dump_dvc(), (
        "dvc.yaml is stale: run `python -m workflow.registry > dvc.yaml`"
    )


def test_importing_the_registry_reads_no_source_file():
    """The code closures are derived when asked (a stage process imports the registry for its own
    member): importing it, or rendering dvc.yaml, parses none of the project's files and imports
    neither pandas nor torch; asking for a closure does parse."""
    probe = ("import sys; import workflow.code_deps as c; parsed = []\n"
             "for name in ('_project_imports', '_lazy_exports'):\n"
             "    f = getattr(c, name); setattr(c, name, lambda p, f=f: (parsed.append(p), f(p))[1])\n"
             "import workflow.registry as r; r.dump_dvc(); n = len(parsed)\n"
             "heavy = sorted({'pandas', 'torch'} & set(sys.modules))\n"
             "r.by_name('grpo').code\n"
             "print(n, heavy, len(parsed) > 0)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "[]", "True"], out


def test_every_stage_declares_existing_code_and_params_sections():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for stage in registry.STAGES:
        assert (ROOT / "stages" / f"{stage.name}.py").is_file()
        for dep in stage.code:
            assert (ROOT / dep).exists(), f"{stage.name}: code dep {dep} missing"
        members = stage.members(params)
        assert members, stage.name
        for m in members:
            for key, value in m.params_sections(params).items():
                assert value is not None, f"{m.dvc_name}: params key {key} missing"
            # every placeholder resolves against params.yaml (and the foreach item)
            for text in (stage.cmd, *stage.dep_paths, *stage.outs, *stage.active_out_dirs(params),
                         *stage.plot_outs):
                assert "${" not in m.resolve(text, params), text
        # outputs live under data/<stage>/ (docs/architecture.md §3)
        for out in stage.outs + stage.active_out_dirs(params) + stage.metrics + stage.plot_outs + stage.persist:
            assert out.startswith(f"data/{stage.name}/"), out


def test_code_deps_are_the_import_closure():
    """A stage's code deps are derived from its imports (module and function level, lazily
    exported names, the judge server it starts as a process), so editing any module it runs
    reruns it, and a module it does not run never does."""
    grpo = set(registry.by_name("grpo").code)
    assert {"stages/grpo.py", "paco/grpo/trainer.py", "paco/grpo/sde.py", "paco/serving/endpoint.py", "paco/core/run_identity.py",
            "paco/core/seeding.py", "paco/serving/server/batching.py", "paco/models/loading.py"} <= grpo
    # seeding lives apart from the photo renderer: editing photos does not rerun GRPO
    assert not {"paco/data/photos.py", "paco/data/composites.py", "paco/judge/teachers/template.py"} & grpo
    assert "paco/serving/server/batching.py" not in registry.by_name("reward_train").code
    assert "paco/judge/teachers/template.py" in registry.by_name("reasons").code
    # lazily exported names: paco.models' _EXPORTS maps load_judge to paco/models/loading.py
    assert "paco/models/loading.py" in registry.by_name("reward_eval").code
    for stage in registry.STAGES:
        assert f"stages/{stage.module or stage.name}.py" in stage.code
        assert list(stage.code) == sorted(set(stage.code))


def test_code_closure_follows_function_level_and_lazy_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "paco"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "stages").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text('_EXPORTS = {"thing": "impl"}\n')
    (pkg / "sub" / "impl.py").write_text("import json\n")
    (pkg / "lazy.py").write_text("def f():\n    from paco.sub import thing\n")
    (pkg / "unused.py").write_text("")
    (tmp_path / "stages" / "s.py").write_text("import os\nfrom paco import lazy\n")
    monkeypatch.setattr(code_deps, "ROOT", tmp_path)
    code_deps.code_closure.cache_clear()
    code_deps._lazy_exports.cache_clear()
    code_deps._project_imports.cache_clear()
    try:
        assert code_deps.code_closure("stages/s.py") == (
            "paco/__init__.py", "paco/lazy.py", "paco/sub/__init__.py", "paco/sub/impl.py", "stages/s.py")
    finally:
        code_deps.code_closure.cache_clear()
        code_deps._lazy_exports.cache_clear()
        code_deps._project_imports.cache_clear()


def test_foreach_members_take_their_item():
    params = {"grpo": {"a": {"policy": "p1", "dataset": "prompts", "resources": {"processes": 3, "accelerate_config": "ddp"}},
                       "b": {"policy": "p2", "dataset": "edits"}},
              "resources": {"default": {"processes": 1, "gpus": 0}}, "judge_endpoint": {"model": "data/models/j"}}
    stage = registry.by_name("grpo@a")
    assert stage.name == "grpo"
    a, b = stage.members(params)
    assert (a.dvc_name, a.rule_name, b.dvc_name) == ("grpo@a", "grpo_a", "grpo@b")
    assert "--num_processes 3" in a.resolve(stage.cmd, params)
    assert "workflow/accelerate/ddp.yaml" in a.resolve(stage.cmd, params)
    assert "data/models/p2" in " ".join(b.deps(params)) and "data/edits/edits.parquet" in b.deps(params)
    assert "data/prompts/prompts.parquet" in a.deps(params) and "data/models/j" in a.deps(params)
    assert a.resources(params)["processes"] == 3 and b.resources(params) == {"processes": 1, "gpus": 0}
    assert a.params_sections({**params, "judge_endpoint": {"x": 1}, "subfigures": {}})["grpo.a"]["policy"] == "p1"
    with pytest.raises(KeyError, match="final_samples"):
        registry.by_name("final_samples").members(params)


def test_interpolate_is_strict():
    assert interpolate("--x ${a.b}", {"a": {"b": 3}}) == "--x 3"
    with pytest.raises(KeyError, match="c"):
        interpolate("${a.c}", {"a": {"b": 3}})


def _dvc_edges(root: Path = ROOT, *, code_stage: bool = False) -> set[tuple[str, str]]:
    """``dvc dag``'s edges, by Snakemake's rule names; those of DVC's code stage only with
    ``code_stage`` (Snakemake has no such rule: its rules list the code files themselves)."""
    out = subprocess.run(
        [sys.executable, "-m", "dvc", "dag", "--dot"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    # foreach members are grpo@t2is in DVC and rule grpo_t2is in Snakemake
    edges = re.findall(r'"?([\w@.-]+)"?\s*->\s*"?([\w@.-]+)"?', out)
    return {(a.replace("@", "_"), b.replace("@", "_")) for a, b in edges if code_stage or a != CODE_STAGE}


def _snakemake_edges(root: Path = ROOT) -> set[tuple[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--rulegraph", "--cores", "1", "--quiet", "all"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout
    labels = dict(re.findall(r'(\d+)\[label = "([^"]+)"', out))
    edges = {(labels[a], labels[b]) for a, b in re.findall(r"(\d+) -> (\d+)", out)}
    return {(a, b) for a, b in edges if "all" not in (a, b)}


def test_dvc_and_snakemake_have_the_same_edges():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    names = {m.rule_name for s in registry.STAGES for m in s.members(params)}
    dvc, smk = _dvc_edges(code_stage=True), _snakemake_edges()
    assert dvc, "dvc dag printed no edges"
    # DVC's code stage (its digest files stand for each stage's code) precedes every stage
    assert {b for a, b in dvc if a == CODE_STAGE} == names and not {a for a, b in dvc if b == CODE_STAGE}
    dvc = {(a, b) for a, b in dvc if a != CODE_STAGE}
    assert dvc == smk
    # every stage is on an edge but params_check, which stands alone (it only validates the file)
    assert {n for e in dvc for n in e} == names - {"params_check"}
    assert {"grpo_t2is", "final_samples_t2is", "grpo_kontext_editing", "final_samples_kontext_editing"} <= names
    # a subtask's items follow its dataset: edits feed the editing subtasks only
    assert ("edits", "grpo_kontext_editing") in dvc and ("edits", "grpo_t2is") not in dvc
    assert ("prompts", "grpo_t2is") in dvc and ("prompts", "grpo_kontext_editing") not in dvc


@pytest.mark.parametrize("processes", [1, 2])
def test_accelerate_stages_check_params_before_launching(tmp_path, processes):
    """An invalid params file stops an accelerate stage before the launch, in place or under
    ``accelerate launch``: one message, exit code 2, no torch-elastic traceback from every
    process, no stage output."""
    stage = registry.by_name("reward_train")
    assert stage.cmd.startswith("python -m paco.core.launch --config_file workflow/accelerate/")
    cmd = (stage.cmd.replace("${resources.stages.reward_train.accelerate_config}", "cpu")
           .replace("${resources.stages.reward_train.processes}", str(processes)))
    (tmp_path / "workflow").symlink_to(ROOT / "workflow")
    (tmp_path / "params.yaml").write_text("reward_train: {learning_rate: .inf}\n")
    proc = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "reward_train.learning_rate" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()


def test_deps_follow_the_params_that_select_them():
    """A scale switch changes what a stage reads, so it reruns only for inputs it reads: the
    photo composites do not depend on the policy, the ground-truth ranking not on CLIP."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    deps = {s: registry.render_dvc(params)["stages"][s]["deps"] for s in ("composites", "pairs", "reward_eval")}
    assert params["composites"]["source"] == "photos" and params["pairs"]["ranking"] == "ground_truth"
    assert "data/models/policy_t2is" not in deps["composites"] and "${composites.import.dir}" not in deps["composites"]
    assert "data/models/clip" not in deps["pairs"] and "${pairs.annotations}" not in deps["pairs"]
    assert {"data/models/judge_base", "data/models/clip"} <= set(deps["reward_eval"])
    params["composites"]["source"] = "generate"
    params["pairs"]["ranking"] = "annotations"
    params["reward_eval"]["baselines"] = ["clip_i"]
    deps = {s: registry.render_dvc(params)["stages"][s]["deps"] for s in ("composites", "pairs", "reward_eval")}
    assert "data/models/policy_t2is" in deps["composites"] and "${composites.import.dir}" not in deps["composites"]
    assert "${pairs.annotations}" in deps["pairs"] and "data/models/clip" not in deps["pairs"]
    assert "data/models/judge_base" not in deps["reward_eval"] and "data/models/clip" in deps["reward_eval"]
    member = registry.by_name("pairs").members(params)[0]
    assert params["pairs"]["annotations"] in member.deps(params)  # resolved for both engines
    # the editing pairs read the edits only when asked; the editing benchmark reads what it names
    assert "data/edits/edits.parquet" in deps["pairs"] and "data/pairs/edit_pairs.parquet" in deps["reward_eval"]
    params["pairs"]["editing"] = False
    params["reward_eval"]["edit_benchmark"] = "editreward"
    deps = {s: registry.render_dvc(params)["stages"][s]["deps"] for s in ("pairs", "reward_eval")}
    assert "data/edits/edits.parquet" not in deps["pairs"]
    assert "data/pairs/edit_pairs.parquet" not in deps["reward_eval"] and "${reward_eval.editreward}" in deps["reward_eval"]


def test_params_check_refuses_a_dvc_yaml_rendered_for_other_params(tmp_path):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["composites"]["source"] = "generate"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "stages.params_check", "--params", str(tmp_path / "params.yaml"),
                           "--out", str(tmp_path / "p.json"), "--dvc-yaml", str(ROOT / "dvc.yaml")], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "python -m workflow.registry > dvc.yaml" in proc.stderr
    (tmp_path / "dvc.yaml").write_text(registry.dump_dvc(params))
    proc = subprocess.run([sys.executable, "-m", "stages.params_check", "--params", str(tmp_path / "params.yaml"),
                           "--out", str(tmp_path / "p.json"), "--dvc-yaml", str(tmp_path / "dvc.yaml")], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_dvc_ignores_snakemakes_directory_timestamps():
    """Snakemake writes ``.snakemake_timestamp`` into every ``directory()`` output; DVC must not
    count it, or a Snakemake run would make ``dvc status`` report byte-identical model
    directories as modified (issue 11)."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "check-ignore", "data/models/judge_base/.snakemake_timestamp"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = subprocess.run([sys.executable, "-m", "dvc", "check-ignore", "data/models/judge_base/config.json"],
                          cwd=ROOT, capture_output=True, text=True)
    assert kept.returncode == 1


def test_model_roles_come_from_the_params():
    """A further ``models:`` key is a role: the models stage builds ``data/models/<role>`` (in
    dvc.yaml and the Snakefile), and a subtask may use it as its policy (issue 10)."""
    from paco.core.params import ParamsError, validate_params

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert model_roles(params) == ("judge_base", "policy_t2is", "clip", "pickscore", "policy_kontext",
                                   "policy_qwen_edit")
    params["models"]["policy_other"] = "tiny:flux"
    params["grpo"]["other"] = {**params["grpo"]["t2is"], "policy": "policy_other"}
    models = next(s for s in registry.STAGES if s.name == "models")
    assert set(models.active_out_dirs(params)) == {f"data/models/{r}" for r in
                                                   ("judge_base", "policy_t2is", "clip", "pickscore",
                                                    "policy_kontext", "policy_qwen_edit", "policy_other")}
    rendered = registry.render_dvc(params)["stages"]
    assert "data/models/policy_other" in rendered["models"]["outs"]
    assert validate_params(params, source="x").models.roles()["policy_other"] == "tiny:flux"
    params["grpo"]["kontext"] = params["grpo"]["other"]
    params["grpo"]["kontext"]["policy"] = "policy_nope"
    with pytest.raises(ParamsError, match="policy_nope"):
        validate_params(params, source="x")
    params["grpo"]["kontext"]["policy"] = "policy_kontext"
    params["models"]["Bad-Role"] = "tiny:flux"
    with pytest.raises(ParamsError, match="Bad-Role"):
        validate_params(params, source="x")
    del params["models"]["Bad-Role"]
    params["models"]["policy_kontext"] = 3
    with pytest.raises(ParamsError, match="policy_kontext"):
        validate_params(params, source="x")


def test_launch_only_keys_rerun_nothing_in_either_engine():
    """A subtask's ``resources`` (and ``rollout.overlap_rewards``) are not params deps: dvc.yaml
    lists the section's other keys and Snakemake's rerun trigger leaves them out, so raising a
    SLURM ``runtime`` or ``mem_mb`` reruns nothing; ``processes`` and ``accelerate_config`` are in
    the command, whose change reruns the stage (checked with ``dvc status`` by hand: issue 9/11
    closing note)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    grpo = next(s for s in registry.STAGES if s.name == "grpo")
    entries = grpo.params_entries(params)
    assert "grpo.${key}.epochs" in entries and "grpo.${key}.rollout.num_steps" in entries
    assert not any("resources" in e or "overlap_rewards" in e for e in entries)
    assert "grpo.${key}" not in entries and "subfigures" in entries
    # judge_endpoint is listed by its keys but server.gpus (how the job's GPUs are split)
    assert {"judge_endpoint.url", "judge_endpoint.server.engine", "judge_endpoint.server.dtype"} <= set(entries)
    assert "judge_endpoint" not in entries and "judge_endpoint.server.gpus" not in entries
    assert "${item.resources.processes}" in grpo.cmd and "${item.resources.accelerate_config}" in grpo.cmd
    # every key of the section but the launch-only ones is covered
    section = params["grpo"]["t2is"]
    covered = {e.split(".", 2)[2].split(".")[0] for e in entries if e.startswith("grpo.")}
    assert covered == set(section) - {"resources"}
    member = grpo.members(params)[0]
    sections = member.params_sections(params)
    assert "resources" not in sections["grpo.t2is"] and "overlap_rewards" not in sections["grpo.t2is"]["rollout"]
    before = dict(sections)
    params["grpo"]["t2is"]["resources"]["runtime"] += 60
    assert member.params_sections(params) == before
    # judge_endpoint.server.gpus is launch-only for both stages that serve a judge; its engine is not
    for stage in (grpo, registry.by_name("final_samples")):
        m = stage.members(params)[0]
        judge_before = m.params_sections(params)
        assert "gpus" not in judge_before["judge_endpoint"]["server"]
        params["judge_endpoint"]["server"]["gpus"] = 1
        assert m.params_sections(params) == judge_before, stage.name
        params["judge_endpoint"]["server"]["gpus"] = 0
        params["judge_endpoint"]["server"]["engine"] = "vllm"
        assert m.params_sections(params) != judge_before, stage.name
        params["judge_endpoint"]["server"]["engine"] = "paco"
        assert "--serves_judge -m stages." in stage.cmd
    assert "--serves_judge" not in registry.by_name("reward_train").cmd
    # the benchmark starts evaluator servers too, but through the launcher without the judge split:
    # its evaluators take all of the member's GPUs in turn
    bench = registry.by_name("benchmark").cmd
    assert bench.startswith("python -m paco.core.launch ") and "--serves_judge" not in bench
    assert "--num_processes ${item.resources.processes} --resources benchmark.${key}.resources -m stages.benchmark " in bench
    # the committed params write every subtask with the same keys, so no foreach stage falls back
    # to tracking its whole section (resources included) in either engine
    for stage in (s for s in registry.STAGES if s.foreach):
        assert f"{stage.foreach}.${{key}}" not in stage.params_entries(params), stage.name
        assert not any(e.endswith(".resources") for e in stage.params_entries(params)), stage.name
    # members that do not share their keys: the whole section is tracked (nothing goes untracked)
    params["grpo"]["other"] = {k: v for k, v in params["grpo"]["t2is"].items() if k != "save_every"}
    assert "grpo.${key}" in grpo.params_entries(params)


_LOCALRULES = """
import json
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import OutputSettings, ResourceSettings
with SnakemakeApi(OutputSettings()) as api:
    workflow = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=Path("Snakefile"))._workflow
    print(json.dumps(sorted(workflow._localrules)))
"""


def test_the_downloading_stages_are_the_snakefiles_localrules():
    """``models`` (the only stage that downloads) runs on the submitting host under a SLURM
    profile and every other rule is submitted: the localrules Snakemake reads from the Snakefile
    (parsed by Snakemake's API, no job run) are exactly the downloading stages' rules."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert [s.name for s in registry.STAGES if s.downloads] == ["models"]
    assert registry.local_rules(params) == ["models"]
    out = subprocess.run([sys.executable, "-c", _LOCALRULES], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == ["models"]
    # a foreach stage that downloaded would give one local rule per member
    grpo = registry.by_name("grpo")
    object.__setattr__(grpo, "downloads", True)
    try:
        assert registry.local_rules(params) == ["models", *(f"grpo_{k}" for k in params["grpo"])]
    finally:
        object.__setattr__(grpo, "downloads", False)


def _preset_repo(root: Path, preset: str) -> Path:
    """A DVC repo at ``root`` whose params.yaml is ``workflow/presets/<preset>`` and dvc.yaml its
    rendering, with the code linked in and an empty file at every external input (the raw data a
    paper run imports), so both engines can build the DAG."""
    from paco.core.params.base import read_params_yaml

    config = read_params_yaml(ROOT / "workflow" / "presets" / preset)
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text((ROOT / "workflow" / "presets" / preset).read_text())
    (root / "dvc.yaml").write_text(registry.dump_dvc(config))
    for name in ("Snakefile", "workflow", "paco", "stages"):
        (root / name).symlink_to(ROOT / name)
    members = [m for s in registry.STAGES for m in s.members(config)]
    made = {m.resolve(p, config) for m in members for p in (*m.stage.active_out_dirs(config), *m.stage.outs,
                                                              *m.stage.metrics, *m.stage.plot_outs)}
    for dep in {d for m in members for d in m.deps(config)} - made:
        (root / dep).parent.mkdir(parents=True, exist_ok=True)
        (root / dep).touch()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    return root


def _ancestors(edges: set[tuple[str, str]], node: str) -> set[str]:
    found, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a, b in edges:
            if b == n and a not in found:
                found.add(a)
                todo.append(a)
    return found


def test_dag_with_a_released_judge_has_no_judge_training(tmp_path):
    """With the released judge (workflow/presets/paper_released_judge.yaml: judge_endpoint.model
    data/models/paco_reward) GRPO needs no judge training: in both engines grpo@t2is's ancestors
    are the models and prompts stages only; with the judge trained here they hold the whole judge
    half (and reward_eval evaluates whichever judge is named)."""
    judge_half = {"reasons", "reward_train", "reward_merge", "pairs", "subfigures", "composites"}
    default = _dvc_edges()
    assert judge_half <= _ancestors(default, "grpo_t2is")
    repo = _preset_repo(tmp_path / "repo", "paper_released_judge.yaml")
    dvc = _dvc_edges(repo)
    assert dvc == _snakemake_edges(repo)
    assert _ancestors(dvc, "grpo_t2is") == {"models", "prompts"}
    assert not judge_half & _ancestors(dvc, "final_samples_t2is")
    assert ("models", "reward_eval") in dvc and ("reward_merge", "reward_eval") not in dvc
    assert ("reward_merge", "reward_eval") in default
    # the released LoRAs too (paper_released_loras.yaml, grpo: {}): final sampling needs the models
    # and the items only, and no grpo member is rendered (DVC takes an empty foreach)
    loras = _dvc_edges(_preset_repo(tmp_path / "loras", "paper_released_loras.yaml"))
    assert _ancestors(loras, "final_samples_t2is") == {"models", "prompts"}
    assert _ancestors(loras, "final_samples_qwen_editing") == {"models", "edits"}
    assert not any(n.startswith("grpo") for e in loras for n in e)


#: one process (Snakemake's import alone takes seconds): the Snakefile's localrules and each rule's
#: threads (the sbatch profile's ``--cpus-per-task={threads}``), then the CLI's
#: ``snakemake -n --profile workflow/profiles/slurm``
_SLURM_DRY_RUN = _LOCALRULES + """    print(json.dumps({r.name: getattr(r.resources["_cores"], "value", r.resources["_cores"])
                      for r in workflow.rules}))
from snakemake.cli import main
main(["-n", "--profile", "workflow/profiles/slurm"])
"""


def _dry_run_jobs(text: str) -> dict[str, tuple[dict[str, str], str]]:
    """``{rule: (resources, shell command)}`` of a ``snakemake -n`` printout (``printshellcmds``)."""
    jobs = {}
    for block in re.split(r"\n(?=\[[^\]]+\]\n(?:local)?rule )", text):
        name = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        res = re.search(r"^ +resources: (.*)$", block, re.M)
        cmd = re.search(r"^Shell command: (.*)$", block, re.M)
        if name and name[1] != "all":
            assert res and cmd, block
            jobs[name[1]] = (dict(kv.split("=", 1) for kv in res[1].split(", ")), cmd[1])
    return jobs


def test_the_paper_preset_dry_runs_under_the_slurm_profile(tmp_path):
    """``snakemake -n --profile workflow/profiles/slurm`` on a repo whose params.yaml is the paper
    preset (its dvc.yaml rendered, an empty file at every raw input): every grpo job asks 8 GPUs and
    64 CPUs (8 per GPU) and runs 7 processes with its judge served on the eighth; every final_samples
    job asks 2 GPUs (judge and sampler) and 16 CPUs; ``models`` is a local rule (the login node
    downloads) and every other rule is submitted."""
    repo = _preset_repo(tmp_path / "repo", "paper.yaml")
    preset = yaml.safe_load((repo / "params.yaml").read_text())
    proc = subprocess.run([sys.executable, "-c", _SLURM_DRY_RUN], cwd=repo, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.splitlines()[0]) == ["models"]  # the localrules: models runs on the login node
    threads = json.loads(proc.stdout.splitlines()[1])
    jobs = _dry_run_jobs(proc.stdout + proc.stderr)
    names = {m.rule_name for s in registry.STAGES for m in s.members(preset)}
    assert set(jobs) == names
    assert set(preset["grpo"]) and set(preset["final_samples"])
    for key in preset["grpo"]:
        res, cmd = jobs[f"grpo_{key}"]
        assert (res["gpu"], res["gpus_per_node"], res["cpus_per_task"], threads[f"grpo_{key}"]) == ("8", "8", "64", 64)
        assert f"--num_processes 7 --resources grpo.{key}.resources --serves_judge -m stages.grpo " in cmd
    for key in preset["final_samples"]:
        res, cmd = jobs[f"final_samples_{key}"]
        assert (res["gpu"], res["cpus_per_task"], threads[f"final_samples_{key}"]) == ("2", "16", 16), key
        assert f"--num_processes 1 --resources final_samples.{key}.resources --serves_judge -m stages.final_samples " in cmd
    assert "gpu" not in jobs["models"][0]


def test_job_resources_ask_slurm_for_gpus_per_node_and_nodes():
    """The Snakefile's resources (:func:`registry.job_resources`) give snakemake-executor-plugin-slurm's
    sbatch line: one node ``--gpus=G``; ``nodes`` N > 1 ``--nodes=N --ntasks=N --gres=gpu:G`` (G per
    node, never the job total ``--gpus``) as an MPI-typed job (its command is not wrapped in
    ``srun -n1``: paco.core.launch starts one launcher per node itself)."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Res(dict):
        __getattr__ = dict.__getitem__

    class Job:
        def __init__(self, res):
            self.resources, self.threads = Res(res), res["cpus_per_task"]

    def sbatch(**res) -> str:
        job = Job(registry.job_resources({"cpus_per_task": 8, "mem_mb": 1000, "runtime": 10, **res}))
        params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "", "partition": "",
                  "workdir": "/w"}
        return get_submit_command(job, params) + set_gres_string(job)

    # cpus_per_task is per GPU on GPUs: the one task per node runs every GPU's process
    one = sbatch(gpus=8, processes=7)
    assert " --gpus=8" in one and "--nodes" not in one and "--gres" not in one and " --cpus-per-task=64" in one
    assert "--cpus-per-gpu" not in one
    two = sbatch(gpus=8, processes=7, nodes=2)
    assert " --nodes=2 --ntasks=2" in two and " --gres=gpu:8" in two and "--gpus" not in two
    assert " --cpus-per-task=64" in two  # per task, one task per node
    assert registry.job_resources({"gpus": 8, "nodes": 2})["mpi"] == "srun"
    cpu = sbatch()
    assert "--gpus" not in cpu and "--gres" not in cpu and "--ntasks=1" in cpu and " --cpus-per-task=8" in cpu
    # the jobstep's srun (one node) asks the same; the sbatch profile passes the Snakefile's threads
    from snakemake_executor_plugin_slurm_jobstep import get_cpu_setting

    assert get_cpu_setting(Job(registry.job_resources({"gpus": 2, "cpus_per_task": 8})), True) == "--cpus-per-task=16"
    # (the Snakefile's threads are this cpus_per_task: test_the_paper_preset_dry_runs_under_the_slurm_profile)
    profile = yaml.safe_load((ROOT / "workflow" / "profiles" / "sbatch" / "config.yaml").read_text())
    assert "--cpus-per-task={threads}" in profile["cluster-generic-submit-cmd"]
    assert registry.job_resources({"gpus": 2})["gpus_per_node"] == 2 and "nodes" not in registry.job_resources({})


def test_local_model_directories_are_dependencies_of_models():
    """A role (or processor_from entry) naming a local directory, such as the shipped pretrained
    tiny models, is a dependency of ``models`` (a changed weight file reruns it); hub ids and
    ``tiny:`` builds are not paths."""
    from workflow.registry import load_config, render_dvc

    config = load_config()
    config["models"] = {**config["models"], "clip": "data/raw/pretrained/clip", "judge_base": "./my/judge",
                        "policy_t2is": "black-forest-labs/FLUX.1-dev", "pickscore": "tiny:clip",
                        "policy_kontext": "tiny:flux_kontext", "policy_qwen_edit": "Qwen/Qwen-Image-Edit",
                        "processor_from": {"clip": "/abs/processor_dir"}}
    def data_deps(cfg):  # the stage's code digest is a dep too
        return sorted(d for d in render_dvc(cfg)["stages"]["models"]["deps"] if d != "data/code/models.json")

    assert data_deps(config) == ["./my/judge", "/abs/processor_dir", "data/raw/pretrained/clip"]
    # the embedded default's pretrained CLIP, FLUX.1 and Qwen-Image-Edit policies
    assert data_deps(load_config()) == ["data/raw/pretrained/clip", "data/raw/pretrained/flux",
                                        "data/raw/pretrained/flux_kontext", "data/raw/pretrained/qwen_image_edit"]


def test_the_benchmarks_laion_predictor_inputs_are_dependencies():
    """``benchmark.<k>.t2is.aesthetics: laion`` reads a CLIP role and a weights file: both are data
    dependencies of the benchmark members (a new file reruns them); with ``none`` neither is."""
    from paco.core.params.base import read_params_yaml

    config = read_params_yaml(ROOT / "workflow" / "presets" / "paper.yaml")
    t2is = config["benchmark"]["t2is_bench"]["t2is"]
    assert t2is["aesthetics"] == "laion"
    deps = registry.render_dvc(config)["stages"]["benchmark"]["do"]["deps"]
    assert {t2is["aesthetics_clip"], t2is["aesthetics_weights"]} <= set(deps)
    for member in config["benchmark"].values():
        member["t2is"] = {"prompt_alignment": "none", "aesthetics": "none"}
    deps = registry.render_dvc(config)["stages"]["benchmark"]["do"]["deps"]
    assert t2is["aesthetics_weights"] not in deps


def test_the_models_settings_are_the_schemas_keys_that_are_not_roles():
    """``workflow.stage.MODELS_SETTINGS`` (what the registry skips among ``models:`` keys when it lists roles
    and local model directories) is the schema's: a setting added to ``ModelsParams`` must be added there."""
    from paco.core.params import ModelsParams
    from workflow.stage import MODEL_ROLES, MODELS_SETTINGS

    assert MODELS_SETTINGS == set(ModelsParams.model_fields) - set(ModelsParams().roles())
    assert not MODELS_SETTINGS & set(MODEL_ROLES)
