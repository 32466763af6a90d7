"""Validated pipeline parameters: the schema of ``params.yaml`` (docs/architecture.md §6).

``params.yaml`` is the single source of truth. Every stage validates the *whole* file at start
with these pydantic models (``extra="forbid"`` everywhere), so an unknown or mistyped key anywhere
fails before any work is done, with a message naming the dotted key, e.g.::

    params.yaml: invalid parameters
      composites.photos.gutter_px: Extra inputs are not permitted

Types are strict (pydantic ``strict=True``): no ``true`` for a number, no ``"0.1"`` (a string)
for a number, no ``2.5`` for an integer; an integer is accepted for a float. Non-finite floats
(``.inf``, ``.nan``) are rejected everywhere (``allow_inf_nan=False``) unless a field says
``Field(allow_inf_nan=True)``. Tuple fields are written :data:`IntPair` / :data:`FloatPair`
(YAML gives lists; their elements stay strict). Numbers in exponent form without a dot (``3e-4``)
are floats, as in YAML 1.2 (what DVC reads), not strings as in PyYAML's YAML 1.1.

Check a file without running a stage (``dvc repro`` runs no stage when only a section that no
stage declares changed, e.g. a misspelled ``reward_trian:``)::

    python -m paco.core.params [params.yaml]     # exit 0 and one OK line, or exit 2 and the errors

Nothing here derives values at import time; derived quantities are computed by the stages and
written to their metrics.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator


class ParamsError(ValueError):
    """``params.yaml`` is missing, not YAML, or does not match the schema."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


#: A pair of ints / floats: YAML gives a list, which a strict tuple would refuse; the elements
#: stay strict (no bools, no strings).
IntPair = Annotated[tuple[int, int], Strict(False)]
FloatPair = Annotated[tuple[float, float], Strict(False)]


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class ModelsParams(_Section):
    """Where each model role comes from.

    A value is ``tiny:<name>`` (build a tiny random-init model offline, embedded default), a hub
    id such as ``Qwen/Qwen2.5-VL-7B-Instruct`` (``huggingface_hub.snapshot_download``), or a
    local directory (copied). The roles every run needs are ``judge_base`` (Qwen2.5-VL),
    ``policy_t2is`` (FLUX.1) and ``clip`` (CLIP dual encoder); any further key names another
    role (e.g. ``policy_kontext: black-forest-labs/FLUX.1-Kontext-dev``), built into
    ``data/models/<role>`` and usable as a subtask's ``policy``.
    """

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, allow_inf_nan=False)

    seed: int = 0
    judge_base: str = "tiny:qwen2_5_vl"
    policy_t2is: str = "tiny:flux"
    clip: str = "tiny:clip"
    revision: dict[str, str] = Field(default_factory=dict, description="role -> hub revision")
    allow_patterns: dict[str, list[str]] = Field(
        default_factory=dict, description="role -> snapshot_download allow_patterns"
    )

    @model_validator(mode="after")
    def _extra_roles(self) -> ModelsParams:
        for role, spec in (self.model_extra or {}).items():
            if not re.fullmatch(r"[a-z][a-z0-9_]*", role):
                raise ValueError(f"models.{role}: a role name is lower-case letters, digits and _ (it names "
                                 "the directory data/models/<role>)")
            if not isinstance(spec, str) or not spec.strip():
                raise ValueError(f"models.{role}: a role's source is a string (tiny:<name>, a hub id or a local "
                                 f"directory), got {spec!r}")
        roles = self.roles()
        for what, table in (("revision", self.revision), ("allow_patterns", self.allow_patterns)):
            unknown = sorted(set(table) - set(roles))
            if unknown:
                raise ValueError(f"models.{what} names unknown role(s) {unknown} (roles: {sorted(roles)})")
        return self

    def roles(self) -> dict[str, str]:
        """Role name -> source spec: ``judge_base``, ``policy_t2is``, ``clip``, then the further
        roles in name order."""
        extra = dict(sorted((self.model_extra or {}).items()))
        return {"judge_base": self.judge_base, "policy_t2is": self.policy_t2is, "clip": self.clip, **extra}


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
# edits (the editing subtasks' items)
# --------------------------------------------------------------------------------------------


