"""The one stage registry behind both engines (DESIGN.md §1: one DAG, two engines, no drift).

Each :class:`Stage` names its command, data dependencies, code dependencies, params sections,
outputs and metrics. :func:`render_dvc` turns the registry into ``dvc.yaml`` (committed; a test
checks it equals the rendering), and the ``Snakefile`` defines one rule per stage from the same
objects. Both engines run the identical command line: ``${a.b}`` placeholders are params values,
interpolated by DVC from ``params.yaml`` and by the Snakefile from its ``configfile``.

Regenerate ``dvc.yaml`` after editing this file::

    python -m workflow.registry > dvc.yaml

*foreach* stages (``grpo``, ``sample``) have one member per subtask: the keys of a params
section (``grpo: {t2is: {...}, kontext_editing: {...}}``). DVC renders them as ``foreach:
${grpo}`` with ``${key}`` (the subtask) and ``${item.<field>}`` (its params) in the command,
deps and outs, and names the members ``grpo@t2is``; the Snakefile defines one rule per member,
``grpo_t2is``, with the same command. Adding a subtask is adding a params entry: neither
``dvc.yaml`` nor the Snakefile changes. A member's launcher settings and SLURM resources are its
item's ``resources`` block (a plain stage's are ``resources.stages.<name>``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

PARAMS_FILE = "params.yaml"
MODEL_ROLES = ("judge_base", "policy_t2is", "clip")
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        name: DVC stage name and Snakemake rule name.
        args: ``--flag value`` pairs after ``python -m stages.<module> --params params.yaml``.
        deps: data inputs (files or directories; may hold ``${...}`` placeholders).
        code: source files whose change reruns the stage.
        params: top-level ``params.yaml`` sections the stage reads.
        outs: output files; ``out_dirs``: output directories.
        metrics: metrics JSON files (also outputs).
        persist: output directories kept across runs (checkpoints, resumable progress): DVC
            ``persist: true``; Snakemake does not declare them (it would delete them first).
        plots: DVC plot definitions (top-level ``plots:`` entries) for this stage's outputs.
        launcher: ``python`` or ``accelerate`` (``accelerate launch`` with the stage's
            ``resources`` process count and accelerate config).
        foreach: the params section whose keys are the members (``None``: a plain stage).
        stage_plots: DVC stage-level plots ``{path: {"x": col, "y": col}}`` (outputs; usable with
            ``${key}`` in foreach stages, unlike the top-level ``plots``).
    """

    name: str
    args: tuple[tuple[str, str], ...]
    deps: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    out_dirs: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    persist: tuple[str, ...] = ()
    plots: tuple[dict[str, Any], ...] = ()
    launcher: str = "python"
    module: str = field(default="")
    foreach: str | None = None
    stage_plots: tuple[dict[str, Any], ...] = ()

    @property
    def cmd(self) -> str:
        module = self.module or self.name
        if self.launcher == "accelerate":
            res = "item.resources" if self.foreach else f"resources.stages.{self.name}"
            launch = (
                f"accelerate launch --config_file workflow/accelerate/${{{res}.accelerate_config}}.yaml "
                f"--num_processes ${{{res}.processes}} -m"
            )
        else:
            launch = "python -m"
        parts = [f"{launch} stages.{module} --params {PARAMS_FILE}"]
        parts += [f"{flag} {value}" for flag, value in self.args]
        return " ".join(parts)

    @property
    def all_deps(self) -> tuple[str, ...]:
        return self.deps + self.code

    @property
    def plot_outs(self) -> tuple[str, ...]:
        return tuple(path for plot in self.stage_plots for path in plot)

    def members(self, config: Mapping[str, Any]) -> list[Member]:
        """The concrete stages: one for a plain stage, one per key of ``config[foreach]``.

        Raises:
            KeyError: the foreach section is missing from ``config``.
        """
        if self.foreach is None:
            return [Member(self, self.name, self.name, None, None)]
        if self.foreach not in config or not isinstance(config[self.foreach], Mapping):
            raise KeyError(f"stage {self.name}: foreach section {self.foreach!r} not in params")
        return [Member(self, f"{self.name}@{key}", f"{self.name}_{key}", str(key), item)
                for key, item in config[self.foreach].items()]


