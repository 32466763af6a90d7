"""The one stage registry behind both engines (docs/architecture.md §1: one DAG, two engines, no drift).

Each :class:`~workflow.stage.Stage` names its command, data dependencies, code dependencies
(:mod:`workflow.code_deps`), params sections, outputs and metrics. :func:`render_dvc` turns the
registry into ``dvc.yaml`` (committed; a test checks it equals the rendering), and the
``Snakefile`` defines one rule per stage from the same objects. The engines track code apart:
a Snakemake rule lists its closure's files, a DVC stage its digest file, written by DVC's own
``code`` stage (:mod:`workflow.code_digests`). :func:`member` gives a stage
member to the code that computes its run identity (:mod:`paco.core.run_identity`). Both engines run the identical command line: ``${a.b}`` placeholders are params values,
interpolated by DVC from ``params.yaml`` and by the Snakefile from its ``configfile``.

Regenerate ``dvc.yaml`` after editing the registry (``workflow/*.py``)::

    python -m workflow.registry > dvc.yaml

*foreach* stages (``grpo``, ``final_samples``) have one member per subtask: the keys of a params
section (``grpo: {t2is: {...}, kontext_editing: {...}}``). DVC renders them as ``foreach:
${grpo}`` with ``${key}`` (the subtask) and ``${item.<field>}`` (its params) in the command,
deps and outs, and names the members ``grpo@t2is``; the Snakefile defines one rule per member,
``grpo_t2is``, with the same command. Adding a subtask is adding a params entry: neither
``dvc.yaml`` nor the Snakefile changes. A member's launcher settings and SLURM resources are its
item's ``resources`` block (a plain stage's are ``resources.stages.<name>``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from workflow.code_deps import ROOT
from workflow.code_digests import CODE_STAGE, REGISTRY_MODULES, code_stage, digest_path
from workflow.stage import MODELS_SETTINGS, PARAMS_FILE, Dep, Member, Stage


def _d(stage: str, name: str) -> str:
    return f"data/{stage}/{name}"


#: the judge directory: data/reward_merge/model (trained here) or data/models/<role> (a released
#: judge), a path key so both engines read it from the params file (docs/running.md)
_JUDGE = "${judge_endpoint.model}"


def _local_model_dirs(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The local directories that ``models`` roles (and ``models.processor_from`` entries) name,
    sorted: the shipped pretrained tiny models of the embedded default
    (``data/raw/pretrained/<name>``, :mod:`paco.pretrain`) or a user's own checkpoint. The
    ``models`` stage copies them, so a changed file reruns it. A spec is a path when it is not
    ``tiny:<name>`` and starts with ``/``, ``.`` or ``~`` or has more than one ``/``
    (:func:`paco.models.fetch.materialise`'s rule; a hub id is ``org/name``)."""
    models = config.get("models") or {}
    specs = [v for k, v in models.items() if k not in MODELS_SETTINGS]
    specs += list((models.get("processor_from") or {}).values())
    return tuple(sorted({s for s in specs if isinstance(s, str) and not s.startswith("tiny:")
                         and (s.startswith(("/", ".", "~")) or s.count("/") > 1)}))