class EditPhotosParams(_Section):
    """The embedded default's edits of the shipped photographs (:mod:`paco.data.edits`; unknown
    subject or operation names are refused by the ``edits`` stage as a params error)."""

    subjects: list[str] = Field(default_factory=lambda: ["astronaut", "cat", "coffee", "rocket", "grace_hopper",
                                                         "motorcycle"])
    operations: list[str] = Field(default_factory=lambda: ["greyscale", "mirror", "posterise", "warm_cast",
                                                           "cool_cast", "zoom", "replace_subject"])
    size: int = Field(128, ge=16, le=2048, description="side of the square input view (px)")
    test_photos: int = Field(2, ge=1, description="photographs whose items are the test split")


class EditImportParams(_Section):
    """GEdit-Bench layout (``stepfun-ai/GEdit-Bench``; the reference's ``preprocess.py`` split)."""

    path: str = "data/raw/edits/gedit.parquet"
    languages: list[str] | None = Field(None, description="keep these instruction languages (null: all)")
    test_items: int = Field(128, ge=1, description="random test items (reference 128)")
    split_seed: int = Field(42, description="random.seed of the reference's split")
    max_pixels: int = Field(4096 * 4096, ge=1)


class EditsParams(_Section):
    source: Literal["photos", "import"] = "photos"
    seed: int = 0
    strict: bool = True
    photos: EditPhotosParams = Field(default_factory=EditPhotosParams)
    import_: EditImportParams = Field(default_factory=EditImportParams, alias="import")

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, populate_by_name=True)


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
    gutter_px: IntPair = (0, 6)
    border_px: IntPair = (0, 8)
    cell_jitter: float = Field(0.06, ge=0.0, lt=0.25, description="max relative cell size change")
    crop_scale: FloatPair = (0.6, 0.9)
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
    max_pixels: int = Field(
        8192 * 8192, ge=1,
        description="refuse images with more pixels (w x h) than this: a decompression-bomb guard "
        "(ImageTooLargeError, skipped with strict: false); Pillow's own hard limit, about 179 Mpx, "
        "still applies above it",
    )


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
    """Cutting composites into panels (see ``paco.data.subfigures.split_grid``)."""

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
    editing: bool = Field(True, description="also write edit_pairs.parquet: the editing questions' Yes/No pairs "
                          "from the edits whose correct result is known (paco.data.edit_pairs)")
    editing_repeats: int = Field(1, ge=1, description="copies of each editing pair (odd copies mirrored)")


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
    """The CoT teacher (``paco.judge.teacher.make_teacher``)."""

    backend: Literal["template", "openai", "local"] = "template"
    fast: bool = Field(False, description="bare Yes./No. targets (PaCo-Reward-7B-Fast)")
    max_reasons: int = Field(3, ge=1, le=9)
    retries: int = Field(2, ge=0, description="re-asks after a wrong or unparsable answer; for openai also the "
                         "client's max_retries of transport errors (its own backoff)")
    timeout_s: float = Field(60.0, gt=0)
    template: TemplateTeacherParams = Field(default_factory=TemplateTeacherParams)
    openai: OpenAITeacherParams = Field(default_factory=OpenAITeacherParams)
    local: LocalTeacherParams = Field(default_factory=LocalTeacherParams)


class SFTImportParams(_Section):
    """Published judge SFT sets in LLaMA-Factory's layout (``paco.judge.sft_import``): PaCo-Dataset's
    ``sharegpt_editing_cot`` at paper scale. Their rows join ``sft.parquet`` as they are (no teacher)."""

    enabled: bool = False
    dataset_dir: str = Field("data/raw/paco_dataset", description="the folder holding dataset_info.json")
    datasets: dict[str, Literal["t2is", "edit_pf", "edit_sc"]] = Field(
        default_factory=lambda: {"sharegpt_editing_cot": "edit_sc"},
        description="dataset name (in dataset_info.json) -> the question its rows ask",
    )
    strict: bool = Field(True, description="false: skip (and report) malformed rows")
    max_pixels: int = Field(16_777_216, ge=1, description="refuse larger images")

    @model_validator(mode="after")
    def _some_dataset(self) -> "SFTImportParams":
        if self.enabled and not self.datasets:
            raise ValueError("labels.sft_import.enabled needs at least one dataset")
        return self


class LabelsParams(_Section):
    seed: int = 0
    instruction: Literal["theme", "rank"] = Field(
        "theme", description="T2IS theme template (paper) or the theme-free ConsistencyRank template"
    )
    chunk_size: int = Field(64, ge=1, description="pairs per teacher call and per persisted chunk")
    teacher: TeacherParams = Field(default_factory=TeacherParams)
    sft_import: SFTImportParams = Field(default_factory=SFTImportParams)


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


