"""The one stage registry behind both engines (docs/architecture.md §1: one DAG, two engines, no drift).

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

import ast
import functools
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from paco.core.run_identity import without_keys

PARAMS_FILE = "params.yaml"
#: the model roles every run needs; ``models:`` may name more (:func:`model_roles`)
MODEL_ROLES = ("judge_base", "policy_t2is", "clip")
#: keys of the ``models`` section that are settings, not roles
_MODELS_SETTINGS = ("seed", "revision", "allow_patterns")


def model_roles(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The model roles under ``config``: :data:`MODEL_ROLES`, then every further key of
    ``models:`` in name order (as ``paco.core.params.ModelsParams.roles``)."""
    models = config.get("models") or {}
    extra = sorted(k for k in models if k not in MODEL_ROLES and k not in _MODELS_SETTINGS)
    return MODEL_ROLES + tuple(extra)
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


@dataclass(frozen=True)
class Dep:
    """A data dependency read only under some params: ``path`` when the params value at the dotted
    ``key`` is one of ``values`` (for a list value: when it holds one of them). So a scale switch
    (``composites.source: photos`` -> ``generate``) changes what a stage depends on, and a stage
    never reruns for an input it does not read."""

    path: str
    key: str
    values: tuple[Any, ...]

    def active(self, config: Mapping[str, Any]) -> bool:
        node: Any = config
        for part in self.key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return False
            node = node[part]
        if isinstance(node, list):
            return any(v in node for v in self.values)
        return node in self.values


def _keys_without(section: Any, excluded: list[str]) -> list[str] | None:
    """The dotted keys of ``section`` that cover it except the ``excluded`` (dotted) keys: a key
    with an excluded key below it is replaced by its own keys. ``None`` if ``section`` is not a
    mapping."""
    if not isinstance(section, Mapping):
        return None
    out: list[str] = []
    for key in sorted(section):
        below = [e[len(key) + 1:] for e in excluded if e.startswith(key + ".")]
        if key in excluded:
            continue
        if below:
            sub = _keys_without(section[key], below)
            if sub is None:
                return None
            out += [f"{key}.{k}" for k in sub]
        else:
            out.append(key)
    return out


