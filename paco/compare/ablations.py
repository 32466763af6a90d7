"""The paper's ablations as params changes from the baseline, and the commands that queue them.

:data:`ABLATIONS` (the table with the paper's sections: :mod:`paco.compare`) maps an ablation's name
to an :class:`Ablation`; :func:`queue_commands` turns named ablations into
``dvc exp run --queue -n <name> -S <key>=<value> ... <stage>`` argument lists, which ``paco-compare
queue`` runs (the DVC command line: DVC's documented Python API, ``dvc.api``, has no ``exp run``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from paco.compare.errors import CompareError, MissingMetricError
from paco.core.dotted import DottedKeyError, get_dotted


@dataclass(frozen=True)
class Ablation:
    """One of the paper's comparisons as a set of params changes from the baseline.

    ``settings(params, subtask)`` maps the baseline's params (the parsed ``params.yaml``) and a
    subtask key to ``{dotted params key: value}``; ``section`` is the report section holding
    its headline metrics (``grpo`` or ``judge``)."""

    name: str
    paper: str
    section: str
    settings: Callable[[Mapping[str, Any], str], dict[str, Any]]


def _get(params: Mapping[str, Any], dotted: str) -> Any:
    try:
        return get_dotted(params, dotted)
    except DottedKeyError as exc:
        raise MissingMetricError(f"params: no key {dotted!r} (missing {exc.part!r})") from None


def _resolution(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    return {f"grpo.{subtask}.train.resolution": _get(params, f"grpo.{subtask}.eval.resolution")}


def _aggregation(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    _get(params, f"grpo.{subtask}.aggregation.method")
    return {f"grpo.{subtask}.aggregation.method": "weighted_sum"}


def _first_token_weight(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    _get(params, "reward_train.first_token_weight")
    return {"reward_train.first_token_weight": 0.1}


def _cot(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    _get(params, "reasons.teacher.fast")
    return {"reasons.teacher.fast": False}


ABLATIONS: dict[str, Ablation] = {
    a.name: a
    for a in (
        Ablation("resolution", "Fig. 4 / Table 5: full-resolution vs resolution-decoupled training", "grpo",
                 _resolution),
        Ablation("aggregation", "Table 5 / Fig. 6: weighted sum vs log-tame aggregation", "grpo", _aggregation),
        Ablation("first_token_weight", "Table 2: first-token weight alpha = 0.1", "judge", _first_token_weight),
        Ablation("cot", "Table 2: CoT vs fast (bare Yes/No) targets", "judge", _cot),
    )
}


def format_value(value: Any) -> str:
    """A params value as DVC's ``-S key=value`` parses it (YAML scalars: ``true``, ``null``).

    Raises:
        CompareError: a value that is not a scalar (bool, int, float, str, None).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise CompareError(f"params value {value!r} is not a scalar")


def experiment_name(ablation: str, subtask: str) -> str:
    """``<ablation>`` for the t2is subtask and the judge ablations, ``<ablation>-<subtask>`` for
    a GRPO ablation of another subtask (experiment names are unique per baseline)."""
    if ABLATIONS[ablation].section == "grpo" and subtask != "t2is":
        return f"{ablation}-{subtask}"
    return ablation


def default_targets(ablation: str, subtask: str) -> list[str]:
    """The stages an ablation's experiment reproduces (with their upstream): ``final_samples@<subtask>``
    for a GRPO ablation, ``reward_eval`` for a judge ablation (the other subtasks' stages are not
    rerun; their metrics stay the baseline's)."""
    return [f"final_samples@{subtask}"] if ABLATIONS[ablation].section == "grpo" else ["reward_eval"]


def queue_commands(names: Sequence[str], params: Mapping[str, Any], subtask: str = "t2is",
                   targets: Sequence[str] | None = None) -> list[list[str]]:
    """The ``dvc exp run --queue -n <name> -S key=value ... <targets>`` argument lists of the named
    ablations (``targets``: ``None`` for :func:`default_targets`, ``[]`` for the whole pipeline).

    Raises:
        CompareError: no or an unknown ablation name. MissingMetricError: the params lack a key
            the ablation changes (e.g. an unknown subtask).
    """
    if not names:
        raise CompareError(f"no ablation named; choose from {sorted(ABLATIONS)}")
    out = []
    for n in names:
        if n not in ABLATIONS:
            raise CompareError(f"unknown ablation {n!r}; choose from {sorted(ABLATIONS)}")
        cmd = ["dvc", "exp", "run", "--queue", "-n", experiment_name(n, subtask)]
        for key, value in ABLATIONS[n].settings(params, subtask).items():
            cmd += ["-S", f"{key}={format_value(value)}"]
        out.append(cmd + list(default_targets(n, subtask) if targets is None else targets))
    return out
