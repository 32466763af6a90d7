"""The params sections of the data stages: ``models``, ``prompts``, ``edits``, ``composites``,
``subfigures`` and ``pairs`` (see :mod:`paco.core.params` for the typing rules)."""

from __future__ import annotations

import itertools
import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from paco.core.params.base import ROLE_NAME, FloatPair, IntPair, _Section


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class ModelsParams(_Section):
    """Where each model role comes from.

    A value is ``tiny:<name>`` (build a tiny random-init model offline), a hub id such as
    ``Qwen/Qwen2.5-VL-7B-Instruct`` (``huggingface_hub.snapshot_download``), or a local directory
    (copied; e.g. ``data/raw/pretrained/clip``, the tiny CLIP that ``python -m paco.pretrain``
    pretrains, which the embedded default's ``params.yaml`` names for ``clip`` and ``pickscore``). The roles every run needs are ``judge_base`` (Qwen2.5-VL),
    ``policy_t2is`` (FLUX.1), ``clip`` (CLIP dual encoder, the ``clip_t`` reward) and
    ``pickscore`` (the CLIP dual encoder of the ``pickscore`` reward: ``yuvalkirstain/PickScore_v1``
    at paper scale, reference ``pickscore_scorer.py`` l.8-9; the same directory as ``clip`` in the
    embedded default, so byte-identical to it); any further key names
    another role (e.g. ``policy_kontext: black-forest-labs/FLUX.1-Kontext-dev``), built into
    ``data/models/<role>`` and usable as a subtask's ``policy``.

    ``processor_from`` maps a role to a second source (same spec forms) whose processor and
    tokenizer files replace the role's own (:data:`paco.models.fetch.PROCESSOR_FILES`): the
    reference loads PickScore_v1's weights with the processor of
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (``pickscore_scorer.py`` l.8-14).
    """

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, allow_inf_nan=False)

    seed: int = 0
    judge_base: str = "tiny:qwen2_5_vl"
    policy_t2is: str = "tiny:flux"
    clip: str = "tiny:clip"
    pickscore: str = "tiny:clip"
    revision: dict[str, str] = Field(default_factory=dict, description="role -> hub revision")
    allow_patterns: dict[str, list[str]] = Field(
        default_factory=dict, description="role -> snapshot_download allow_patterns"
    )
    processor_from: dict[str, str] = Field(
        default_factory=dict, description="role -> the source (tiny:<name>, hub id or local directory) of its "
        "processor and tokenizer files"
    )

    @model_validator(mode="after")
    def _extra_roles(self) -> ModelsParams:
        for role, spec in (self.model_extra or {}).items():
            if not re.fullmatch(ROLE_NAME, role):
                raise ValueError(f"models.{role}: a role name is lower-case letters, digits and _ (it names "
                                 "the directory data/models/<role>)")
            if not isinstance(spec, str) or not spec.strip():
                raise ValueError(f"models.{role}: a role's source is a string (tiny:<name>, a hub id or a local "
                                 f"directory), got {spec!r}")
        roles = self.roles()
        for what, table in (("revision", self.revision), ("allow_patterns", self.allow_patterns),
                            ("processor_from", self.processor_from)):
            unknown = sorted(set(table) - set(roles))
            if unknown:
                raise ValueError(f"models.{what} names unknown role(s) {unknown} (roles: {sorted(roles)})")
        for role, spec in self.processor_from.items():
            if not spec.strip():
                raise ValueError(f"models.processor_from.{role}: an empty source (tiny:<name>, a hub id or a "
                                 "local directory)")
        return self

    def roles(self) -> dict[str, str]:
        """Role name -> source spec: ``judge_base``, ``policy_t2is``, ``clip``, ``pickscore``, then
        the further roles in name order."""
        extra = dict(sorted((self.model_extra or {}).items()))
        return {"judge_base": self.judge_base, "policy_t2is": self.policy_t2is, "clip": self.clip,
                "pickscore": self.pickscore, **extra}


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