def effective_params(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config`` validated by the params schema, every default filled in (as plain data); an
    invalid ``config`` is returned as it is (the stages and ``params_check`` report it)."""
    from paco.core.params import ParamsError, validate_params

    try:
        return validate_params(dict(config)).model_dump(mode="json", by_alias=True)
    except ParamsError:
        return config


def _path(dep: str | Dep) -> str:
    return dep.path if isinstance(dep, Dep) else dep


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        name: DVC stage name and Snakemake rule name.
        args: ``--flag value`` pairs after ``python -m stages.<module> --params params.yaml``.
        deps: data inputs (files or directories; may hold ``${...}`` placeholders); a :class:`Dep`
            is one read only under some params (:meth:`Member.deps` selects them).
        code: source files whose change reruns the stage.
        params: top-level ``params.yaml`` sections the stage reads.
        outs: output files; ``out_dirs``: output directories.
        metrics: metrics JSON files (also outputs).
        persist: output directories kept across runs (checkpoints, resumable progress): DVC
            ``persist: true``; Snakemake does not declare them (it would delete them first).
        plots: DVC plot definitions (top-level ``plots:`` entries) for this stage's outputs.
        launcher: ``python`` or ``accelerate`` (:mod:`paco.core.launch` with the stage's
            ``resources`` process count and accelerate config: ``accelerate launch`` where the
            config or the count asks for it, else one process in place).
        foreach: the params section whose keys are the members (``None``: a plain stage).
        stage_plots: DVC stage-level plots ``{path: {"x": col, "y": col}}`` (outputs; usable with
            ``${key}`` in foreach stages, unlike the top-level ``plots``).
        continuable: dotted params keys a persisted run may continue across (``epochs``,
            ``save_every``): left out of the run identity (:mod:`paco.core.run_identity`).
        evaluation: dotted params keys that change only the evaluation: left out of the run
            identity's training parts; a change re-runs the evaluation on the kept weights.
        launch: dotted params keys that only say how the stage is launched (``resources``).
        subprocesses: project modules the stage starts as processes of their own (the local
            judge server ``paco/judge/serve.py``): their import closure is the stage's code too.

    ``code`` is derived, not declared: :func:`code_closure` of the stage module (``stages/<module>.py``
    and every project module it imports, transitively), so editing any module a stage runs reruns
    it in both engines and changes its run identity.
    """

    name: str
    args: tuple[tuple[str, str], ...]
    deps: tuple[str | Dep, ...] = ()
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
    continuable: tuple[str, ...] = ()
    evaluation: tuple[str, ...] = ()
    launch: tuple[str, ...] = ()
    subprocesses: tuple[str, ...] = ()
    whole_params_file: bool = False

    @property
    def code(self) -> tuple[str, ...]:
        """Project source files the stage runs (:func:`code_closure` of its module, of its
        :attr:`subprocesses` and of its launcher, :mod:`paco.core.launch`), sorted."""
        launcher = ("paco/core/launch.py",) if self.launcher == "accelerate" else ()
        entries = (f"stages/{self.module or self.name}.py", *self.subprocesses, *launcher)
        return tuple(sorted({f for e in entries for f in code_closure(e)}))

    @property
    def cmd(self) -> str:
        module = self.module or self.name
        if self.launcher == "accelerate":
            res = "item.resources" if self.foreach else f"resources.stages.{self.name}"
            # paco.core.launch checks the params first (one clear message, exit code 2), then runs
            # one plain process in place or hands the stage to `accelerate launch`
            launch = (
                f"python -m paco.core.launch --config_file workflow/accelerate/${{{res}.accelerate_config}}.yaml "
                f"--num_processes ${{{res}.processes}} -m"
            )
        else:
            launch = "python -m"
        parts = [f"{launch} stages.{module} --params {PARAMS_FILE}"]
        parts += [f"{flag} {value}" for flag, value in self.args]
        return " ".join(parts)

    @property
    def dep_paths(self) -> tuple[str, ...]:
        """Every declared data dependency's path, whatever the params."""
        return tuple(_path(d) for d in self.deps)

    def active_deps(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The data dependencies read under ``config`` (placeholders not resolved); a :class:`Dep`
        is decided on the validated params, so a key left to its default counts as its default."""
        effective = effective_params(config) if any(isinstance(d, Dep) for d in self.deps) else config
        return tuple(_path(d) for d in self.deps if not isinstance(d, Dep) or d.active(effective))

    def params_entries(self, config: Mapping[str, Any]) -> list[str]:
        """The ``params:`` of the stage in ``dvc.yaml``: the declared sections, except that a
        section holding launch-only keys (:attr:`launch`, e.g. ``grpo.${key}.resources``) is
        listed by its other keys, so raising a SLURM ``runtime`` or ``mem_mb`` reruns nothing
        (``processes`` and ``accelerate_config`` are in the command, whose change does). Keys
        are read from ``config``; foreach members must then share the same keys, or the whole
        section is listed."""
        entries: list[str] = []
        for section in self.params:
            excluded = [k[len(section) + 1:] for k in self.launch if k.startswith(section + ".")]
            if not excluded:
                entries.append(section)
                continue
            if self.foreach and section.startswith(f"{self.foreach}.${{key}}"):
                rest = section[len(f"{self.foreach}.${{key}}"):].lstrip(".")
                values = []
                for item in (config.get(self.foreach) or {}).values():
                    for part in filter(None, rest.split(".")):
                        item = item.get(part) if isinstance(item, Mapping) else None
                    values.append(item)
            else:
                node: Any = config
                for part in section.split("."):
                    node = node.get(part) if isinstance(node, Mapping) else None
                values = [node]
            keys = [_keys_without(v, excluded) for v in values]
            if not keys or any(k is None or k != keys[0] for k in keys):
                entries.append(section)  # members disagree: track the whole section
            else:
                entries += [f"{section}.{k}" for k in keys[0]]
        return entries

    def active_out_dirs(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The output directories under ``config``: an entry holding ``${role}`` stands for one
        directory per model role (:func:`model_roles`)."""
        out: list[str] = []
        for d in self.out_dirs:
            out += [d.replace("${role}", r) for r in model_roles(config)] if "${role}" in d else [d]
        return tuple(out)

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

    def deps(self, config: Mapping[str, Any]) -> list[str]:
        """The member's data dependencies under ``config``, resolved (:meth:`Stage.active_deps`)."""
        return [self.resolve(d, config) for d in self.stage.active_deps(config)]

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
        if self.stage.whole_params_file:
            return dict(config)
        out = {}
        for key in self.stage.params:
            node: Any = config
            for part in self.resolve(key, {}).split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            # launch-only keys (resources) rerun nothing, as in dvc.yaml (Stage.params_entries)
            excluded = [k[len(key) + 1:] for k in self.stage.launch if k.startswith(key + ".")]
            out[self.resolve(key, {})] = without_keys(node, excluded) if excluded else node
        return out


ROOT = Path(__file__).resolve().parents[1]
#: top-level packages whose modules are the project's code
PROJECT_PACKAGES = ("paco", "stages")
#: modules whose imports are not followed: ``paco.core.params`` validators import the reward
#: registry lazily, for the reward names only
NOT_FOLLOWED = ("paco/core/params.py",)


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def _project_imports(path: Path) -> set[Path]:
    """Files of the project modules ``path`` imports (module or function level), with the
    ``__init__.py`` of every package on the way (Python runs them too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] not in PROJECT_PACKAGES:
                continue
            for k in range(1, len(parts) + 1):
                f = _module_file(".".join(parts[:k]))
                if f is not None:
                    found.add(f)
                elif k == len(parts) and (init := _module_file(".".join(parts[:-1]))) is not None:
                    # a lazily exported name (``_EXPORTS = {name: submodule}`` in the package)
                    sub = _lazy_exports(init).get(parts[-1])
                    if sub and (f := _module_file(".".join(parts[:-1] + [sub]))) is not None:
                        found.add(f)
    return found


@functools.cache
def _lazy_exports(init: Path) -> dict[str, str]:
    """The ``_EXPORTS`` literal (name -> submodule) of a package ``__init__.py``, if any."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


@functools.cache
def code_closure(entry: str) -> tuple[str, ...]:
    """The project source files (relative to the repository root, sorted) that running ``entry``
    (``stages/<name>.py``) imports, transitively: every ``import`` / ``from ... import`` of a
    ``paco`` or ``stages`` module at any level of the file (lazy imports included), except the
    edges out of :data:`NOT_FOLLOWED`.

    Raises:
        FileNotFoundError: ``entry`` does not exist.
    """
    start = ROOT / entry
    if not start.is_file():
        raise FileNotFoundError(entry)
    seen: set[Path] = set()
    todo = [start]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if str(f.relative_to(ROOT)) not in NOT_FOLLOWED:
            todo += _project_imports(f) - seen
    return tuple(sorted(str(f.relative_to(ROOT)) for f in seen))


def _d(stage: str, name: str) -> str:
    return f"data/{stage}/{name}"


STAGES: tuple[Stage, ...] = (
    Stage(
        name="models",
        args=(("--out", "data/models"), ("--metrics", _d("models", "metrics.json"))),
        params=("models",),
        out_dirs=("data/models/${role}",),  # one per model role (Stage.active_out_dirs)
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
        name="labels",
        launcher="accelerate",  # chunks sharded over resources.stages.labels.processes
        args=(
            ("--pairs", _d("pairs", "pairs.parquet")),
            ("--panels", _d("subfigures", "panels.parquet")),
            ("--prompts", _d("prompts", "prompts.parquet")),
            ("--progress", _d("labels", "progress")),
            ("--edit-pairs", _d("pairs", "edit_pairs.parquet")),
            ("--sft-import", "${labels.sft_import.dataset_dir}"),
            ("--out", _d("labels", "sft.parquet")),
            ("--metrics", _d("labels", "metrics.json")),
        ),
        deps=(_d("pairs", "pairs.parquet"), _d("subfigures", "panels.parquet"), _d("prompts", "prompts.parquet"),
              _d("pairs", "edit_pairs.parquet"),
              Dep("${labels.sft_import.dataset_dir}", "labels.sft_import.enabled", (True,))),
        params=("labels",),
        # the teacher's persisted chunks do not depend on the imported sets (nor on their folder)
        continuable=("labels.sft_import",),
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
            ("--sft", _d("labels", "sft.parquet")),
            ("--out", _d("reward_merge", "model")),
            ("--metrics", _d("reward_merge", "metrics.json")),
        ),
        deps=("data/models/judge_base", _d("reward_train", "adapter"), _d("labels", "sft.parquet")),
        params=("reward_merge",),
        out_dirs=(_d("reward_merge", "model"),),
        metrics=(_d("reward_merge", "metrics.json"),),
    ),
    Stage(
        name="reward_eval",
        launcher="accelerate",  # scorer batches sharded over resources.stages.reward_eval.processes
        args=(
            ("--judge", _d("reward_merge", "model")),
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
            _d("reward_merge", "model"),
            Dep("data/models/judge_base", "reward_eval.baselines", ("base_zero_shot",)),
            Dep("data/models/clip", "reward_eval.baselines", ("clip_i",)),
            _d("pairs", "rank_instances.parquet"),
            _d("subfigures", "panels.parquet"),
            _d("prompts", "prompts.parquet"),
            Dep(_d("pairs", "edit_pairs.parquet"), "reward_eval.edit_benchmark", ("photos",)),
            Dep("${reward_eval.editreward}", "reward_eval.edit_benchmark", ("editreward",)),
        ),
        params=("reward_eval",),
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
            ("--judge", _d("reward_merge", "model")),
            ("--clip", "data/models/clip"),
            ("--lora", "data/grpo/${key}/lora"),
            ("--checkpoints", "data/grpo/${key}/checkpoints"),
            ("--plots", "data/grpo/${key}/plots"),
            ("--metrics", "data/grpo/${key}/metrics.json"),
        ),
        deps=(_ITEMS, "data/models/${item.policy}", _d("reward_merge", "model"),
              "data/models/clip"),
        params=("grpo.${key}", "judge_endpoint", "subfigures"),
        out_dirs=("data/grpo/${key}/lora",),
        persist=("data/grpo/${key}/checkpoints",),
        metrics=("data/grpo/${key}/metrics.json",),
        # no schedule depends on epochs, so raising it continues a finished run
        continuable=("grpo.${key}.epochs", "grpo.${key}.save_every"),
        # eval.every stays in the identity: it decides which weights are kept for re-evaluation
        evaluation=tuple(f"grpo.${{key}}.eval.{k}" for k in ("resolution", "num_steps", "split", "max_prompts",
                                                              "batch_size")),
        launch=("grpo.${key}.resources", "grpo.${key}.rollout.overlap_rewards"),
        subprocesses=("paco/judge/serve.py",),
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
            ("--lora", "data/grpo/${key}/lora"),
            ("--judge", _d("reward_merge", "model")),
            ("--clip", "data/models/clip"),
            ("--out", "data/final_samples/${key}/samples.parquet"),
            ("--sheets", "data/final_samples/${key}/sheets"),
            ("--metrics", "data/final_samples/${key}/metrics.json"),
        ),
        deps=(_ITEMS, "data/models/${item.policy}", "data/grpo/${key}/lora",
              _d("reward_merge", "model"), "data/models/clip"),
        params=("final_samples.${key}", "judge_endpoint", "subfigures"),
        outs=("data/final_samples/${key}/samples.parquet",),
        out_dirs=("data/final_samples/${key}/sheets",),
        metrics=("data/final_samples/${key}/metrics.json",),
        launch=("final_samples.${key}.resources",),
        subprocesses=("paco/judge/serve.py",),
    ),
)


