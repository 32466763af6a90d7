"""The declarations of the stage registry (``workflow/registry.py``): a :class:`Stage` (command,
data dependencies, params sections, outputs, what the run identity leaves out), a :class:`Dep`
read only under some params, a concrete :class:`Member` (one per subtask of a foreach stage), and
the ``${...}`` interpolation both engines do (:func:`interpolate`).

A stage's ``code`` is its import closure (:func:`workflow.code_deps.code_closure`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from paco.core.dotted import DottedKeyError, get_dotted
from paco.core.launch import resources_at
from paco.core.run_identity import without_keys
from workflow.code_deps import code_closure

PARAMS_FILE = "params.yaml"
#: the model roles every run needs; ``models:`` may name more (:func:`model_roles`)
MODEL_ROLES = ("judge_base", "policy_t2is", "clip", "pickscore")
#: keys of the ``models`` section that are settings, not roles (``paco.core.params.ModelsParams``)
MODELS_SETTINGS = frozenset({"seed", "revision", "allow_patterns", "processor_from"})


def model_roles(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The model roles under ``config``: :data:`MODEL_ROLES`, then every further key of
    ``models:`` in name order (as ``paco.core.params.ModelsParams.roles``)."""
    models = config.get("models") or {}
    extra = sorted(k for k in models if k not in MODEL_ROLES and k not in MODELS_SETTINGS)
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
        try:
            node = get_dotted(config, self.key)
        except KeyError:
            return False
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
        metrics: metrics JSON files (also outputs); the ``report.json`` beside each is an
            output too (:attr:`reports`).
        persist: output directories kept across runs (checkpoints, resumable progress): DVC
            ``persist: true``; Snakemake does not declare them (it would delete them first).
        plots: DVC plot definitions (top-level ``plots:`` entries) for this stage's outputs.
        launcher: ``python`` or ``accelerate`` (:mod:`paco.core.launch` with the stage's
            ``resources`` process count and accelerate config: ``accelerate launch`` where the
            config or the count asks for it, else one process in place; ``--resources`` names the
            member's resources block, whose ``gpus`` and ``nodes`` the launcher reads).
        foreach: the params section whose keys are the members (``None``: a plain stage).
        stage_plots: DVC stage-level plots ``{path: {"x": col, "y": col}}`` (outputs; usable with
            ``${key}`` in foreach stages, unlike the top-level ``plots``).
        continuable: dotted params keys a persisted run may continue across (``epochs``,
            ``save_every``): left out of the run identity (:mod:`paco.core.run_identity`).
        evaluation: dotted params keys that change only the evaluation: left out of the run
            identity's training parts; a change re-runs the evaluation on the kept weights.
        launch: dotted params keys that only say how the stage is launched (``resources``).
        subprocesses: project modules the stage starts as processes of their own (the local
            judge server ``paco/serving/server/__main__.py``): their import closure is the stage's code too;
            its launch command has ``--serves_judge`` (:func:`paco.core.launch.judge_gpu_split`)
            unless ``judge_gpu_split`` is False.
        judge_gpu_split: ``None``: ``--serves_judge`` when the stage has ``subprocesses`` (grpo,
            final_samples: the judge on the first ``judge_endpoint.server.gpus`` GPUs, the stage's
            processes on the rest); ``False``: never (benchmark: its evaluators are served one after
            the other on all of the member's GPUs, so there is nothing to split).
        downloads: the stage fetches from the internet (the Hugging Face hub: ``models``). Only such
            a stage runs with hub access (every other stage process sets ``HF_HUB_OFFLINE=1``,
            ``stages/__init__.py``), and the Snakefile makes it a ``localrules`` entry
            (:func:`workflow.registry.local_rules`): under a SLURM profile it runs on the submitting
            (login) host, which has internet where compute nodes may not.
        config_deps: ``config -> paths``: data dependencies named by params values that a
            ``${...}`` path cannot express (a foreach stage's members share one DVC ``do:`` block,
            so a per-member dict of paths cannot be rendered): literal paths, rendered into
            ``dvc.yaml`` for the params file at hand (as :class:`Dep`), every member depending
            on all of them (``benchmark``: every self-served evaluator's model directory).

    ``code`` is derived, not declared: :func:`code_closure` of the stage's :attr:`entries` (its module
    ``stages/<module>.py``, its subprocesses and its launcher, and every project module they import,
    transitively), so editing any module a stage runs reruns it in both engines (DVC through the
    stage's digest file, :mod:`workflow.code_digests`) and changes its run identity.
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
    judge_gpu_split: bool | None = None
    whole_params_file: bool = False
    downloads: bool = False
    config_deps: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None

    @property
    def entries(self) -> tuple[str, ...]:
        """The files the stage's processes start from: its module, its :attr:`subprocesses` and
        its launcher (:mod:`paco.core.launch`)."""
        launcher = ("paco/core/launch.py",) if self.launcher == "accelerate" else ()
        return (f"stages/{self.module or self.name}.py", *self.subprocesses, *launcher)

    @property
    def code(self) -> tuple[str, ...]:
        """Project source files the stage runs (:func:`code_closure` of its :attr:`entries`),
        sorted. Computed when asked: importing the registry parses no source file."""
        return tuple(sorted({f for e in self.entries for f in code_closure(e)}))

    @property
    def resources_block(self) -> str:
        """The dotted params key of a member's resources block: ``<foreach>.${key}.resources``
        (a foreach member's own), else ``resources.stages.<name>``."""
        return f"{self.foreach}.${{key}}.resources" if self.foreach else f"resources.stages.{self.name}"

    @property
    def cmd(self) -> str:
        module = self.module or self.name
        if self.launcher == "accelerate":
            res = "item.resources" if self.foreach else f"resources.stages.{self.name}"
            # the member's resources block by name, not value: the launcher reads its launch-only
            # gpus and nodes from the params file (a value in the command would rerun the stage)
            block = self.resources_block
            # paco.core.launch checks the params first (one clear message, exit code 2), then runs
            # one plain process in place or hands the stage to `accelerate launch`
            launch = (
                f"python -m paco.core.launch --config_file workflow/accelerate/${{{res}.accelerate_config}}.yaml "
                f"--num_processes ${{{res}.processes}} --resources {block} -m"
            )
            split = bool(self.subprocesses) if self.judge_gpu_split is None else self.judge_gpu_split
            if split:  # it may serve its judge on GPUs of its own: the launcher splits them
                launch = launch[:-len("-m")] + "--serves_judge -m"
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
        deps = tuple(_path(d) for d in self.deps if not isinstance(d, Dep) or d.active(effective))
        if self.config_deps is not None:  # literal paths the params name (shared by every member)
            deps += tuple(p for p in self.config_deps(config) if p not in deps)
        return deps

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
                values = [get_dotted(item, rest, None) if rest else item
                          for item in (config.get(self.foreach) or {}).values()]
            else:
                values = [get_dotted(config, section, None)]
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

    @property
    def reports(self) -> tuple[str, ...]:
        """The ``report.json`` beside each metrics file (:func:`paco.core.stage.report_path`):
        declared outputs of both engines, cached like the others, so that DVC's run cache, which
        restores a stage's outputs instead of running it, restores the report of the run whose
        outputs it restores (an undeclared report would be left over from whatever ran last)."""
        return tuple(posixpath.join(posixpath.dirname(m), "report.json") for m in self.metrics)

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

    def identity_deps(self, config: Mapping[str, Any]) -> list[str]:
        """The data dependencies its run identity hashes (:func:`paco.core.run_identity.stage_identity`):
        :meth:`deps` under ``config`` (the validated params), except a path a :class:`Dep` reads only
        under a :attr:`Stage.continuable` key (``reasons.sft_import``'s folder, which joins the table
        after the persisted teacher chunks)."""
        continuable = [self.resolve(k, {}) for k in self.stage.continuable]
        gated = {self.resolve(d.path, config) for d in self.stage.deps
                 if isinstance(d, Dep) and any(d.key == c or d.key.startswith(c + ".") for c in continuable)}
        return [path for path in self.deps(config) if path not in gated]

    def resources(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``resources.default`` updated by the member's own resources block
        (:attr:`Stage.resources_block`), as the launcher reads them
        (:func:`paco.core.launch.resources_at`).

        Raises:
            paco.core.launch.LaunchError: a block that is not a mapping."""
        return resources_at(config, self.resolve(self.stage.resources_block, {}))

    def params_sections(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Declared params keys (dotted) -> their values: a change of any reruns the member."""
        if self.stage.whole_params_file:
            return dict(config)
        out = {}
        for key in self.stage.params:
            node = get_dotted(config, self.resolve(key, {}), None)
            # launch-only keys (resources) rerun nothing, as in dvc.yaml (Stage.params_entries)
            excluded = [k[len(key) + 1:] for k in self.stage.launch if k.startswith(key + ".")]
            out[self.resolve(key, {})] = without_keys(node, excluded) if excluded else node
        return out


def interpolate(text: str, config: Mapping[str, Any], *, keep_unknown: bool = False) -> str:
    """Replace ``${a.b.c}`` with ``config["a"]["b"]["c"]`` (what DVC does with params.yaml).

    ``keep_unknown``: leave placeholders whose first part is not in ``config`` as they are.

    Raises:
        KeyError: a placeholder names a key that is not in ``config``.
    """

    def value(match: re.Match[str]) -> str:
        if keep_unknown and match[1].split(".")[0] not in config:
            return match[0]
        try:
            return str(get_dotted(config, match[1]))
        except DottedKeyError as exc:
            raise KeyError(f"{match[0]}: {exc.part!r} not in params") from None

    return _PLACEHOLDER.sub(value, text)