class PairAugmentParams(_Section):
    """Label-preserving augmentation of training pairs (not in the paper; off by default).

    Per training row and epoch: swap image A and image B with probability ``swap`` (the
    consistency question is symmetric), flip each image horizontally with probability
    ``hflip``, and crop each image to a random box covering a fraction in ``crop_scale`` of its
    area (same aspect ratio; ``[1, 1]``: no crop). Test rows are never augmented.
    """

    enabled: bool = False
    swap: float = Field(0.5, ge=0.0, le=1.0)
    hflip: float = Field(0.5, ge=0.0, le=1.0)
    crop_scale: FloatPair = (1.0, 1.0)

    @model_validator(mode="after")
    def _check_crop(self) -> "PairAugmentParams":
        lo, hi = self.crop_scale
        if not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"crop_scale {list(self.crop_scale)} must satisfy 0 < low <= high <= 1")
        return self


class RewardTrainParams(_Section):
    """LoRA SFT of the judge with the first-token-weighted loss (paper §3.1)."""

    seed: int = 0
    lora: LoraParams = Field(default_factory=LoraParams)
    augment: PairAugmentParams = Field(default_factory=PairAugmentParams)
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
    answer_variants: bool = Field(False, description="reference canonicalize=True: sum every token whose "
                                  "strip().lower() text is yes / no (paco.judge.model.canonical_answer)")
    instruction: Literal["theme", "rank"] = Field(
        "theme", description="T2IS theme template (training layout) or the theme-free rank template"
    )
    baselines: list[Literal["base_zero_shot", "clip_i"]] = Field(
        default_factory=lambda: ["base_zero_shot", "clip_i"]
    )
    edit_benchmark: Literal["photos", "editreward", "none"] = Field(
        "photos", description="the judge's editing benchmark (paper Table 1): photos (the held-out photo edits of "
        "edit_pairs.parquet, correct edit known), editreward (EditReward-Bench: its Parquet export or a jsonl), none")
    editreward: str = Field("data/raw/editreward/bench.jsonl", description="EditReward-Bench: a directory or file of "
                            "its Parquet export (EditScore/EditReward-Bench), or the project's jsonl layout "
                            "(paco.judge.evaluation.read_edit_benchmark; read with edit_benchmark: editreward)")
    edit_templates: Literal["reward", "bench"] = Field(
        "bench", description="editing questions: bench (edit_*_bench, the EditReward-Bench evaluation's wording) or "
        "reward (edit_sc / edit_pf, the GRPO reward's wording the judge is trained on)")
    seed: int = 0

# --------------------------------------------------------------------------------------------
# judge serving (the consistency reward of grpo / sample)
# --------------------------------------------------------------------------------------------


