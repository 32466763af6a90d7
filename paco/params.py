"""Validated pipeline parameters: the schema of ``params.yaml`` (DESIGN.md §3).

``params.yaml`` is the single source of truth. Every stage validates the *whole* file at start
with these pydantic models (``extra="forbid"`` everywhere), so an unknown or mistyped key anywhere
fails before any work is done, with a message naming the dotted key, e.g.::

    params.yaml: invalid parameters
      composites.photos.gutter_px: Extra inputs are not permitted

Nothing here derives values at import time; derived quantities are computed by the stages and
written to their metrics.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ParamsError(ValueError):
    """``params.yaml`` is missing, not YAML, or does not match the schema."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class ModelsParams(_Section):
    """Where each model role comes from.

    A value is ``tiny:<name>`` (build a tiny random-init model offline, embedded default), a hub
    id such as ``Qwen/Qwen2.5-VL-7B-Instruct`` (``huggingface_hub.snapshot_download``), or a
    local directory (copied). Roles: ``judge_base`` (Qwen2.5-VL), ``policy_t2is`` (FLUX.1),
    ``clip`` (CLIP dual encoder).
    """

    seed: int = 0
    judge_base: str = "tiny:qwen2_5_vl"
    policy_t2is: str = "tiny:flux"
    clip: str = "tiny:clip"
    revision: dict[str, str] = Field(default_factory=dict, description="role -> hub revision")
    allow_patterns: dict[str, list[str]] = Field(
        default_factory=dict, description="role -> snapshot_download allow_patterns"
    )

    def roles(self) -> dict[str, str]:
        """Role name -> source spec, in a fixed order."""
        return {"judge_base": self.judge_base, "policy_t2is": self.policy_t2is, "clip": self.clip}


# --------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------


class PromptsParams(_Section):
    """T2IS-format prompt set -> ``prompts.parquet``."""

    jsonl: str = "data/raw/t2is_prompts.jsonl"
    strict: bool = True
    test_fraction: float = Field(0.25, ge=0.0, lt=1.0)
    seed: int = 0


# --------------------------------------------------------------------------------------------
# composites
# --------------------------------------------------------------------------------------------


class GenerateParams(_Section):
    """``generate`` source: the policy pipeline renders each grid prompt."""

    height: int | None = Field(None, ge=16, description="override the prompt's height (px)")
    width: int | None = Field(None, ge=16, description="override the prompt's width (px)")
    num_inference_steps: int = Field(28, ge=1)
    guidance_scale: float = Field(3.5, ge=0.0)
    max_sequence_length: int = Field(512, ge=8)
    batch_size: int = Field(1, ge=1)


class PhotosParams(_Section):
    """``photos`` source: grids of views of real photographs with graded inconsistencies.

    ``levels`` are the drift levels of a prompt's composites; the ground-truth ranking of a
    candidate is by ``|level_ref - level_candidate|``, which is tie-free only when all pairwise
    differences of ``levels`` are distinct (a Golomb ruler), checked here.
    """

    size: int = Field(256, ge=32, description="composite height and width (px)")
    levels: list[int] = Field(default_factory=lambda: [0, 1, 3, 7])
    max_level: int = Field(7, ge=1, description="level of full drift (other subject, full style)")
    gutter_px: tuple[int, int] = (0, 6)
    border_px: tuple[int, int] = (0, 8)
    cell_jitter: float = Field(0.06, ge=0.0, lt=0.25, description="max relative cell size change")
    crop_scale: tuple[float, float] = (0.6, 0.9)
    color_jitter: float = Field(0.08, ge=0.0, le=0.5)

    @field_validator("levels")
    @classmethod
    def _golomb(cls, levels: list[int]) -> list[int]:
        if len(set(levels)) != len(levels) or any(lv < 0 for lv in levels):
            raise ValueError("levels must be distinct non-negative integers")
        diffs = [abs(a - b) for a, b in itertools.combinations(levels, 2)]
        if len(set(diffs)) != len(diffs):
            raise ValueError(
                f"levels {levels} give tied rankings: pairwise differences must be distinct "
                "(a Golomb ruler such as [0, 1, 3, 7] or [0, 1, 4, 9, 11])"
            )
        return levels

    @model_validator(mode="after")
    def _max_level(self) -> PhotosParams:
        if max(self.levels) > self.max_level:
            raise ValueError(f"max(levels)={max(self.levels)} exceeds max_level={self.max_level}")
        return self


