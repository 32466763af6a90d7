"""The ``benchmark:`` params section: the generators' benchmarks (paper Table 3,
T2IS-Bench, and Table 4, GEdit-Bench), one member per ``final_samples`` subtask. Stage
``benchmark@<subtask>`` scores that subtask's base and LoRA samples
(``data/final_samples/<subtask>/samples.parquet``) with its protocol through OpenAI-compatible
evaluators (:mod:`paco.benchmark`; see :mod:`paco.core.params` for the typing rules).

The checks that span sections (each key a ``final_samples`` key of the same ``dataset``, at most
its seeds, evaluator roles in ``models``, GPUs for a vLLM evaluator) are
:class:`paco.core.params.schema.Params`'.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from paco.core.params.base import ROLE_PATH, _Section
from paco.core.params.grpo import Dataset, SubtaskResources

#: an evaluator's name: a column of the scores and metrics, and a file name of its answer cache
EVALUATOR_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: the judge trained here, as an evaluator model
TRAINED_JUDGE = "data/reward_merge/model"
#: the dataset each protocol reads (T2IS-Bench cases are prompts, GEdit-Bench items are edits)
PROTOCOL_DATASET = {"t2is": "prompts", "gedit": "edits"}


class BenchmarkEvaluatorParams(_Section):
    """One evaluator (a column of Table 3 / 4): an OpenAI-compatible endpoint.

    ``url`` null: the stage serves ``model`` itself on a free localhost port, as grpo serves its
    judge (``judge_endpoint.server``: engine, dtype, vLLM flags; ``--max-logprobs`` at least
    ``benchmark.<k>.top_logprobs``); ``model`` is then a data dependency, ``data/reward_merge/model``
    (the judge trained here) or ``data/models/<role>`` (a ``models`` role, e.g.
    ``evaluator_qwen: Qwen/Qwen2.5-VL-7B-Instruct``). A URL (``http://host:8000/v1``): that server,
    asked for ``served_model_name``; ``model`` is then unused (may be null).

    ``backend``: ``openai`` (the above: a URL or a server the stage starts) or ``transformers``
    (``model`` loaded in the stage's process with ``judge_endpoint.server``'s device, dtype and
    ``max_model_len``, no server: :class:`paco.benchmark.local_evaluator.LocalEvaluator`; any
    number of images and text replies, for GPU nodes without vLLM; ``url`` and ``api_key_env``
    null).

    Raises (validation):
        ValueError: ``url`` null without ``model``; ``model`` of neither form; a URL that is not
            http(s); ``backend: transformers`` with a url, an ``api_key_env`` or no model.
    """

    model: str | None = Field(None, description="data/reward_merge/model or data/models/<role> (served by the stage "
                              "when url is null)")
    url: str | None = Field(None, description="null: the stage serves model; else http(s)://host:port/v1")
    served_model_name: str = Field(min_length=1, description="the model name asked for (--served-model-name)")
    api_key_env: str | None = Field(None, description="NAME of the env variable holding the key (a url's)")
    stand_in_for: str | None = Field(None, description="the paper's evaluator this one stands in for (table.md)")
    backend: Literal["openai", "transformers"] = Field(
        "openai", description="openai: the url, or a server of model the stage starts; transformers: model in the "
        "stage's process (judge_endpoint.server's device and dtype), no server")

    @field_validator("model")
    @classmethod
    def _model_path(cls, model: str | None) -> str | None:
        if model is not None and model != TRAINED_JUDGE and not ROLE_PATH.fullmatch(model):
            raise ValueError(f"model {model!r}: write {TRAINED_JUDGE} (the judge trained here) or data/models/<role> "
                             "(a models role)")
        return model

    @model_validator(mode="after")
    def _served(self) -> BenchmarkEvaluatorParams:
        if self.url is None and self.model is None:
            raise ValueError("url is null (the stage serves the evaluator) but no model is given")
        if self.url is not None and not re.fullmatch(r"https?://\S+", self.url):
            raise ValueError(f"url {self.url!r}: write http(s)://host:port/v1, or null to serve model")
        if self.backend == "transformers" and (self.url is not None or self.api_key_env is not None):
            raise ValueError("backend transformers loads model in the stage's process: url and api_key_env must "
                             "be null")
        return self


class T2ISProtocolParams(_Section):
    """T2IS-Bench (``protocol: t2is``): visual consistency always (chengyou-jia/T2IS
    ``test_prompt_consistency.py``); prompt alignment, on the cases whose prompts carry Entity /
    Attribute / Relation criteria: ``none`` (not scored: the metrics are null), ``yes_no`` (the
    VQAScore question as a yes/no log-prob of each evaluator, an approximation) or ``t2v_metrics``
    (the official ``clip-flant5-xxl`` VQAScore, ``vqa_alignment.py``, :mod:`paco.benchmark.vqascore`,
    on a GPU) with ``vqascore_python``, the interpreter of a separate environment holding
    ``t2v-metrics==3.0`` (run as a subprocess: its pins cannot join the project's environment),
    and ``vqascore_cache_dir``, the directory holding the downloaded ``clip-flant5-xxl`` weights
    (t2v_metrics' ``cache_dir``; docs/running.md). Aesthetics (the released code has no
    such metric): ``none``, or ``laion`` (the LAION aesthetic predictor, a stand-in:
    :mod:`paco.benchmark.aesthetics`) with ``aesthetics_clip``, a ``data/models/<role>`` holding
    ``openai/clip-vit-large-patch14``, and ``aesthetics_weights``, the path of
    ``sac+logos+ava1-l14-linearMSE.pth`` (or a ``data/models/<role>`` directory holding it).

    Raises (validation):
        ValueError: ``laion`` without both paths, ``aesthetics_clip`` not a ``data/models/<role>``,
            or a path given with ``aesthetics: none``; ``t2v_metrics`` without both
            ``vqascore_python`` and ``vqascore_cache_dir``, or either given with another
            ``prompt_alignment``.
    """

    prompt_alignment: Literal["none", "yes_no", "t2v_metrics"] = "none"
    aesthetics: Literal["none", "laion"] = "none"
    aesthetics_clip: str | None = Field(None, description="laion: data/models/<role> of openai/clip-vit-large-patch14")
    aesthetics_weights: str | None = Field(None, description="laion: sac+logos+ava1-l14-linearMSE.pth (a file path, "
                                           "or a data/models/<role> directory holding it)")
    vqascore_python: str | None = Field(None, description="t2v_metrics: the python of a separate environment with "
                                        "t2v-metrics==3.0 (e.g. /opt/t2v/bin/python)")
    vqascore_cache_dir: str | None = Field(None, description="t2v_metrics: the directory holding the downloaded "
                                           "clip-flant5-xxl weights (t2v_metrics' cache_dir)")

    @model_validator(mode="after")
    def _vqascore(self) -> T2ISProtocolParams:
        paths = (self.vqascore_python, self.vqascore_cache_dir)
        if self.prompt_alignment != "t2v_metrics" and any(p is not None for p in paths):
            raise ValueError(f"prompt_alignment is {self.prompt_alignment}: vqascore_python and vqascore_cache_dir "
                             "must be null")
        if self.prompt_alignment == "t2v_metrics" and any(p is None or not p.strip() for p in paths):
            raise ValueError("prompt_alignment t2v_metrics needs vqascore_python (the interpreter of a separate "
                             "environment with t2v-metrics==3.0) and vqascore_cache_dir (the directory holding the "
                             "clip-flant5-xxl weights): docs/running.md")
        return self

    @model_validator(mode="after")
    def _aesthetics(self) -> T2ISProtocolParams:
        paths = (self.aesthetics_clip, self.aesthetics_weights)
        if self.aesthetics == "none" and any(p is not None for p in paths):
            raise ValueError("aesthetics is none: aesthetics_clip and aesthetics_weights must be null")
        if self.aesthetics == "laion":
            if any(p is None or not p.strip() for p in paths):
                raise ValueError("aesthetics laion needs aesthetics_clip (data/models/<role>) and aesthetics_weights "
                                 "(the sac+logos+ava1-l14-linearMSE.pth path)")
            if not ROLE_PATH.fullmatch(self.aesthetics_clip):
                raise ValueError(f"aesthetics_clip {self.aesthetics_clip!r}: write data/models/<role> (a models role "
                                 "holding openai/clip-vit-large-patch14)")
        return self


class GEditProtocolParams(_Section):
    """GEdit-Bench / VIEScore (``protocol: gedit``; stepfun-ai/Step1X-Edit ``GEdit-Bench/``).

    ``scoring``: ``reply`` (official: the reply's JSON score list, :func:`paco.benchmark.gedit_bench.parse_reply`,
    ``max_tokens`` long) or ``expected_score`` (a stand-in for models that write no JSON: the
    expected score over the first token's log-probs of ``0``..``10``). ``official_random``: an
    item still unparsed after its re-query gets the official random guess (``seed``), else it is
    counted unparsed. ``text_first``: the prompt before the images (VIEScore's GPT backends) instead
    of after them (its Qwen2.5-VL backend)."""

    scoring: Literal["reply", "expected_score"] = "reply"
    max_tokens: int = Field(512, ge=1, description="reply: the reply's token budget")
    official_random: bool = False
    seed: int = Field(42, description="official_random's seed (the Qwen2.5-VL backend reseeds 42 before each query)")
    text_first: bool = False


class BenchmarkParams(_Section):
    """The benchmark of one subtask (``benchmark.<subtask>``, a ``final_samples`` key): stage
    ``benchmark@<subtask>``.

    ``seeds_per_prompt`` / ``max_prompts`` choose the cases scored: the first ``seeds_per_prompt``
    seeds of each prompt (null: all of ``final_samples``'), of the first ``max_prompts`` prompts
    in ``prompt_id`` order (null: all); each (prompt, seed) is a case, scored for both variants.
    ``concurrency``, ``timeout_s``, ``retries`` and ``top_logprobs`` are the evaluator clients'
    (:class:`paco.benchmark.evaluator.Evaluator`; ``top_logprobs``: first-token entries asked for
    by the yes/no and expected-score questions).

    Raises (validation):
        ValueError: no evaluator, a bad evaluator name, a protocol whose dataset is not ``dataset``,
            or ``resources.processes`` or ``nodes`` other than 1 (the stage is launched by :mod:`paco.core.launch`
            as one process).
    """

    protocol: Literal["t2is", "gedit"]
    dataset: Dataset = Field(description="as final_samples.<subtask>.dataset: prompts (t2is) | edits (gedit)")
    evaluators: dict[str, BenchmarkEvaluatorParams]
    seeds_per_prompt: int | None = Field(None, ge=1)
    max_prompts: int | None = Field(None, ge=1)
    concurrency: int = Field(16, ge=1, description="requests in flight per evaluator")
    timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(3, ge=0)
    top_logprobs: int = Field(20, ge=1)
    t2is: T2ISProtocolParams = Field(default_factory=T2ISProtocolParams)
    gedit: GEditProtocolParams = Field(default_factory=GEditProtocolParams)
    resources: SubtaskResources = Field(default_factory=SubtaskResources)

    @field_validator("evaluators")
    @classmethod
    def _names(cls, evaluators: dict[str, BenchmarkEvaluatorParams]) -> dict[str, BenchmarkEvaluatorParams]:
        if not evaluators:
            raise ValueError("no evaluator: name at least one (a column of the benchmark's table)")
        bad = [name for name in evaluators if not EVALUATOR_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"evaluator names {bad}: lower-case letters, digits and _, starting with a letter")
        return evaluators

    @model_validator(mode="after")
    def _protocol_dataset(self) -> BenchmarkParams:
        if (self.resources.processes, self.resources.nodes) != (1, 1):
            raise ValueError(f"resources.processes {self.resources.processes}, nodes {self.resources.nodes}: the "
                             "benchmark is one process on one node (its evaluators are asked in turn); write 1 and 1")
        if PROTOCOL_DATASET[self.protocol] != self.dataset:
            raise ValueError(f"protocol {self.protocol!r} scores dataset {PROTOCOL_DATASET[self.protocol]!r}, "
                             f"not {self.dataset!r}")
        return self


def check_benchmark(params: object) -> None:
    """The checks of ``benchmark:`` against the other sections of a :class:`paco.core.params.Params`
    (called by its validator): each ``benchmark.<k>`` is a ``final_samples.<k>`` of the same
    ``dataset`` whose ``seeds_per_prompt`` it does not exceed; an evaluator's (and
    ``t2is.aesthetics_clip``'s / ``aesthetics_weights``') ``data/models/<role>`` is a ``models`` role; a member that serves an evaluator with
    ``judge_endpoint.server.engine: vllm`` on GPUs (a ``device`` other than ``cpu``) has ``resources.gpus`` >=
    ``max(judge_endpoint.server.gpus, 1)``
    (the evaluators are served one after the other on the member's own GPUs).

    Raises:
        ValueError: naming the offending dotted key.
    """
    roles = params.models.roles()  # type: ignore[attr-defined]
    server = params.judge_endpoint.server  # type: ignore[attr-defined]
    for key, cfg in params.benchmark.items():  # type: ignore[attr-defined]
        samples = params.final_samples.get(key)  # type: ignore[attr-defined]
        if samples is None:
            raise ValueError(f"benchmark.{key}: no final_samples.{key} (a benchmark scores that subtask's samples; "
                             f"final_samples: {sorted(params.final_samples)})")  # type: ignore[attr-defined]
        if cfg.dataset != samples.dataset:
            raise ValueError(f"benchmark.{key}.dataset {cfg.dataset!r} differs from final_samples.{key}.dataset "
                             f"{samples.dataset!r}")
        if cfg.seeds_per_prompt is not None and cfg.seeds_per_prompt > samples.seeds_per_prompt:
            raise ValueError(f"benchmark.{key}.seeds_per_prompt {cfg.seeds_per_prompt} exceeds final_samples.{key}."
                             f"seeds_per_prompt {samples.seeds_per_prompt}")
        served = False
        for name, ev in cfg.evaluators.items():
            role = ROLE_PATH.fullmatch(ev.model or "")
            if role is not None and role[1] not in roles:
                raise ValueError(f"benchmark.{key}.evaluators.{name}.model {ev.model!r}: {role[1]!r} is not a models "
                                 f"role {sorted(roles)} (the models stage fetches an evaluator as a role)")
            served = served or (ev.url is None and ev.backend == "openai")
        for field in ("aesthetics_clip", "aesthetics_weights"):
            role = ROLE_PATH.fullmatch(getattr(cfg.t2is, field) or "")
            if role is not None and role[1] not in roles:
                raise ValueError(f"benchmark.{key}.t2is.{field} {getattr(cfg.t2is, field)!r}: {role[1]!r} is not a "
                                 f"models role {sorted(roles)}")
        need = max(server.gpus, 1)
        if served and server.engine == "vllm" and server.device != "cpu" and cfg.resources.gpus < need:
            raise ValueError(f"benchmark.{key}.resources.gpus {cfg.resources.gpus}: {need} needed to serve an "
                             f"evaluator with judge_endpoint.server.engine vllm (tensor parallel over "
                             f"max(judge_endpoint.server.gpus, 1)); or give the evaluators urls")