class JudgeServerParams(_Section):
    """The local CPU judge server (``python -m paco.judge.serve``), used when ``judge_endpoint.url`` is null."""

    max_batch_size: int = Field(32, ge=1, description="requests per forward pass")
    max_wait_ms: float = Field(10.0, ge=0, description="wait for more requests after the first")
    threads: int = Field(0, ge=0, description="torch threads of the server (0: torch's default)")
    startup_timeout_s: float = Field(180.0, gt=0)
    device: str = Field("auto", description="auto (cuda if available) | cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_logprobs: int = Field(20, ge=1, description="largest top_logprobs served (vLLM's --max-logprobs)")
    batching: Literal["auto", "same_shape", "single", "dynamic"] = Field(
        "auto", description="how concurrent requests share forward passes: single (one request per pass) "
        "keeps every request's logprobs independent of what else is queued, bit for bit, on any device "
        "(GRPO is reproducible); same_shape (identical encodings share an unpadded pass) is faster, and "
        "bit-invariant only where the CPU's GEMM kernels round a row alike at any row count; dynamic pads "
        "mixed batches (fastest, batch-dependent); auto: single")
    max_model_len: int | None = Field(None, ge=2, description="context limit below the model's "
                                      "max_position_embeddings (vLLM's --max-model-len); longer prompts are refused")


class JudgeEndpointParams(_Section):
    """How PaCo-GRPO reaches the PaCo-Reward judge (OpenAI-compatible, see ``paco.judge.serve``).

    ``url: null`` starts ``python -m paco.judge.serve`` on the ``reward_merge`` model on a free
    localhost port for the stage's lifetime; a URL (``http://host:8000/v1`` of ``vllm serve
    <merged judge> --served-model-name <served_model_name>``) uses that server instead.
    """

    url: str | None = None
    served_model_name: str = "paco-reward"
    api_key_env: str | None = Field(None, description="NAME of the env variable holding the key")
    instruction: Literal["theme", "rank"] = Field(
        "theme", description="T2IS theme template (paper) or the theme-free template (as the judge was trained)"
    )
    answer_variants: bool = Field(False, description="reference canonicalize=True: sum every top token whose "
                                  "strip().lower() text is yes / no (paco.judge.client.yes_probability)")
    concurrency: int = Field(16, ge=1, description="requests in flight")
    timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(3, ge=0, description="the openai client's max_retries (its own backoff: 0.5 s "
                         "doubling to 8 s, with jitter, or the server's Retry-After)")
    top_logprobs: int = Field(20, ge=1, description="first tokens asked for; at most the server's --max-logprobs "
                              "(vLLM and paco.judge.serve default 20)")
    server: JudgeServerParams = Field(default_factory=JudgeServerParams)

    @model_validator(mode="after")
    def _check_logprobs(self) -> "JudgeEndpointParams":
        if self.url is None and self.top_logprobs > self.server.max_logprobs:
            raise ValueError(f"top_logprobs {self.top_logprobs} exceeds server.max_logprobs "
                             f"{self.server.max_logprobs}: the local judge server would refuse every request")
        return self


# --------------------------------------------------------------------------------------------
# grpo / sample (foreach over subtasks)
# --------------------------------------------------------------------------------------------


class PolicyLoraParams(_Section):
    """LoRA on the FLUX transformer (paper: r64, alpha 128, attention, added projections and both
    feed-forwards of the double-stream blocks)."""

    rank: int = Field(64, ge=1)
    alpha: float = Field(128.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
        "ff_context.net.2",
    ])

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError(f"dropout {v}: must be 0 (Flow-GRPO's ratio needs the same deterministic "
                             "log-prob when sampling and when training, so LoRA dropout is not supported)")
        return v


#: policy families (paco.grpo.policies.FAMILIES) and what each conditions on
PolicyFamily = Literal["flux", "flux_kontext", "qwen_image_edit"]
Dataset = Literal["prompts", "edits"]
_FAMILY_DATASET = {"flux": "prompts", "flux_kontext": "edits", "qwen_image_edit": "edits"}


def _check_family_dataset(family: str, dataset: str) -> None:
    if _FAMILY_DATASET[family] != dataset:
        raise ValueError(f"family {family!r} needs dataset {_FAMILY_DATASET[family]!r}, not {dataset!r} "
                         "(text to image samples prompts, editing families edit the edits stage's images)")


class RolloutParams(_Section):
    """GRPO rollouts: how the old policy samples the training trajectories (Flow-GRPO)."""

    num_steps: int = Field(10, ge=1, description="denoising steps N (paper 10)")
    guidance_scale: float = Field(3.5, ge=0.0)
    noise_level: float = Field(0.7, ge=0.0, description="a of the SDE steps (paper 0.7)")
    sde_indices: list[int] = Field(default_factory=lambda: [1], description="steps taking the SDE step (paper [1])")
    sigma_max: Annotated[float, Field(gt=0.0, lt=1.0)] | Literal["schedule"] = Field(
        "schedule", description="stands in for sigma in 1 - sigma at sigma = 1 (an SDE step at index 0 only): "
        "'schedule' = the schedule's second sigma (released code, timesteps[1] / 1000), or a fixed number in "
        "(0, 1) (Flow-GRPO's 0.98); see paco.grpo.sde.sde_step")
    same_initial_noise: bool = Field(False, description="a prompt's G trajectories share their initial noise "
                                     "(the reference's same_latent; default off as in the paper)")
    batch_size: int = Field(8, ge=1, description="trajectories per forward pass")
    max_sequence_length: int = Field(512, ge=8, le=512)
    reference_aspect: Literal["keep", "square"] = Field(
        "keep", description="editing families: the input image is resized to the output size, keeping its aspect "
        "(paper), or squashed to a square (released trainer); used in training and evaluation")
    negative_prompt: str | None = Field(
        " ", description="qwen_image_edit: the negative prompt of true CFG (guidance_scale is its scale); null: no "
        "guidance (the released trainer passes none, so its true CFG is off)")
    overlap_rewards: bool = Field(True, description="score the served rewards (the judge) of each prompt's group "
                                  "(and evaluation chunk) on a worker thread while the next one is sampled; the "
                                  "results are the same "
                                  "either way (launch-only: not part of the run identity)")

    @model_validator(mode="after")
    def _indices(self) -> RolloutParams:
        bad = [i for i in self.sde_indices if not 0 <= i < self.num_steps]
        if bad or not self.sde_indices or len(set(self.sde_indices)) != len(self.sde_indices):
            raise ValueError(f"sde_indices {self.sde_indices} must be distinct steps in [0, num_steps={self.num_steps})")
        return self


class EmaParams(_Section):
    """EMA of the trained LoRA (the evaluated and saved weights). After optimizer step ``t``
    (1-based), if ``(t + 1) % update_every == 0``: ``ema = d * ema + (1 - d) * lora`` with
    ``d = decay``, or with ``warmup`` ``d = min((1 + t) / (10 + t), decay)`` (the released code's
    ``EMAModuleWrapper``: warm-up on, ``update_every`` 8, decay 0.9)."""

    enabled: bool = True
    decay: float = Field(0.9, ge=0.0, lt=1.0, description="ema = decay * ema + (1 - decay) * lora")
    warmup: bool = Field(True, description="decay min((1 + t) / (10 + t), decay) at step t (the reference's)")
    update_every: int = Field(8, ge=1, description="update after step t when (t + 1) % update_every == 0 "
                              "(reference 8)")


class GrpoTrainParams(_Section):
    """The policy update (clipped surrogate + KL, paper §4 / Flow-GRPO)."""

    resolution: int = Field(512, ge=16, description="sampling and training resolution (px, square-equivalent)")
    learning_rate: float = Field(3e-4, gt=0)
    adam_betas: FloatPair = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    gradient_steps_per_epoch: int = Field(2, ge=1, description="optimizer steps per epoch (paper 2)")
    batch_size: int = Field(8, ge=1, description="transitions per forward/backward (per process)")
    clip_range: float = Field(1e-4, gt=0, description="PPO ratio clip eps (paper 1e-4)")
    adv_clip_max: float = Field(5.0, gt=0)
    beta: float = Field(0.0, ge=0, description="KL weight (paper 0)")
    log_kl: bool = Field(True, description="with beta 0, still compute the KL to the reference policy for the "
                         "log (one more no-grad forward per trained transition); false: kl is null in train.csv "
                         "and metrics, as the reference code logs no KL at beta 0. With beta > 0 it is always computed")
    max_grad_norm: float = Field(1.0, gt=0)
    global_std: bool = Field(True, description="normalise advantages by the batch std (reference default)")
    trained_sde_steps: list[int] | None = Field(
        None, description="the SDE steps (indices of rollout.sde_indices' steps) the policy gradient uses; null: all "
        "of them (paper); the released Qwen-Image-Edit trainer samples SDE steps [1, 2, 3, 4] but trains on [1]")
    ema: EmaParams = Field(default_factory=EmaParams)


class AggregationParams(_Section):
    method: Literal["weighted_sum", "log_tame", "log_tame_reference", "weighted_advantage_sum", "geometric_mean",
                    "geometric_mean_reference", "harmonic_mean", "harmonic_mean_reference"] = Field(
        "log_tame", description="paco.grpo.advantages.AGGREGATIONS (the *_mean methods need rewards >= 0)")
    delta: float | Literal["mean", "median"] = Field(0.2, description="log-tame threshold on h = std/mean")


class GrpoEvalParams(_Section):
    """Evaluation at the high resolution with deterministic (ODE) sampling."""

    resolution: int = Field(1024, ge=16)
    num_steps: int = Field(20, ge=1)
    every: int = Field(10, ge=1, description="epochs between evaluations (and after the last)")
    split: str = "test"
    max_prompts: int | None = Field(None, ge=1)
    batch_size: int = Field(4, ge=1)


class SubtaskResources(_Section):
    """Launcher and SLURM resources of a foreach member (as ``resources.default``)."""

    processes: int = Field(1, ge=1)
    gpus: int = Field(0, ge=0)
    cpus_per_task: int = Field(2, ge=1)
    mem_mb: int = Field(6000, ge=100)
    runtime: int = Field(60, ge=1, description="minutes")
    accelerate_config: str = "cpu"


class GrpoSubtaskParams(_Section):
    """PaCo-GRPO for one subtask (``grpo.<subtask>``); the stage is ``grpo@<subtask>``."""

    seed: int = 0
    policy: str = Field("policy_t2is", description="models role of the policy")
    family: PolicyFamily = Field("flux", description="policy family (paco.grpo.policies.FAMILIES): flux (text to "
                                 "image) | flux_kontext | qwen_image_edit (editing)")
    dataset: Dataset = Field("prompts", description="prompts (T2IS prompts.parquet) | edits (edits.parquet): "
                             "what the family conditions on")
    split: str = Field("train", description="prompts (or edit items) sampled for training")
    epochs: int = Field(100, ge=1)
    prompts_per_epoch: int = Field(42, ge=1, description="K unique prompts per epoch (paper 42)")
    group_size: int = Field(16, ge=2, description="G trajectories per prompt (paper 16)")
    rollout: RolloutParams = Field(default_factory=RolloutParams)
    train: GrpoTrainParams = Field(default_factory=GrpoTrainParams)
    lora: PolicyLoraParams = Field(default_factory=PolicyLoraParams)
    rewards: dict[str, float] = Field(
        default_factory=lambda: {"consistency": 0.2, "clip_t": 1.0, "pickscore": 1.0},
        description="reward name -> weight (paco.grpo.rewards.REWARDS)")
    aggregation: AggregationParams = Field(default_factory=AggregationParams)
    eval: GrpoEvalParams = Field(default_factory=GrpoEvalParams)
    save_every: int = Field(10, ge=1, description="epochs between checkpoints")
    dtype: Literal["float32", "bfloat16"] = "float32"
    resources: SubtaskResources = Field(default_factory=SubtaskResources)

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        from paco.grpo.rewards import REWARDS

        unknown = sorted(set(rewards) - set(REWARDS))
        if unknown or not rewards:
            raise ValueError(f"unknown reward(s) {unknown}; registered: {sorted(REWARDS)}")
        return rewards

    @model_validator(mode="after")
    def _family_dataset(self) -> GrpoSubtaskParams:
        _check_family_dataset(self.family, self.dataset)
        steps = self.train.trained_sde_steps
        if steps is not None and (not steps or set(steps) - set(self.rollout.sde_indices)):
            raise ValueError(f"train.trained_sde_steps {steps} must be a non-empty subset of rollout.sde_indices "
                             f"{self.rollout.sde_indices}")
        return self


class FinalSamplesParams(_Section):
    """Final sampling for one subtask (``sample.<subtask>``): ODE sampling of the test prompts
    with and without the trained LoRA (paper: 20 steps, guidance 3.5, 1024 px)."""

    seed: int = 0
    policy: str = "policy_t2is"
    family: PolicyFamily = Field("flux", description="as grpo.<subtask>.family")
    dataset: Dataset = Field("prompts", description="as grpo.<subtask>.dataset")
    split: str = "test"
    resolution: int = Field(1024, ge=16)
    num_steps: int = Field(20, ge=1)
    guidance_scale: float = Field(3.5, ge=0.0)
    seeds_per_prompt: int = Field(1, ge=1)
    batch_size: int = Field(4, ge=1)
    max_sequence_length: int = Field(512, ge=8, le=512)
    reference_aspect: Literal["keep", "square"] = Field("keep", description="as grpo.<subtask>.rollout.reference_aspect")
    negative_prompt: str | None = Field(" ", description="as grpo.<subtask>.rollout.negative_prompt")
    rewards: list[str] = Field(default_factory=lambda: ["consistency", "clip_t", "pickscore"],
                               description="rewards scored (the first one's gain is the stage's headline metric)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="bfloat16 applies on CUDA only")
    resources: SubtaskResources = Field(default_factory=SubtaskResources)

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, rewards: list[str]) -> list[str]:
        from paco.grpo.rewards import REWARDS

        unknown = sorted(set(rewards) - set(REWARDS))
        if unknown or not rewards:
            raise ValueError(f"unknown reward(s) {unknown}; registered: {sorted(REWARDS)}")
        return rewards

    @model_validator(mode="after")
    def _family_dataset(self) -> FinalSamplesParams:
        _check_family_dataset(self.family, self.dataset)
        return self


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
    edits: EditsParams = Field(default_factory=EditsParams)
    composites: CompositesParams = Field(default_factory=CompositesParams)
    subfigures: SubfiguresParams = Field(default_factory=SubfiguresParams)
    pairs: PairsParams = Field(default_factory=PairsParams)
    labels: LabelsParams = Field(default_factory=LabelsParams)
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


_ABSENT = object()


def _dotted_key(loc: tuple[Any, ...], raw: Any) -> str:
    """The dotted key of an error location, following ``raw``: a location part that names no key
    or index of the value reached so far (pydantic's union-member tags such as ``float`` or
    ``literal['mean','median']`` below a scalar) is dropped."""
    parts: list[str] = []
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, (dict, list)) or node is _ABSENT:
            node = _ABSENT  # not in the file (a default): keep the schema's name
        else:
            continue  # a union-member tag under a scalar
        parts.append(str(part))
    return ".".join(parts) or "<root>"