class ImportParams(_Section):
    """``import`` source: a folder of composite images plus a manifest."""

    dir: str = "data/raw/composites"
    manifest: str = "manifest.jsonl"


class CompositesParams(_Section):
    source: Literal["photos", "generate", "import"] = "photos"
    seeds_per_prompt: int = Field(4, ge=1)
    seed: int = 0
    strict: bool = True
    generate: GenerateParams = Field(default_factory=GenerateParams)
    photos: PhotosParams = Field(default_factory=PhotosParams)
    import_: ImportParams = Field(default_factory=ImportParams, alias="import")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _levels_match_seeds(self) -> CompositesParams:
        if self.source == "photos" and len(self.photos.levels) != self.seeds_per_prompt:
            raise ValueError(
                f"photos.levels has {len(self.photos.levels)} levels but seeds_per_prompt is "
                f"{self.seeds_per_prompt}: each of a prompt's composites needs its own level"
            )
        return self


# --------------------------------------------------------------------------------------------
# subfigures
# --------------------------------------------------------------------------------------------


class SubfiguresParams(_Section):
    """Cutting composites into panels (see ``paco.subfigures.split_grid``)."""

    method: Literal["refine", "equal"] = "refine"
    tolerance: float = Field(0.08, gt=0.0, lt=0.5, description="search window, fraction of size")
    strict: bool = True


# --------------------------------------------------------------------------------------------
# pairs
# --------------------------------------------------------------------------------------------


class PairsParams(_Section):
    """Ranking instances and Yes/No pairs (paper §3.1)."""

    ranking: Literal["ground_truth", "annotations", "auto"] = "ground_truth"
    annotations: str = Field(
        "data/raw/annotations",
        description="ConsistencyRank-Bench rankings: a .jsonl/.json file, or a directory with "
        "consistency_full_rank.jsonl (used when ranking: annotations)",
    )
    candidates: int = Field(4, ge=2, description="candidates per ranking instance")
    batch_size: int = Field(32, ge=1, description="CLIP batch size for the auto ranking")
    seed: int = 0


# --------------------------------------------------------------------------------------------
# labels (CoT targets)
# --------------------------------------------------------------------------------------------


class TemplateTeacherParams(_Section):
    size: int = Field(128, ge=16, description="side (px) panels are resized to before measuring")


class OpenAITeacherParams(_Section):
    base_url: str | None = Field(None, description="e.g. http://127.0.0.1:8000/v1")
    model: str | None = None
    api_key_env: str | None = Field(None, description="NAME of the env variable holding the key")
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    retry_temperature: float = Field(0.7, ge=0.0)
    concurrency: int = Field(4, ge=1)


class LocalTeacherParams(_Section):
    model_dir: str | None = None
    batch_size: int = Field(4, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.7, ge=0.0)
    seed: int = 0
    device: str = "cpu"


class TeacherParams(_Section):
    """The CoT teacher (``paco.teacher.make_teacher``)."""

    backend: Literal["template", "openai", "local"] = "template"
    fast: bool = Field(False, description="bare Yes./No. targets (PaCo-Reward-7B-Fast)")
    max_reasons: int = Field(3, ge=1, le=9)
    retries: int = Field(2, ge=0)
    timeout_s: float = Field(60.0, gt=0)
    backoff_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    template: TemplateTeacherParams = Field(default_factory=TemplateTeacherParams)
    openai: OpenAITeacherParams = Field(default_factory=OpenAITeacherParams)
    local: LocalTeacherParams = Field(default_factory=LocalTeacherParams)


class LabelsParams(_Section):
    seed: int = 0
    instruction: Literal["theme", "rank"] = Field(
        "theme", description="T2IS theme template (paper) or the theme-free ConsistencyRank template"
    )
    chunk_size: int = Field(64, ge=1, description="pairs per teacher call and per persisted chunk")
    teacher: TeacherParams = Field(default_factory=TeacherParams)