# params_check validates params.yaml and checks that dvc.yaml is the rendering for it: that
# rendering holds every stage's code closure, so every project source file is its dependency
_ALL_CODE = sorted(set().union(*(s.code for s in STAGES)) - set(code_closure("stages/params_check.py")))
STAGES += (
    Stage(
        name="params_check",
        args=(("--out", _d("params_check", "params.json")), ("--dvc-yaml", "dvc.yaml")),
        # the whole params file is its params (any edit reruns it); it also reads dvc.yaml, which
        # DVC refuses as a dependency: the rendering changes only with the params, the registry or
        # the code
        whole_params_file=True,
        deps=("workflow/registry.py", *_ALL_CODE),
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


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """``params.yaml`` (the repository's, by default) as plain data."""
    return yaml.safe_load(Path(path or ROOT / PARAMS_FILE).read_text()) or {}


def render_dvc(config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``dvc.yaml`` document for the registry under ``config`` (default: ``params.yaml``),
    which decides the params-dependent deps (:class:`Dep`)."""
    config = load_config() if config is None else config
    stages: dict[str, Any] = {}
    for s in STAGES:
        entry: dict[str, Any] = {"cmd": s.cmd, "deps": list(s.active_deps(config)) + list(s.code),
                                 "params": [{PARAMS_FILE: None}] if s.whole_params_file else s.params_entries(config)}
        entry["outs"] = list(s.active_out_dirs(config)) + list(s.outs) + [{p: {"persist": True}} for p in s.persist]
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