@dataclass(frozen=True)
class Member:
    """One concrete stage: ``dvc_name`` (``grpo@t2is``), ``rule_name`` (``grpo_t2is``) and, for
    a foreach member, its ``key`` and params ``item``."""

    stage: Stage
    dvc_name: str
    rule_name: str
    key: str | None
    item: Any

    def resolve(self, text: str, config: Mapping[str, Any]) -> str:
        """``text`` with ``${key}``, ``${item.<path>}`` and ``${<params path>}`` replaced."""
        if self.key is not None:
            text = interpolate(text, {"key": self.key, "item": self.item}, keep_unknown=True)
        return interpolate(text, config)

    def resources(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``resources.default`` updated by the stage's own resources."""
        res_cfg = config.get("resources", {})
        res = dict(res_cfg.get("default", {}))
        if self.key is None:
            res.update(res_cfg.get("stages", {}).get(self.stage.name, {}))
        else:
            res.update((self.item or {}).get("resources", {}))
        return res

    def params_sections(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Declared params keys (dotted) -> their values: a change of any reruns the member."""
        out = {}
        for key in self.stage.params:
            node: Any = config
            for part in self.resolve(key, {}).split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            out[self.resolve(key, {})] = node
        return out


def _d(stage: str, name: str) -> str:
    return f"data/{stage}/{name}"


COMMON_CODE = ("paco/params.py", "paco/io.py", "paco/stage.py")
#: the judge and what loading and prompting it runs
JUDGE_CODE = ("paco/judge.py", "paco/losses.py", "paco/templates.py", "paco/models/loading.py")

STAGES: tuple[Stage, ...] = (
    Stage(
        name="models",
        args=(("--out", "data/models"), ("--metrics", _d("models", "metrics.json"))),
        code=COMMON_CODE + ("stages/models.py", "paco/models", "paco/templates.py"),
        params=("models",),
        out_dirs=tuple(f"data/models/{role}" for role in MODEL_ROLES),
        metrics=(_d("models", "metrics.json"),),
    ),
    Stage(
        name="prompts",
        args=(
            ("--jsonl", "${prompts.jsonl}"),
            ("--out", _d("prompts", "prompts.parquet")),
            ("--metrics", _d("prompts", "metrics.json")),
        ),
        deps=("${prompts.jsonl}",),
        code=COMMON_CODE + ("stages/prompts.py", "paco/prompts.py", "paco/photos.py"),
        params=("prompts",),
        outs=(_d("prompts", "prompts.parquet"),),
        metrics=(_d("prompts", "metrics.json"),),
    ),
    Stage(
        name="composites",
        args=(
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--policy", "data/models/policy_t2is"),
            ("--import-dir", "${composites.import.dir}"),
            ("--out", _d("composites", "composites.parquet")),
            ("--metrics", _d("composites", "metrics.json")),
        ),
        deps=(_d("prompts", "prompts.parquet"), "data/models/policy_t2is", "${composites.import.dir}"),
        code=COMMON_CODE + ("stages/composites.py", "paco/composites.py", "paco/photos.py", "paco/models/loading.py"),
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
        code=COMMON_CODE + ("stages/subfigures.py", "paco/subfigures.py", "paco/panels.py"),
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
            ("--metrics", _d("pairs", "metrics.json")),
        ),
        deps=(
            _d("subfigures", "panels.parquet"),
            _d("prompts", "prompts.parquet"),
            "data/models/clip",
            "${pairs.annotations}",
        ),
        code=COMMON_CODE + ("stages/pairs.py", "paco/pairs.py", "paco/clip.py", "paco/models/loading.py"),
        params=("pairs",),
        outs=(_d("pairs", "rank_instances.parquet"), _d("pairs", "pairs.parquet")),
        metrics=(_d("pairs", "metrics.json"),),
    ),
    Stage(
        name="labels",
        args=(
            ("--pairs", _d("pairs", "pairs.parquet")),
            ("--panels", _d("subfigures", "panels.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--progress", _d("labels", "progress")),
            ("--out", _d("labels", "sft.parquet")),
            ("--metrics", _d("labels", "metrics.json")),
        ),
        deps=(_d("pairs", "pairs.parquet"), _d("subfigures", "panels.parquet"), _d("prompts", "prompts.parquet")),
        code=COMMON_CODE + ("stages/labels.py", "paco/labels.py", "paco/teacher.py", "paco/templates.py", "paco/http.py",
                             "paco/models/loading.py"),
        params=("labels",),
        outs=(_d("labels", "sft.parquet"),),
        persist=(_d("labels", "progress"),),
        metrics=(_d("labels", "metrics.json"),),
    ),
    Stage(
        name="reward_train",
        launcher="accelerate",
        args=(
            ("--sft", _d("labels", "sft.parquet")),
            ("--base", "data/models/judge_base"),
            ("--adapter", _d("reward_train", "adapter")),
            ("--checkpoints", _d("reward_train", "checkpoints")),
            ("--plots", _d("reward_train", "plots")),
            ("--metrics", _d("reward_train", "metrics.json")),
        ),
        deps=(_d("labels", "sft.parquet"), "data/models/judge_base"),
        code=COMMON_CODE + (
            "stages/reward_train.py", "paco/reward_train.py", "paco/checkpoints.py", "paco/losses.py", "paco/judge.py",
            "paco/models/loading.py", "paco/templates.py",
        ),
        params=("reward_train",),
        out_dirs=(_d("reward_train", "adapter"), _d("reward_train", "plots")),
        plots=(
            {_d("reward_train", "plots/train.csv"): {"x": "step", "y": ["loss", "first_token_accuracy", "lr"]}},
            {_d("reward_train", "plots/eval.csv"): {"x": "epoch", "y": ["p_yes_accuracy", "first_token_accuracy", "loss"]}},
        ),
        persist=(_d("reward_train", "checkpoints"),),
        metrics=(_d("reward_train", "metrics.json"),),
    ),
    Stage(
        name="reward_merge",
        args=(
            ("--base", "data/models/judge_base"),
            ("--adapter", _d("reward_train", "adapter")),
            ("--sft", _d("labels", "sft.parquet")),
            ("--out", _d("reward_merge", "model")),
            ("--metrics", _d("reward_merge", "metrics.json")),
        ),
        deps=("data/models/judge_base", _d("reward_train", "adapter"), _d("labels", "sft.parquet")),
        code=COMMON_CODE + JUDGE_CODE + ("stages/reward_merge.py",),
        params=("reward_merge",),
        out_dirs=(_d("reward_merge", "model"),),
        metrics=(_d("reward_merge", "metrics.json"),),
    ),
    Stage(
        name="reward_eval",
        args=(
            ("--judge", _d("reward_merge", "model")),
            ("--base", "data/models/judge_base"),
            ("--clip", "data/models/clip"),
            ("--instances", _d("pairs", "rank_instances.parquet")),
            ("--panels", _d("subfigures", "panels.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--predictions", _d("reward_eval", "predictions.parquet")),
            ("--metrics", _d("reward_eval", "metrics.json")),
        ),
        deps=(
            _d("reward_merge", "model"),
            "data/models/judge_base",
            "data/models/clip",
            _d("pairs", "rank_instances.parquet"),
            _d("subfigures", "panels.parquet"),
            _d("prompts", "prompts.parquet"),
        ),
        code=COMMON_CODE + JUDGE_CODE + ("stages/reward_eval.py", "paco/evaluation.py", "paco/metrics.py", "paco/clip.py"),
        params=("reward_eval",),
        outs=(_d("reward_eval", "predictions.parquet"),),
        metrics=(_d("reward_eval", "metrics.json"),),
    ),
)


GRPO_CODE = COMMON_CODE + (
    "paco/policy.py", "paco/sde.py", "paco/rewards.py", "paco/judge_client.py", "paco/serve.py", "paco/judge.py",
    "paco/http.py", "paco/clip.py", "paco/subfigures.py", "paco/templates.py", "paco/models/loading.py",
    "paco/checkpoints.py", "paco/composites.py", "paco/photos.py", "paco/losses.py",
)

STAGES += (
    Stage(
        name="grpo",
        foreach="grpo",
        launcher="accelerate",
        args=(
            ("--subtask", "${key}"),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--policy", "data/models/${item.policy}"),
            ("--judge", _d("reward_merge", "model")),
            ("--clip", "data/models/clip"),
            ("--lora", "data/grpo/${key}/lora"),
            ("--checkpoints", "data/grpo/${key}/checkpoints"),
            ("--plots", "data/grpo/${key}/plots"),
            ("--metrics", "data/grpo/${key}/metrics.json"),
        ),
        deps=(_d("prompts", "prompts.parquet"), "data/models/${item.policy}", _d("reward_merge", "model"),
              "data/models/clip"),
        code=GRPO_CODE + ("stages/grpo.py", "paco/grpo.py", "paco/advantages.py"),
        params=("grpo.${key}", "judge", "subfigures"),
        out_dirs=("data/grpo/${key}/lora",),
        persist=("data/grpo/${key}/checkpoints",),
        metrics=("data/grpo/${key}/metrics.json",),
        stage_plots=(
            {"data/grpo/${key}/plots/train.csv": {"x": "epoch", "y": "reward"}},
            {"data/grpo/${key}/plots/eval.csv": {"x": "epoch", "y": "reward"}},
        ),
    ),
    Stage(
        name="sample",
        foreach="sample",
        launcher="accelerate",
        args=(
            ("--subtask", "${key}"),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--policy", "data/models/${item.policy}"),
            ("--lora", "data/grpo/${key}/lora"),
            ("--judge", _d("reward_merge", "model")),
            ("--clip", "data/models/clip"),
            ("--out", "data/sample/${key}/samples.parquet"),
            ("--sheets", "data/sample/${key}/sheets"),
            ("--metrics", "data/sample/${key}/metrics.json"),
        ),
        deps=(_d("prompts", "prompts.parquet"), "data/models/${item.policy}", "data/grpo/${key}/lora",
              _d("reward_merge", "model"), "data/models/clip"),
        code=GRPO_CODE + ("stages/sample.py", "stages/grpo.py", "paco/sampling.py", "paco/grpo.py", "paco/advantages.py"),
        params=("sample.${key}", "judge", "subfigures"),
        outs=("data/sample/${key}/samples.parquet",),
        out_dirs=("data/sample/${key}/sheets",),
        metrics=("data/sample/${key}/metrics.json",),
    ),
)


def by_name(name: str) -> Stage:
    """The stage called ``name`` (a foreach member's ``grpo@t2is`` gives ``grpo``)."""
    base = name.split("@", 1)[0]
    for stage in STAGES:
        if stage.name == base:
            return stage
    raise KeyError(f"no stage {name!r}; stages: {[s.name for s in STAGES]}")


def interpolate(text: str, config: Mapping[str, Any], *, keep_unknown: bool = False) -> str:
    """Replace ``${a.b.c}`` with ``config["a"]["b"]["c"]`` (what DVC does with params.yaml).

    ``keep_unknown``: leave placeholders whose first part is not in ``config`` as they are.

    Raises:
        KeyError: a placeholder names a key that is not in ``config``.
    """

    def value(match: re.Match[str]) -> str:
        node: Any = config
        parts = match[1].split(".")
        if keep_unknown and parts[0] not in config:
            return match[0]
        for key in parts:
            if not isinstance(node, Mapping) or key not in node:
                raise KeyError(f"{match[0]}: {key!r} not in params")
            node = node[key]
        return str(node)

    return _PLACEHOLDER.sub(value, text)


def render_dvc() -> dict[str, Any]:
    """The ``dvc.yaml`` document for the registry."""
    stages: dict[str, Any] = {}
    for s in STAGES:
        entry: dict[str, Any] = {"cmd": s.cmd, "deps": list(s.all_deps), "params": list(s.params)}
        entry["outs"] = list(s.out_dirs) + list(s.outs) + [{p: {"persist": True}} for p in s.persist]
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


def dump_dvc() -> str:
    header = "# Generated by `python -m workflow.registry` from workflow/registry.py: do not edit.\n"
    return header + yaml.safe_dump(render_dvc(), sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(dump_dvc())


if __name__ == "__main__":
    main()