# --------------------------------------------------------------------------------------------
# reward_train / reward_merge / reward_eval
# --------------------------------------------------------------------------------------------


class LoraParams(_Section):
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names inside the language model (vision tower and merger stay frozen)",
    )


class RewardTrainParams(_Section):
    """LoRA SFT of the judge with the first-token-weighted loss (paper §3.1)."""

    seed: int = 0
    lora: LoraParams = Field(default_factory=LoraParams)
    learning_rate: float = Field(2e-4, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(8, ge=1, description="per process")
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    first_token_weight: float = Field(0.1, ge=0.0, le=1.0, description="alpha of paper §3.1")
    loss_variant: Literal["paper", "reference"] = "paper"
    checkpoint_every: int = Field(50, ge=1, description="optimizer steps between checkpoints")
    max_train_pairs: int | None = Field(None, ge=1, description="subsample the train split")
    dtype: Literal["float32", "bfloat16"] = "float32"


class RewardMergeParams(_Section):
    check_pairs: int = Field(4, ge=1, description="pairs on which merged == unmerged P(Yes)")
    dtype: Literal["float32", "bfloat16"] = "float32"


class RewardEvalParams(_Section):
    split: str = "test"
    batch_size: int = Field(16, ge=1)
    answer_variants: bool = Field(False, description="sum case/space variants of Yes and No")
    instruction: Literal["theme", "rank"] = Field(
        "theme", description="T2IS theme template (training layout) or the theme-free rank template"
    )
    baselines: list[Literal["base_zero_shot", "clip_i"]] = Field(
        default_factory=lambda: ["base_zero_shot", "clip_i"]
    )
    editreward: str | None = Field(None, description="EditReward-Bench-format jsonl (optional)")
    seed: int = 0

# --------------------------------------------------------------------------------------------
# resources
# --------------------------------------------------------------------------------------------


class StageResources(_Section):
    """Per-stage resources for launchers and SLURM (Snakemake ``resources:``)."""

    processes: int = Field(1, ge=1, description="accelerate processes (one per GPU on GPUs)")
    gpus: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1, description="CPU threads per task (cpus_per_gpu on GPUs)")
    mem_mb: int = Field(4000, ge=100)
    runtime: int = Field(30, ge=1, description="minutes")
    accelerate_config: str = Field(
        "cpu", description="workflow/accelerate/<name>.yaml for `accelerate launch` (cpu, ddp, zero2, fsdp)"
    )


class ResourcesParams(_Section):
    default: StageResources = Field(default_factory=StageResources)
    stages: dict[str, StageResources] = Field(default_factory=dict)

    def for_stage(self, name: str) -> StageResources:
        return self.stages.get(name, self.default)


# --------------------------------------------------------------------------------------------
# the whole file
# --------------------------------------------------------------------------------------------


class Params(_Section):
    models: ModelsParams = Field(default_factory=ModelsParams)
    prompts: PromptsParams = Field(default_factory=PromptsParams)
    composites: CompositesParams = Field(default_factory=CompositesParams)
    subfigures: SubfiguresParams = Field(default_factory=SubfiguresParams)
    pairs: PairsParams = Field(default_factory=PairsParams)
    labels: LabelsParams = Field(default_factory=LabelsParams)
    reward_train: RewardTrainParams = Field(default_factory=RewardTrainParams)
    reward_merge: RewardMergeParams = Field(default_factory=RewardMergeParams)
    reward_eval: RewardEvalParams = Field(default_factory=RewardEvalParams)
    resources: ResourcesParams = Field(default_factory=ResourcesParams)


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {key}: {err['msg']}")
    return "\n".join(lines)


def validate_params(raw: dict[str, Any], *, source: str = "params") -> Params:
    """Validate a parsed params mapping.

    Raises:
        ParamsError: naming every offending dotted key and the reason.
    """
    try:
        return Params.model_validate(raw or {})
    except ValidationError as exc:
        raise ParamsError(f"{source}: invalid parameters\n{_format_errors(exc)}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``.

    Raises:
        ParamsError: the file is missing, not valid YAML, or fails validation.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML ({exc})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return validate_params(raw, source=str(path))