def _got(value: Any) -> str:
    """`` (got ...)`` for a scalar input, with a hint for a number written as a string."""
    if isinstance(value, (dict, list)):
        return ""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return f" (got {text})"
        return f" (got {text}, a string: write the number without quotes)"
    return f" (got {text})"


def _format_errors(exc: ValidationError, raw: Any = None) -> str:
    """One line per offending dotted key: ``  key: reason[, or reason] (got value)``."""
    by_key: dict[str, list[str]] = {}
    inputs: dict[str, Any] = {}
    for err in exc.errors():
        key = _dotted_key(tuple(err["loc"]), raw)
        msgs = by_key.setdefault(key, [])
        if err["msg"] not in msgs:
            msgs.append(err["msg"])
        inputs.setdefault(key, err.get("input"))
    return "\n".join(f"  {key}: {', or '.join(msgs)}{_got(inputs[key])}" for key, msgs in by_key.items())


def format_validation_errors(exc: ValidationError, prefix: str = "", raw: Any = None) -> str:
    """A section's validation errors, one line per dotted key (``prefix.key: reason``)."""
    text = _format_errors(exc, raw)
    if prefix:
        text = "\n".join(line.replace("  ", f"  {prefix}.", 1) for line in text.splitlines())
    return f"invalid parameters\n{text}"


