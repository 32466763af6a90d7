"""The whole ``params.yaml``: :class:`Params` (one field per top-level section, with the checks
that span sections), :func:`validate_params` and :func:`load_params`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from paco.core.params.base import ParamsError, _format_errors, _Section, read_params_yaml
from paco.core.params.benchmark import BenchmarkParams, check_benchmark
from paco.core.params.data import (CompositesParams, EditsParams, ModelsParams, PairsParams, PromptsParams,
                                   SubfiguresParams)
from paco.core.params.grpo import LORA_GRPO_PATH, LORA_ROLE_PATH, FinalSamplesParams, GrpoSubtaskParams
from paco.core.params.judge import (JUDGE_ROLE_PATH, JudgeEndpointParams, ReasonsParams, RewardEvalParams,
                                    RewardMergeParams, RewardTrainParams)
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
    final_samples: dict[str, FinalSamplesParams] = Field(
        default_factory=lambda: {"t2is": FinalSamplesParams(lora="data/grpo/t2is/lora")})
    benchmark: dict[str, BenchmarkParams] = Field(default_factory=dict)
    resources: ResourcesParams = Field(default_factory=ResourcesParams)

    @model_validator(mode="after")
    def _subtasks(self) -> Params:
        """Every subtask's policy is a models role; ``final_samples.<k>.lora`` names an existing
        ``grpo.<g>`` (whose family and policy it must share) or models role; so does a
        ``judge_endpoint.model`` of the ``data/models/<role>`` form."""
        roles = self.models.roles()
        for section in ("grpo", "final_samples"):
            for key, cfg in getattr(self, section).items():
                if cfg.policy not in roles:
                    raise ValueError(f"{section}.{key}.policy: {cfg.policy!r} is not a models role {sorted(roles)}")
        for key, cfg in self.final_samples.items():
            trained_by = LORA_GRPO_PATH.fullmatch(cfg.lora)
            if trained_by is None:  # data/models/<role>: a released LoRA
                role = LORA_ROLE_PATH.fullmatch(cfg.lora)[1]  # type: ignore[index]
                if role not in roles:
                    raise ValueError(f"final_samples.{key}.lora {cfg.lora!r}: {role!r} is not a models role "
                                     f"{sorted(roles)} (the models stage fetches a released LoRA as a role)")
                continue
            g = trained_by[1]
            if g not in self.grpo:
                raise ValueError(f"final_samples.{key}.lora {cfg.lora!r}: there is no grpo.{g} to train it (write "
                                 "data/grpo/<k>/lora for grpo.<k>'s LoRA, or data/models/<role> for a released one)")
            trained = self.grpo[g]
            if (cfg.family, cfg.policy) != (trained.family, trained.policy):
                raise ValueError(f"final_samples.{key}: family/policy {cfg.family}/{cfg.policy} differ from "
                                 f"grpo.{g}'s {trained.family}/{trained.policy} (its LoRA, {cfg.lora}, is for that "
                                 "model)")
        judge = JUDGE_ROLE_PATH.fullmatch(self.judge_endpoint.model)
        if judge is not None and judge[1] not in roles:
            raise ValueError(f"judge_endpoint.model {self.judge_endpoint.model!r}: {judge[1]!r} is not a models role "
                             f"{sorted(roles)} (a released judge is fetched by the models stage as a role)")
        return self

    @model_validator(mode="after")
    def _judge_gpus(self) -> Params:
        """With a served judge on GPUs of the stage's own job (``judge_endpoint.url`` null,
        ``judge_endpoint.server.gpus`` N > 0), every grpo / final_samples member's ``resources.gpus``
        (per node) holds the N judge GPUs and one GPU per process (``paco.core.launch --serves_judge``
        splits them so): ``processes == gpus - N``."""
        judge = self.judge_endpoint
        n = judge.server.gpus
        if judge.url is not None or n == 0:
            return self
        for section in ("grpo", "final_samples"):
            for key, cfg in getattr(self, section).items():
                res = cfg.resources
                if res.gpus <= n:
                    raise ValueError(f"{section}.{key}.resources.gpus {res.gpus}: more than judge_endpoint.server.gpus "
                                     f"{n} needed (the judge's GPUs plus one per process)")
                if res.processes != res.gpus - n:
                    raise ValueError(f"{section}.{key}.resources.processes {res.processes}: {res.gpus - n} processes "
                                     f"expected: {res.gpus} GPUs minus judge_endpoint.server.gpus {n}")
        return self

    @model_validator(mode="after")
    def _benchmark(self) -> Params:
        """``benchmark.<k>`` against ``final_samples``, ``models`` and ``judge_endpoint.server``
        (:func:`paco.core.params.benchmark.check_benchmark`)."""
        check_benchmark(self)
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
