"""The params sections of PaCo-GRPO and final sampling, one entry per subtask: ``grpo.<subtask>``
(policy LoRA, rollouts, the policy update and its EMA, reward aggregation, evaluation) and
``final_samples.<subtask>`` (see :mod:`paco.core.params` for the typing rules).

The reward names are checked for shape only here (a non-empty table of names); that each names a
registered reward is checked by the stages that use them, and by ``params_check``
(:func:`paco.grpo.rewards.check_reward_names`), so the schema imports nothing above
:mod:`paco.core`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from paco.core.params.base import ROLE_PATH, FloatPair, _Section
from paco.core.params.resources import check_nodes


# --------------------------------------------------------------------------------------------
# grpo / final_samples (foreach over subtasks)
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
    gradient_checkpointing: bool = Field(
        False, description="recompute each transformer block's activations in the backward instead of keeping them "
        "(diffusers' enable_gradient_checkpointing, non-reentrant): less memory, about one more forward of compute, "
        "the same loss and gradients; the reference's enable_gradient_checkpointing (config/grpo.py, False)")
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
    train_prompts: int = Field(0, ge=0, description="training prompts (the first N of the training split by id) "
                               "evaluated beside the evaluation split's, for the training against held-out reward "
                               "(train_reward in eval.csv); 0: none")
    batch_size: int = Field(4, ge=1)


class SubtaskResources(_Section):
    """Launcher and SLURM resources of a foreach member (as ``resources.default``; ``processes`` and
    ``gpus`` per node, ``nodes`` > 1 needs GPUs and a GPU ``accelerate_config``).

    Raises (validation):
        ValueError: ``nodes`` > 1 with ``gpus`` 0 or ``accelerate_config`` ``cpu``
            (:func:`paco.core.params.resources.check_nodes`).
    """

    processes: int = Field(1, ge=1, description="accelerate processes per node (one per GPU on GPUs)")
    gpus: int = Field(0, ge=0, description="GPUs per node")
    nodes: int = Field(1, ge=1, description="SLURM nodes; > 1: paco.core.launch starts one launcher per node")
    cpus_per_task: int = Field(2, ge=1, description="CPU threads of the task; on GPUs per GPU (as resources.default)")
    mem_mb: int = Field(6000, ge=100)
    runtime: int = Field(60, ge=1, description="minutes")
    accelerate_config: str = "cpu"

    @model_validator(mode="after")
    def _nodes_need_gpus(self) -> SubtaskResources:
        check_nodes(self.nodes, self.gpus, self.accelerate_config)
        return self


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
    checkpoint_selection: Literal["last", "monitors"] = Field(
        "last", description="the weights saved as the LoRA: last (the final evaluation's, paper) | monitors (the last "
        "evaluation whose reward-hacking monitors stay within their bounds of the first evaluation's: "
        "paco.grpo.monitors.select_evaluation; the first evaluation's, i.e. no change, if none does)")
    dtype: Literal["float32", "bfloat16"] = "float32"
    resources: SubtaskResources = Field(default_factory=SubtaskResources)

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        # the names: paco.grpo.rewards.check_reward_names, at the stage's start and in params_check
        if not rewards:
            raise ValueError("no rewards: name at least one (paco.grpo.rewards.REWARDS)")
        return rewards

    @model_validator(mode="after")
    def _family_dataset(self) -> GrpoSubtaskParams:
        _check_family_dataset(self.family, self.dataset)
        steps = self.train.trained_sde_steps
        if steps is not None and (not steps or set(steps) - set(self.rollout.sde_indices)):
            raise ValueError(f"train.trained_sde_steps {steps} must be a non-empty subset of rollout.sde_indices "
                             f"{self.rollout.sde_indices}")
        return self


#: ``final_samples.<k>.lora`` of a LoRA trained here (group 1: the ``grpo`` key)
LORA_GRPO_PATH = re.compile(r"data/grpo/([A-Za-z0-9_.-]+)/lora")
#: ``final_samples.<k>.lora`` of a released LoRA fetched by the ``models`` stage (group 1: the role)
LORA_ROLE_PATH = ROLE_PATH


class FinalSamplesParams(_Section):
    """Final sampling for one subtask (``final_samples.<subtask>``): ODE sampling of the test prompts
    with and without a LoRA (paper: 20 steps, guidance 3.5, 1024 px).

    ``lora`` (required, no default: the path names the subtask, and both engines read it from the
    params file) is ``data/grpo/<g>/lora`` (``grpo.<g>``'s trained LoRA; ``family`` and ``policy``
    must then be ``grpo.<g>``'s) or ``data/models/<role>`` (a released LoRA fetched by the ``models``
    stage, diffusers or PEFT layout: :mod:`paco.grpo.policies.lora_io`). The cross-section checks
    are :class:`paco.core.params.schema.Params`'.

    ``split: all`` samples every item whatever its split (the benchmarks' whole case sets);
    ``resolution: native`` samples each T2IS case at its own ``height x width`` (rounded to the
    policy's size multiple: :func:`paco.grpo.final_samples.sample_size`).

    Raises (validation):
        ValueError: ``lora`` missing or of neither form; ``resolution: native`` with a dataset
            other than ``prompts``; a ``split`` other than train, test, all.
    """

    seed: int = 0
    policy: str = "policy_t2is"
    lora: str = Field(description="LoRA directory: data/grpo/<subtask>/lora (trained by grpo@<subtask>) or "
                      "data/models/<role> (a released LoRA, e.g. role lora_paco_flux: X-GenGroup/PaCo-FLUX.1-dev-Lora)")
    family: PolicyFamily = Field("flux", description="as grpo.<subtask>.family")
    dataset: Dataset = Field("prompts", description="as grpo.<subtask>.dataset")
    split: Literal["train", "test", "all"] = Field(
        "test", description="the items sampled: train | test | all (every item whatever its split: a benchmark's "
        "whole case set, as paper Tables 3-4 score T2IS-Bench and GEdit-Bench)")
    resolution: Annotated[int, Field(ge=16)] | Literal["native"] = Field(
        1024, description="px: each item at the same aspect with area resolution**2 (paco.grpo.policies.grid_size), "
        "or native: each T2IS case at its own height x width (T2IS-Bench's 512 px panels; dataset prompts only)")
    num_steps: int = Field(20, ge=1)
    guidance_scale: float = Field(3.5, ge=0.0)
    seeds_per_prompt: int = Field(1, ge=1)
    batch_size: int = Field(4, ge=1)
    max_sequence_length: int = Field(512, ge=8, le=512)
    reference_aspect: Literal["keep", "square"] = Field("keep", description="as grpo.<subtask>.rollout.reference_aspect")
    negative_prompt: str | None = Field(" ", description="as grpo.<subtask>.rollout.negative_prompt")
    rewards: list[str] = Field(default_factory=lambda: ["consistency", "clip_t", "pickscore"],
                               description="rewards scored (the first one's gain is the stage's headline metric)")
    independent_scorer: Literal["base_judge", "none"] = Field(
        "base_judge", description="the judge the run did not optimise, for the hacking gap (paco.grpo.monitors): "
        "base_judge scores the judge rewards (consistency, consistency_for_editing) again with the base judge "
        "(data/models/judge_base, zero-shot, in process); none: no independent scores")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="bfloat16 applies on CUDA only")
    resources: SubtaskResources = Field(default_factory=SubtaskResources)

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, rewards: list[str]) -> list[str]:
        # the names: paco.grpo.rewards.check_reward_names, at the stage's start and in params_check
        if not rewards:
            raise ValueError("no rewards: name at least one (paco.grpo.rewards.REWARDS)")
        return rewards

    @model_validator(mode="before")
    @classmethod
    def _lora_required(cls, data: Any) -> Any:
        if isinstance(data, dict) and "lora" not in data:
            raise ValueError("lora is required: write data/grpo/<subtask>/lora (grpo.<subtask>'s LoRA) or "
                             "data/models/<role> (a released LoRA fetched by the models stage)")
        return data

    @field_validator("lora")
    @classmethod
    def _lora_path(cls, lora: str) -> str:
        if not (LORA_GRPO_PATH.fullmatch(lora) or LORA_ROLE_PATH.fullmatch(lora)):
            raise ValueError(f"lora {lora!r}: write data/grpo/<subtask>/lora (a grpo key's LoRA) or "
                             "data/models/<role> (a released LoRA: a models role)")
        return lora

    @model_validator(mode="after")
    def _family_dataset(self) -> FinalSamplesParams:
        _check_family_dataset(self.family, self.dataset)
        if self.resolution == "native" and self.dataset != "prompts":
            # GEdit-Bench's own generation example (stepfun-ai/Step1X-Edit GEdit-Bench/generate_image_example.py,
            # calculate_dimensions(512 * 512, ratio)) samples at a fixed area with the input's aspect: a number here
            raise ValueError(f"resolution native is for dataset prompts (each T2IS case's own height x width); "
                             f"dataset {self.dataset}: write a number, e.g. 512 (GEdit-Bench's released generation: "
                             f"the input's aspect at 512 x 512 px area) or 1024 (the paper)")
        return self
