"""The whole ``params.yaml``: :class:`Params` (one field per top-level section, with the checks
that span sections), :func:`validate_params` and :func:`load_params`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from paco.core.params.base import ParamsError, _format_errors, _Section, read_params_yaml
from paco.core.params.data import (CompositesParams, EditsParams, ModelsParams, PairsParams, PromptsParams,
                                   SubfiguresParams)
from paco.core.params.grpo import FinalSamplesParams, GrpoSubtaskParams
from paco.core.params.judge import (JudgeEndpointParams, ReasonsParams, RewardEvalParams, RewardMergeParams,
                                    RewardTrainParams)
from paco.core.params.resources import ResourcesParams


class Params(_Section):
    models: ModelsParams = Field(default_factory=ModelsParams)
    prompts: PromptsParams = Field(default_factory=PromptsParams)
    edits: EditsParams = Field(default_factory=EditsParams)
    composites: CompositesParams = Field(default_factory=CompositesParams)
    subfigures: SubfiguresParams = Field(default_factory=SubfiguresParams)
    pairs: PairsParams = Field(default_factory=PairsParams)
    reasons: ReasonsParams = Field(default_factory=ReasonsParams)
    reward_train: RewardTrainParams = Field(default_factory=RewardTrainParams)
    reward_merge: RewardMergeParams = Field(default_factory=RewardMergeParams)
    reward_eval: RewardEvalParams = Field(default_factory=RewardEvalParams)
    judge_endpoint: JudgeEndpointParams = Field(default_factory=JudgeEndpointParams)
    grpo: dict[str, GrpoSubtaskParams] = Field(default_factory=lambda: {"t2is": GrpoSubtaskParams()})
    final_samples: dict[str, FinalSamplesParams] = Field(default_factory=lambda: {"t2is": FinalSamplesParams()})
    resources: ResourcesParams = Field(default_factory=ResourcesParams)

    @model_validator(mode="after")
    def _subtasks(self) -> Params:
        roles = self.models.roles()
        for section in ("grpo", "final_samples"):
            for key, cfg in getattr(self, section).items():
                if cfg.policy not in roles:
                    raise ValueError(f"{section}.{key}.policy: {cfg.policy!r} is not a models role {sorted(roles)}")
        missing = sorted(set(self.final_samples) - set(self.grpo))
        if missing:
            raise ValueError(f"final_samples subtask(s) {missing} have no grpo entry (final_samples.<k> uses "
                             "grpo.<k>'s LoRA)")
        for key, cfg in self.final_samples.items():
            trained = self.grpo[key]
            if (cfg.family, cfg.policy) != (trained.family, trained.policy):
                raise ValueError(f"final_samples.{key}: family/policy {cfg.family}/{cfg.policy} differ from "
                                 f"grpo.{key}'s {trained.family}/{trained.policy} (its LoRA is for that model)")
        return self


def validate_params(raw: dict[str, Any], *, source: str = "params") -> Params:
    """Validate a parsed params mapping (strictly typed, see the module docstring).

    Raises:
        ParamsError: naming every offending dotted key, the reason and the offending value.
    """
    try:
        return Params.model_validate(raw or {})
    except ValidationError as exc:
        raise ParamsError(f"{source}: invalid parameters\n{_format_errors(exc, raw)}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml`` (the whole file: an unknown section is an error).

    Raises:
        ParamsError: the file is missing, unreadable, not valid YAML, or fails validation.
    """
    return validate_params(read_params_yaml(path), source=str(path))
