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

It checks everything but the reward names (``grpo.<subtask>.rewards``,
``final_samples.<subtask>.rewards``): the schema imports nothing above :mod:`paco.core`, so it
checks their shape only, and the ``params_check`` stage and the stages that compute the rewards
check the names (:func:`paco.grpo.rewards.check_reward_names`).

Nothing here derives values at import time; derived quantities are computed by the stages and
written to their metrics.

The modules: :mod:`~paco.core.params.base` (the strict section base, :class:`ParamsError`, error
formatting, the YAML reader), the sections of the data stages (:mod:`~paco.core.params.data`), of
the judge stages (:mod:`~paco.core.params.judge`), of GRPO and final sampling
(:mod:`~paco.core.params.grpo`), the generators' benchmarks (:mod:`~paco.core.params.benchmark`) and ``resources`` (:mod:`~paco.core.params.resources`), the whole
file (:mod:`~paco.core.params.schema`) and the command line (:mod:`~paco.core.params.cli`).
"""

from paco.core.params.base import FloatPair, IntPair, ParamsError, format_validation_errors, read_params_yaml
from paco.core.params.benchmark import (BenchmarkEvaluatorParams, BenchmarkParams, GEditProtocolParams,
                                       T2ISProtocolParams)
from paco.core.params.data import (CompositesParams, EditImportParams, EditPhotosParams, EditsParams, GenerateParams,
                                   ImportParams, ModelsParams, PairsParams, PhotosParams, PromptsParams,
                                   SubfiguresParams)
from paco.core.params.grpo import (AggregationParams, Dataset, EmaParams, FinalSamplesParams, GrpoEvalParams,
                                   GrpoSubtaskParams, GrpoTrainParams, PolicyFamily, PolicyLoraParams, RolloutParams,
                                   SubtaskResources)
from paco.core.params.judge import (JudgeEndpointParams, JudgeServerParams, ReasonsParams, LocalTeacherParams,
                                    LoraParams, OpenAITeacherParams, PairAugmentParams, RewardEvalParams,
                                    RewardMergeParams, RewardTrainParams, SFTImportParams, TeacherParams,
                                    TemplateTeacherParams)
from paco.core.params.resources import ResourcesParams, StageResources
from paco.core.params.schema import Params, load_params, validate_params

__all__ = [
    "AggregationParams", "BenchmarkEvaluatorParams", "BenchmarkParams", "GEditProtocolParams", "T2ISProtocolParams", "CompositesParams", "Dataset", "EditImportParams", "EditPhotosParams", "EditsParams",
    "EmaParams", "FinalSamplesParams", "FloatPair", "GenerateParams", "GrpoEvalParams", "GrpoSubtaskParams",
    "GrpoTrainParams", "ImportParams", "IntPair", "JudgeEndpointParams", "JudgeServerParams", "ReasonsParams",
    "LocalTeacherParams", "LoraParams", "ModelsParams", "OpenAITeacherParams", "PairAugmentParams", "PairsParams",
    "Params", "ParamsError", "PhotosParams", "PolicyFamily", "PolicyLoraParams", "PromptsParams", "ResourcesParams",
    "RewardEvalParams", "RewardMergeParams", "RewardTrainParams", "RolloutParams", "SFTImportParams", "StageResources",
    "SubfiguresParams", "SubtaskResources", "TeacherParams", "TemplateTeacherParams", "format_validation_errors",
    "load_params", "read_params_yaml", "validate_params",
]