STAGES: tuple[Stage, ...] = (
    Stage(
        name="models",
        args=(("--out", "data/models"), ("--metrics", _d("models", "metrics.json"))),
        params=("models",),
        out_dirs=("data/models/${role}",),  # one per model role (Stage.active_out_dirs)
        metrics=(_d("models", "metrics.json"),),
        downloads=True,  # hub snapshots: the only stage with hub access, a Snakemake localrule
        config_deps=_local_model_dirs,  # data/raw/pretrained/<name>: the shipped pretrained tiny models
    ),
    Stage(
        name="prompts",
        args=(
            ("--jsonl", "${prompts.jsonl}"),
            ("--out", _d("prompts", "prompts.parquet")),
            ("--metrics", _d("prompts", "metrics.json")),
        ),
        deps=("${prompts.jsonl}",),
        params=("prompts",),
        outs=(_d("prompts", "prompts.parquet"),),
        metrics=(_d("prompts", "metrics.json"),),
    ),
    Stage(
        name="edits",
        args=(
            ("--import-path", "${edits.import.path}"),
            ("--out", _d("edits", "edits.parquet")),
            ("--metrics", _d("edits", "metrics.json")),
        ),
        deps=(Dep("${edits.import.path}", "edits.source", ("import",)),),
        params=("edits",),
        outs=(_d("edits", "edits.parquet"),),
        metrics=(_d("edits", "metrics.json"),),
    ),
    Stage(
        name="composites",
        launcher="accelerate",  # generate: render batches sharded over resources.stages.composites.processes
        args=(
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--policy", "data/models/policy_t2is"),
            ("--import-dir", "${composites.import.dir}"),
            ("--out", _d("composites", "composites.parquet")),
            ("--metrics", _d("composites", "metrics.json")),
        ),
        deps=(_d("prompts", "prompts.parquet"), Dep("data/models/policy_t2is", "composites.source", ("generate",)),
              Dep("${composites.import.dir}", "composites.source", ("import",))),
        params=("composites",),
        outs=(_d("composites", "composites.parquet"),),
        metrics=(_d("composites", "metrics.json"),),
    ),
    Stage(
        name="subfigures",
        args=(
            ("--composites", _d("composites", "composites.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--out", _d("subfigures", "panels.parquet")),
            ("--metrics", _d("subfigures", "metrics.json")),
        ),
        deps=(_d("composites", "composites.parquet"), _d("prompts", "prompts.parquet")),
        params=("subfigures",),
        outs=(_d("subfigures", "panels.parquet"),),
        metrics=(_d("subfigures", "metrics.json"),),
    ),
    Stage(
        name="pairs",
        args=(
            ("--panels", _d("subfigures", "panels.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--clip", "data/models/clip"),
            ("--annotations", "${pairs.annotations}"),
            ("--instances", _d("pairs", "rank_instances.parquet")),
            ("--pairs", _d("pairs", "pairs.parquet")),
            ("--edits", _d("edits", "edits.parquet")),
            ("--edit-pairs", _d("pairs", "edit_pairs.parquet")),
            ("--metrics", _d("pairs", "metrics.json")),
        ),
        deps=(
            _d("subfigures", "panels.parquet"),
            _d("prompts", "prompts.parquet"),
            Dep("data/models/clip", "pairs.ranking", ("auto",)),
            Dep("${pairs.annotations}", "pairs.ranking", ("annotations",)),
            Dep(_d("edits", "edits.parquet"), "pairs.editing", (True,)),
        ),
        params=("pairs",),
        outs=(_d("pairs", "rank_instances.parquet"), _d("pairs", "pairs.parquet"), _d("pairs", "edit_pairs.parquet")),
        metrics=(_d("pairs", "metrics.json"),),
    ),
    Stage(
        name="reasons",
        launcher="accelerate",  # chunks sharded over resources.stages.reasons.processes
        args=(
            ("--pairs", _d("pairs", "pairs.parquet")),
            ("--panels", _d("subfigures", "panels.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--progress", _d("reasons", "progress")),
            ("--edit-pairs", _d("pairs", "edit_pairs.parquet")),
            ("--sft-import", "${reasons.sft_import.dataset_dir}"),
            ("--out", _d("reasons", "sft.parquet")),
            ("--metrics", _d("reasons", "metrics.json")),
        ),
        deps=(_d("pairs", "pairs.parquet"), _d("subfigures", "panels.parquet"), _d("prompts", "prompts.parquet"),
              _d("pairs", "edit_pairs.parquet"),
              Dep("${reasons.sft_import.dataset_dir}", "reasons.sft_import.enabled", (True,))),
        params=("reasons",),
        # the teacher's persisted chunks do not depend on the imported sets (nor on their folder)
        continuable=("reasons.sft_import",),
        outs=(_d("reasons", "sft.parquet"),),
        persist=(_d("reasons", "progress"),),
        metrics=(_d("reasons", "metrics.json"),),
    ),
    Stage(
        name="reward_train",
        launcher="accelerate",
        args=(
            ("--sft", _d("reasons", "sft.parquet")),
            ("--base", "data/models/judge_base"),
            ("--adapter", _d("reward_train", "adapter")),
            ("--checkpoints", _d("reward_train", "checkpoints")),
            ("--plots", _d("reward_train", "plots")),
            ("--metrics", _d("reward_train", "metrics.json")),
        ),
        deps=(_d("reasons", "sft.parquet"), "data/models/judge_base"),
        params=("reward_train",),
        out_dirs=(_d("reward_train", "adapter"), _d("reward_train", "plots")),
        plots=(
            {_d("reward_train", "plots/train.csv"): {"x": "step", "y": ["loss", "first_token_accuracy", "lr"]}},
            {_d("reward_train", "plots/eval.csv"): {"x": "epoch", "y": ["p_yes_accuracy", "first_token_accuracy", "loss"]}},
        ),
        persist=(_d("reward_train", "checkpoints"),),
        metrics=(_d("reward_train", "metrics.json"),),
        # epochs is not continuable here: the learning-rate schedule spans all epochs
        continuable=("reward_train.checkpoint_every",),
    ),
    Stage(
        name="reward_merge",
        launcher="accelerate",  # the check's batches sharded over resources.stages.reward_merge.processes
        args=(
            ("--base", "data/models/judge_base"),
            ("--adapter", _d("reward_train", "adapter")),
            ("--sft", _d("reasons", "sft.parquet")),
            ("--out", _d("reward_merge", "model")),
            ("--metrics", _d("reward_merge", "metrics.json")),
        ),
        deps=("data/models/judge_base", _d("reward_train", "adapter"), _d("reasons", "sft.parquet")),
        params=("reward_merge",),
        out_dirs=(_d("reward_merge", "model"),),
        metrics=(_d("reward_merge", "metrics.json"),),
    ),
    Stage(
        name="reward_eval",
        launcher="accelerate",  # scorer batches sharded over resources.stages.reward_eval.processes
        args=(
            ("--judge", _JUDGE),
            ("--base", "data/models/judge_base"),
            ("--clip", "data/models/clip"),
            ("--instances", _d("pairs", "rank_instances.parquet")),
            ("--panels", _d("subfigures", "panels.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--edit-pairs", _d("pairs", "edit_pairs.parquet")),
            ("--editreward", "${reward_eval.editreward}"),
            ("--predictions", _d("reward_eval", "predictions.parquet")),
            ("--metrics", _d("reward_eval", "metrics.json")),
        ),
        deps=(
            _JUDGE,
            Dep("data/models/judge_base", "reward_eval.baselines", ("base_zero_shot",)),
            Dep("data/models/clip", "reward_eval.baselines", ("clip_i",)),
            _d("pairs", "rank_instances.parquet"),
            _d("subfigures", "panels.parquet"),
            _d("prompts", "prompts.parquet"),
            Dep(_d("pairs", "edit_pairs.parquet"), "reward_eval.edit_benchmark", ("photos",)),
            Dep("${reward_eval.editreward}", "reward_eval.edit_benchmark", ("editreward",)),
        ),
        params=("reward_eval", "judge_endpoint.model"),
        outs=(_d("reward_eval", "predictions.parquet"),),
        metrics=(_d("reward_eval", "metrics.json"),),
    ),
)


#: a subtask's items: data/prompts/prompts.parquet (dataset prompts) or data/edits/edits.parquet (edits)
_ITEMS = "data/${item.dataset}/${item.dataset}.parquet"

STAGES += (
    Stage(
        name="grpo",
        foreach="grpo",
        launcher="accelerate",
        args=(
            ("--subtask", "${key}"),
            ("--items", _ITEMS),
            ("--policy", "data/models/${item.policy}"),
            ("--judge", _JUDGE),
            ("--clip", "data/models/clip"),
            ("--pickscore", "data/models/pickscore"),
            ("--lora", "data/grpo/${key}/lora"),
            ("--checkpoints", "data/grpo/${key}/checkpoints"),
            ("--plots", "data/grpo/${key}/plots"),
            ("--metrics", "data/grpo/${key}/metrics.json"),
        ),
        deps=(_ITEMS, "data/models/${item.policy}", _JUDGE,
              "data/models/clip", "data/models/pickscore"),
        params=("grpo.${key}", "judge_endpoint", "subfigures"),
        out_dirs=("data/grpo/${key}/lora",),
        persist=("data/grpo/${key}/checkpoints",),
        metrics=("data/grpo/${key}/metrics.json",),
        # no schedule depends on epochs, so raising it continues a finished run
        # checkpoint_selection only chooses which kept weights are saved: a change re-saves the LoRA
        continuable=("grpo.${key}.epochs", "grpo.${key}.save_every", "grpo.${key}.checkpoint_selection"),
        # eval.every stays in the identity: it decides which weights are kept for re-evaluation
        evaluation=tuple(f"grpo.${{key}}.eval.{k}" for k in ("resolution", "num_steps", "split", "max_prompts",
                                                              "train_prompts", "batch_size")),
        # judge_endpoint.server.gpus: how the job's GPUs are split (engine and the vLLM flags are not launch-only)
        launch=("grpo.${key}.resources", "grpo.${key}.rollout.overlap_rewards", "judge_endpoint.server.gpus",
                "judge_endpoint.server.max_restarts"),
        subprocesses=("paco/serving/server/__main__.py",),
        stage_plots=(
            {"data/grpo/${key}/plots/train.csv": {"x": "epoch", "y": "reward"}},
            {"data/grpo/${key}/plots/eval.csv": {"x": "epoch", "y": "reward"}},
        ),
    ),
    Stage(
        name="final_samples",
        foreach="final_samples",
        launcher="accelerate",
        args=(
            ("--subtask", "${key}"),
            ("--items", _ITEMS),
            ("--policy", "data/models/${item.policy}"),
            ("--lora", "${item.lora}"),  # data/grpo/<g>/lora or a released LoRA, data/models/<role>
            ("--judge", _JUDGE),
            ("--base-judge", "data/models/judge_base"),  # the independent scorer (independent_scorer: base_judge)
            ("--clip", "data/models/clip"),
            ("--pickscore", "data/models/pickscore"),
            ("--out", "data/final_samples/${key}/samples.parquet"),
            ("--sheets", "data/final_samples/${key}/sheets"),
            ("--metrics", "data/final_samples/${key}/metrics.json"),
        ),
        deps=(_ITEMS, "data/models/${item.policy}", "${item.lora}",
              _JUDGE, "data/models/judge_base", "data/models/clip", "data/models/pickscore"),
        params=("final_samples.${key}", "judge_endpoint", "subfigures"),
        outs=("data/final_samples/${key}/samples.parquet",),
        out_dirs=("data/final_samples/${key}/sheets",),
        metrics=("data/final_samples/${key}/metrics.json",),
        launch=("final_samples.${key}.resources", "judge_endpoint.server.gpus",
                "judge_endpoint.server.max_restarts"),
        subprocesses=("paco/serving/server/__main__.py",),
    ),
)


def _evaluator_models(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The model directories of the evaluators the benchmark members serve themselves (``url``
    null) or load (``backend: transformers``), and the LAION aesthetic predictor's CLIP role and
    weights file (``t2is.aesthetics: laion``), over all members, sorted: the members of a foreach
    stage share one DVC ``do:`` block and evaluators are a per-member dict, so every member depends
    on all of them (a changed evaluator reruns the benchmarks; its weights are in each member's run
    identity, which keeps its answer cache; the LAION files are not: they change no answer)."""
    out = set()
    for item in (config.get("benchmark") or {}).values():
        for ev in ((item or {}).get("evaluators") or {}).values() if isinstance(item, Mapping) else ():
            if isinstance(ev, Mapping) and ev.get("url") is None and isinstance(ev.get("model"), str):
                out.add(ev["model"])
        t2is = (item or {}).get("t2is") if isinstance(item, Mapping) else None
        if isinstance(t2is, Mapping) and t2is.get("aesthetics") == "laion":  # the LAION predictor's CLIP and MLP
            out.update(v for v in (t2is.get("aesthetics_clip"), t2is.get("aesthetics_weights")) if isinstance(v, str))
    return tuple(sorted(out))


STAGES += (
    Stage(
        name="benchmark",
        foreach="benchmark",
        # one process through paco.core.launch (the params checked first, as every stage that may
        # use GPUs), without the judge split: its evaluators take all of the member's GPUs in turn
        launcher="accelerate",
        judge_gpu_split=False,
        args=(
            ("--subtask", "${key}"),
            ("--samples", "data/final_samples/${key}/samples.parquet"),
            ("--items", _ITEMS),  # prompts.parquet (t2is: layouts, criteria) or edits.parquet (gedit)
            ("--answers", "data/benchmark/${key}/answers"),
            ("--scores", "data/benchmark/${key}/scores.parquet"),
            ("--table", "data/benchmark/${key}/table.md"),
            ("--metrics", "data/benchmark/${key}/metrics.json"),
        ),
        deps=("data/final_samples/${key}/samples.parquet", _ITEMS),
        config_deps=_evaluator_models,  # data/reward_merge/model, data/models/<role> of the served evaluators
        # judge_endpoint.server: how a url-null evaluator is served (as grpo serves its judge)
        params=("benchmark.${key}", "judge_endpoint.server"),
        outs=("data/benchmark/${key}/scores.parquet", "data/benchmark/${key}/table.md"),
        # the answer cache: kept across runs under the same run identity (a rerun asks nothing twice)
        persist=("data/benchmark/${key}/answers",),
        metrics=("data/benchmark/${key}/metrics.json",),
        # scored in the stage's process after the evaluators (t2v_metrics VQAScore, LAION
        # aesthetics): a change re-scores, but keeps the evaluators' cached answers
        evaluation=tuple(f"benchmark.${{key}}.t2is.{k}" for k in (
            "prompt_alignment", "aesthetics", "aesthetics_clip", "aesthetics_weights", "vqascore_python",
            "vqascore_cache_dir")),
        launch=("benchmark.${key}.resources", "judge_endpoint.server.gpus",
                "judge_endpoint.server.max_restarts"),
        subprocesses=("paco/serving/server/__main__.py",),
    ),
)


# params_check validates params.yaml and checks that dvc.yaml is the rendering for it
STAGES += (
    Stage(
        name="params_check",
        args=(("--out", _d("params_check", "params.json")), ("--dvc-yaml", "dvc.yaml")),
        # the whole params file is its params (any edit reruns it); it also reads dvc.yaml, which
        # DVC refuses as a dependency: the rendering changes only with the params or the registry
        # (its modules here)
        whole_params_file=True,
        deps=REGISTRY_MODULES,
        outs=(_d("params_check", "params.json"),),
    ),
)


def by_name(name: str) -> Stage:
    """The stage called ``name`` (a foreach member's ``grpo@t2is`` gives ``grpo``)."""
    base = name.split("@", 1)[0]
    for stage in STAGES:
        if stage.name == base:
            return stage
    raise KeyError(f"no stage {name!r}; stages: {[s.name for s in STAGES]}")


def member(name: str, config: Mapping[str, Any] | None = None) -> Member:
    """The member called ``name`` (``reward_train``, ``grpo@t2is``) under ``config`` (the params as
    plain data, which give a foreach member its item). A foreach member named without its section
    in ``config`` (or with no ``config``) gets an empty item: enough for its params keys
    (:func:`paco.core.run_identity.params_identity`), not for paths that name ``${item.<field>}``.

    Raises:
        KeyError: no such stage, or no such member of it in ``config``.
    """
    stage = by_name(name)
    config = {} if config is None else config
    if stage.foreach is not None and "@" in name and stage.foreach not in config:
        # a member named without a params file at hand: a one-member config is enough here
        config = {**config, stage.foreach: {name.split("@", 1)[1]: {}}}
    found = [m for m in stage.members(config) if m.dvc_name == name]
    if not found:
        raise KeyError(f"{name!r} is not a member of stage {stage.name!r}")
    return found[0]


def local_rules(config: Mapping[str, Any]) -> list[str]:
    """The Snakemake rule names of the members of every stage that downloads (:attr:`Stage.downloads`:
    ``models``), in registry order: the Snakefile's ``localrules``, so that under a SLURM profile
    they run on the submitting host (a login node with internet) and every other rule is submitted
    to compute nodes, which need none (docs/running.md, SLURM)."""
    return [m.rule_name for s in STAGES if s.downloads for m in s.members(config)]


def job_resources(res: Mapping[str, Any]) -> dict[str, Any]:
    """The Snakemake ``resources:`` of a member whose resources are ``res`` (:meth:`Member.resources`):
    ``mem_mb``, ``runtime``, ``cpus_per_task`` (the task's CPUs: ``res.cpus_per_task`` on CPU, times
    ``gpus`` on GPUs, where ``cpus_per_task`` is per GPU: the one task per node runs every GPU's
    process); on GPUs also ``tasks_per_gpu: 0`` (no ``--ntasks-per-gpu``) and ``gpus_per_node`` (the
    sbatch profile's ``submit.sh GPUS NODES``), and then

    - one node: ``gpu`` (``--gpus=G``, snakemake-executor-plugin-slurm);
    - ``nodes`` N > 1: ``nodes: N``, ``gres: gpu:G`` (``--gres`` is per node; ``--gpus`` would be
      the job's total), ``mpi: srun`` and ``tasks: N`` (the plugin's jobstep then runs the command
      without its own ``srun -n1`` wrapper, and ``paco.core.launch`` starts one launcher per node
      with ``srun``; the plugin refuses ``tasks_per_node: 1`` for such a job).

    No ``cpus_per_gpu``: the plugin's sbatch line and its jobstep's srun take ``cpus_per_task`` over
    it (``snakemake_executor_plugin_slurm_jobstep.get_cpu_setting``), and the sbatch profile passes
    ``--cpus-per-task={threads}``, the Snakefile's ``threads`` being this ``cpus_per_task``.
    """
    gpus, nodes, cpus = int(res.get("gpus", 0)), int(res.get("nodes", 1)), int(res.get("cpus_per_task", 1))
    out: dict[str, Any] = {"mem_mb": res.get("mem_mb", 4000), "runtime": res.get("runtime", 30),
                           "cpus_per_task": cpus * gpus if gpus else cpus}
    if gpus:
        out.update(tasks_per_gpu=0, gpus_per_node=gpus)
        if nodes > 1:
            out.update(nodes=nodes, gres=f"gpu:{gpus}", mpi="srun", tasks=nodes)
        else:
            out["gpu"] = gpus
    return out


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """``params.yaml`` (the repository's, by default) as plain data."""
    return yaml.safe_load(Path(path or ROOT / PARAMS_FILE).read_text()) or {}


def render_dvc(config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``dvc.yaml`` document for the registry under ``config`` (default: ``params.yaml``),
    which decides the params-dependent deps (:class:`Dep`)."""
    config = load_config() if config is None else config
    # the code stage first: every stage depends on its digest file, not on its closure's files
    stages: dict[str, Any] = {CODE_STAGE: code_stage(STAGES)}
    for s in STAGES:
        entry: dict[str, Any] = {"cmd": s.cmd, "deps": list(s.active_deps(config)) + [digest_path(s)],
                                 "params": [{PARAMS_FILE: None}] if s.whole_params_file else s.params_entries(config)}
        entry["outs"] = (list(s.active_out_dirs(config)) + list(s.outs) + list(s.reports)
                         + [{p: {"persist": True}} for p in s.persist])
        if s.metrics:
            entry["metrics"] = list(s.metrics)
        if s.stage_plots:
            entry["plots"] = [dict(p) for p in s.stage_plots]
        stages[s.name] = {"foreach": f"${{{s.foreach}}}", "do": entry} if s.foreach else entry
    doc: dict[str, Any] = {"stages": stages}
    plots = [p for s in STAGES for p in s.plots]
    if plots:
        doc["plots"] = plots
    return doc


def dump_dvc(config: Mapping[str, Any] | None = None) -> str:
    header = ("# Generated by `python -m workflow.registry` from workflow/registry.py and params.yaml (which\n"
              "# inputs a stage reads depends on its params): do not edit; regenerate after switching them.\n")
    return header + yaml.safe_dump(render_dvc(config), sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(dump_dvc())


if __name__ == "__main__":
    main()