def validate_params(raw: dict[str, Any], *, source: str = "params") -> Params:
    """Validate a parsed params mapping (strictly typed, see the module docstring).

    Raises:
        ParamsError: naming every offending dotted key, the reason and the offending value.
    """
    try:
        return Params.model_validate(raw or {})
    except ValidationError as exc:
        raise ParamsError(f"{source}: invalid parameters\n{_format_errors(exc, raw)}") from None


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus YAML 1.2's floats in exponent form without a dot (``3e-4``,
    ``1E+5``), which YAML 1.1 reads as strings but DVC (ruamel.yaml, YAML 1.2) as floats."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_params_yaml(path: str | Path) -> dict[str, Any] | None:
    """Parse a params file as :func:`load_params` does (``None`` for an empty file).

    Raises:
        ParamsError: missing or unreadable file, invalid YAML, or a top level that is not a mapping.
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ParamsError(f"{path}: cannot read ({exc})") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML ({exc})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml`` (the whole file: an unknown section is an error).

    Raises:
        ParamsError: the file is missing, unreadable, not valid YAML, or fails validation.
    """
    return validate_params(read_params_yaml(path), source=str(path))


def main(argv: list[str] | None = None) -> int:
    """``python -m paco.core.params [params.yaml] [--out FILE]``: validate the whole file.

    Prints one ``<path>: OK ...`` line and returns 0, or prints the :class:`ParamsError` (every
    offending dotted key) to stderr and returns 2 (removing ``--out``), without a traceback.
    ``--out`` also writes ``{"params": <path>, "valid": true}`` (the same bytes whatever the valid
    values, so a pipeline stage can depend on it without rerunning when the params change).
    """
    parser = argparse.ArgumentParser(prog="python -m paco.core.params",
                                     description="Validate a params file against paco.core.params.Params.")
    parser.add_argument("params", nargs="?", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument("--out", default=None, help="on success, also write a small JSON marker here")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
    except ParamsError as exc:
        if args.out:
            Path(args.out).unlink(missing_ok=True)  # no stale marker of an earlier valid file
        print(exc, file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"params": str(args.params), "valid": True}) + "\n")
    print(f"{args.params}: OK ({len(type(params).model_fields)} sections; grpo subtasks "
          f"{sorted(params.grpo)}, final_samples subtasks {sorted(params.final_samples)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
