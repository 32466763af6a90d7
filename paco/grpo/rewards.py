"""Rewards for PaCo-GRPO on text-to-image sets and edits: a registry of named functions, one float
per composite image, and the reward context a stage builds from its params
(:func:`make_reward_context`).

=============  ===================================================================================
name           what it measures (source)
=============  ===================================================================================
consistency    PaCo-Reward: the grid is cut into its ``rows x cols`` panels (the ``subfigures``
               code, :func:`paco.data.subfigures.split_grid`), every panel pair ``(i, j)``, ``i < j``,
               panel ``i`` first, is scored by the served judge with the T2IS theme template
               (the prompt's global description as the theme) or the theme-free template, and the
               scores are averaged (2x2: 6 pairs). Reference: ``consistency_scorer.py``
               (``prompt_template_version=1``) of X-GenGroup/PaCo-RL. In [0, 1].
clip_t         mean over panels of the CLIP cosine between panel ``k`` and its own panel prompt
               (reference ``subfig_clipT.py``). In [-1, 1].
pickscore      PickScore of the whole grid against the whole prompt, float32:
               ``logit_scale.exp() * cosine(text, image) / 26`` on the ``pickscore`` model role
               (reference ``pickscore_scorer.py`` l.17-50; it divides by 26 "to 0-1"):
               ``yuvalkirstain/PickScore_v1`` with the ViT-H processor at paper scale, a tiny
               CLIP (byte-identical to the ``clip`` role) in the embedded default. Roughly
               [0.7, 0.9] for PickScore_v1 (``exp(logit_scale)`` about 100); not bounded.
consistency_   image editing: ``sqrt(P_SC * P_PF)``, the served judge's P(Yes) for the original
for_editing    image (first) and the edited one (second) under the semantic-consistency question
               (``edit_sc``) and the prompt-following question (``edit_pf``) with the edit
               instruction (paper §7; reference ``consistency_for_editing.py``:
               ``math.sqrt(consistency_score * prompt_following_score)``). The original is the
               prompt's ``reference`` image. In [0, 1].
input_         a guard against reward hacking for editing (not in the paper): the edit's SSIM
fidelity       to its input (:func:`paco.grpo.monitors.input_ssim`). In [-1, 1].
grid_free      a guard against grid textures (not in the paper): ``1 -`` the grid artifact score
               of the whole sample at the policy's latent patch period
               (:func:`paco.grpo.monitors.grid_artifact_score`). At most 1 (about 1 without one).
=============  ===================================================================================

A reward function never hides a failure: an unreachable judge raises
:class:`paco.serving.judge_client.JudgeError`, and a NaN or infinite value raises
:class:`RewardError` naming the reward and the sample (:func:`compute_rewards`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from paco.core.params import Params, ParamsError
from paco.data.subfigures import crop_panels, split_grid
from paco.grpo.monitors import grid_artifact_score, grid_measurable, greyscale, input_ssim
from paco.core.templates import get_template, judge_instruction

#: The reference's PickScore normaliser ("norm to 0-1": ``scores / 26``).
PICKSCORE_SCALE = 26.0


class RewardError(RuntimeError):
    """A reward could not be computed, or is not finite."""


@dataclass(frozen=True)
class SubtaskItem:
    """What the rewards and the policies need of one item of a subtask: a T2IS prompt (a
    ``prompts.parquet`` row), or an edit (``prompt_id`` the item id, ``prompt`` the instruction,
    ``reference`` the input image, a 1x1 layout)."""

    prompt_id: str
    prompt: str
    global_prompt: str
    rows: int
    cols: int
    panel_prompts: tuple[str, ...]
    reference: Image.Image | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SubtaskItem:
        """A ``prompts.parquet`` row (:data:`ITEM_COLUMNS` ``["prompts"]``)."""
        return cls(str(row["prompt_id"]), str(row["prompt"]), str(row.get("global_prompt") or ""),
                   int(row["rows"]), int(row["cols"]), tuple(str(p) for p in row["panel_prompts"]))

    @classmethod
    def from_edit_row(cls, row: Mapping[str, Any]) -> SubtaskItem:
        """An ``edits.parquet`` row (:data:`ITEM_COLUMNS` ``["edits"]``): the instruction as the
        prompt, the decoded input image as the reference, a 1x1 layout.

        Raises:
            paco.core.io.ImageDecodeError: the input image cell does not decode (named by item).
        """
        from paco.core.io import decode_image

        instruction = str(row["instruction"])
        return cls(str(row["item_id"]), instruction, "", 1, 1, (instruction,),
                   decode_image(row["input_image"], what=f"edit {row['item_id']} input_image"))


#: the columns GRPO and final sampling read from a subtask's items, by ``dataset``
ITEM_COLUMNS: dict[str, list[str]] = {
    "prompts": ["prompt_id", "split", "prompt", "global_prompt", "rows", "cols", "height", "width", "panel_prompts"],
    "edits": ["item_id", "split", "instruction", "input_image", "height", "width"],
}


def subtask_items(table: Any, dataset: str) -> tuple[Any, dict[str, SubtaskItem]]:
    """A subtask's items table in one layout, and its :class:`SubtaskItem` by id.

    Args:
        table: ``prompts.parquet`` (``dataset="prompts"``) or ``edits.parquet`` (``"edits"``)
            rows, with at least :data:`ITEM_COLUMNS` ``[dataset]``.
        dataset: ``prompts`` or ``edits``.

    Returns:
        ``(items, infos)``: ``items`` has ``prompt_id`` (an edit's ``item_id``), ``split``,
        ``height``, ``width`` (the composite's or the input image's size, px); ``infos`` maps
        ``prompt_id`` to its :class:`SubtaskItem` (an edit's with its decoded input image).

    Raises:
        ValueError: an unknown dataset. paco.core.io.ImageDecodeError: an undecodable input image.
    """
    if dataset not in ITEM_COLUMNS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(ITEM_COLUMNS)}")
    records = table.to_dict("records")
    if dataset == "edits":
        infos = {str(r["item_id"]): SubtaskItem.from_edit_row(r) for r in records}
        items = table.rename(columns={"item_id": "prompt_id"})
    else:
        infos = {str(r["prompt_id"]): SubtaskItem.from_row(r) for r in records}
        items = table
    items = items[["prompt_id", "split", "height", "width"]].copy()
    items["prompt_id"] = items["prompt_id"].astype(str)
    return items.reset_index(drop=True), infos


@dataclass
class RewardContext:
    """The models the rewards call.

    Attributes:
        judge: anything with ``score(triples) -> list[float]`` (a
            :class:`paco.serving.judge_client.JudgeClient`); needed by ``consistency``.
        clip: a :class:`paco.models.clip.ClipScorer`; needed by ``clip_t``.
        pickscore: a :class:`paco.models.clip.ClipScorer` of the PickScore model; needed by
            ``pickscore``.
        instruction: ``theme`` (the T2IS theme template, paper) or ``rank`` (theme-free).
        split_method, tolerance: how grids are cut (``subfigures`` params).
        latent_period: the policy's latent patch period in px (VAE stride x patch size:
            :attr:`paco.grpo.policies.Policy.size_multiple`, 16 for FLUX.1 and Qwen-Image), which
            ``grid_free`` measures; the trainer sets it from the policy it loads.
        pending_judge: makes ``judge`` when :meth:`connect` is called (``make_reward_context(...,
            connect=False)``: the judge is reached after the policy has loaded); ``None``: nothing
            pending.
    """

    judge: Any = None
    clip: Any = None
    pickscore: Any = None
    instruction: str = "theme"
    split_method: str = "refine"
    tolerance: float = 0.08
    latent_period: int = 16
    pending_judge: Callable[[], Any] | None = field(default=None, repr=False)

    def connect(self) -> RewardContext:
        """Make the pending judge client now (waiting for a local judge server to be ready and
        checking the model it serves); nothing when none is pending. Every process of a stage
        calls it at the same point (a local server's URL is gathered over the processes). Returns
        ``self``.

        Raises:
            paco.serving.judge_client.JudgeError: the judge is unreachable or serves another model.
        """
        if self.pending_judge is not None:
            self.judge = self.pending_judge()  # a failure leaves it pending: a retry tries again
            self.pending_judge = None
        return self

    def panel_boxes(self, image: Image.Image, prompt: SubtaskItem) -> list[tuple[int, int, int, int]]:
        """The grid's ``rows x cols`` panel boxes (:func:`paco.data.subfigures.split_grid`)."""
        return split_grid(image, prompt.rows, prompt.cols, method=self.split_method, tolerance=self.tolerance)

    def panels(self, image: Image.Image, prompt: SubtaskItem) -> list[Image.Image]:
        """The grid's panels, row-major."""
        return crop_panels(image, self.panel_boxes(image, prompt))


#: reward name -> the ``RewardContext`` scorer it needs beyond the judge and CLIP (loaded only
#: when a requested reward needs it: PickScore_v1 is a ViT-H, about 1 B parameters)
PICKSCORE_REWARDS = frozenset({"pickscore"})


def make_reward_context(params: Params, endpoint: Any, clip_dir: Path, pickscore_dir: Path, *,
                        rewards: Iterable[str], device: Any = "cpu", connect: bool = True) -> RewardContext:
    """The reward context of a stage (``grpo``, ``final_samples``): the judge client
    (``judge_endpoint`` params), the CLIP scorer, the PickScore scorer when one of ``rewards``
    needs it (:data:`PICKSCORE_REWARDS`), the judge instruction and the grid cutting
    (``subfigures`` params). The scorers load before waiting for the endpoint, so they load while
    a local judge server starts; with ``connect=False`` the judge client is left pending
    (:meth:`RewardContext.connect`), so the caller can also load its policy first (the trainer
    and final sampling do: at paper scale vLLM's start-up and FLUX.1's load each take about a
    minute).

    Args:
        params: the validated params.
        endpoint: a :class:`paco.serving.endpoint.JudgeEndpoint` (its ``url()`` waits for the judge).
        clip_dir: the CLIP model directory (``models`` stage, role ``clip``).
        pickscore_dir: the PickScore model directory (``models`` stage, role ``pickscore``).
        rewards: the names of the rewards the stage computes (a subtask's ``rewards``).
        device: the torch device the scorers run on, in float32 as the reference's
            ``pickscore_score(device)`` (``rewards.py``); their embeddings come back on CPU.

    Raises:
        paco.serving.judge_client.JudgeError: the judge is unreachable or serves another model.
        paco.models.loading.ModelDirectoryError: a scorer's directory is missing or incomplete.
        ParamsError: ``judge_endpoint.api_key_env`` names an unset variable.
    """
    import torch

    from paco.serving.judge_client import JudgeClient
    from paco.models.clip import ClipScorer

    cfg = params.judge_endpoint
    api_key = None
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env)
        if not api_key:
            raise ParamsError(f"judge.api_key_env names {cfg.api_key_env!r}, which is not set")
    clip = ClipScorer(clip_dir, device=device, dtype=torch.float32)
    pickscore = None
    if PICKSCORE_REWARDS & set(rewards):
        pickscore = ClipScorer(pickscore_dir, device=device, dtype=torch.float32)

    def judge_client() -> JudgeClient:
        client = JudgeClient(endpoint.url(), cfg.served_model_name, concurrency=cfg.concurrency,
                             timeout_s=cfg.timeout_s, retries=cfg.retries, top_logprobs=cfg.top_logprobs,
                             answer_variants=cfg.answer_variants, api_key=api_key,
                             supervisor=endpoint.supervisor())
        client.check_model()
        return client

    ctx = RewardContext(clip=clip, pickscore=pickscore, instruction=cfg.instruction,
                        split_method=params.subfigures.method, tolerance=params.subfigures.tolerance,
                        pending_judge=judge_client)
    return ctx.connect() if connect else ctx


RewardFn = Callable[[Sequence[Image.Image], Sequence[SubtaskItem], RewardContext], np.ndarray]
REWARDS: dict[str, RewardFn] = {}
#: Rewards computed by a served model (the judge over HTTP), not on this process's device: a
#: trainer may score them on a worker thread while it samples (``rollout.overlap_rewards``).
SERVED_REWARDS: set[str] = set()


def register(name: str, *, served: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Add a reward function to :data:`REWARDS` under ``name`` (``served``: it only waits on a
    served model, see :data:`SERVED_REWARDS`; such a function must give each sample the same
    value whichever other samples it is called with)."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        REWARDS[name] = fn
        if served:
            SERVED_REWARDS.add(name)
        return fn

    return deco


def _need(obj: Any, what: str, reward: str) -> Any:
    if obj is None:
        raise RewardError(f"reward {reward!r} needs a {what}, none was given (a reward context made with "
                          "connect=False is connected by RewardContext.connect())")
    return obj


@register("consistency", served=True)
def consistency(images: Sequence[Image.Image], prompts: Sequence[SubtaskItem], ctx: RewardContext) -> np.ndarray:
    """Mean judge score over all panel pairs of each grid (see the module table).

    Returns ``(n,)`` float64 in [0, 1]. Raises :class:`RewardError` for a grid of fewer than two
    panels, :class:`paco.serving.judge_client.JudgeError` when the judge fails.
    """
    judge = _need(ctx.judge, "judge", "consistency")
    triples, owner = [], []
    for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
        panels = ctx.panels(image, prompt)
        if len(panels) < 2:
            raise RewardError(f"consistency: prompt {prompt.prompt_id} has a {prompt.rows}x{prompt.cols} layout; "
                              "pairs need at least two panels")
        text = judge_instruction(prompt.global_prompt if ctx.instruction == "theme" else None)
        for a, b in itertools.combinations(range(len(panels)), 2):
            triples.append((panels[a], panels[b], text))
            owner.append(i)
    scores = np.asarray(judge.score(triples), dtype=np.float64)
    if scores.shape != (len(triples),):
        raise RewardError(f"consistency: the judge returned {scores.shape} scores for {len(triples)} pairs")
    return np.bincount(owner, weights=scores, minlength=len(images)) / np.bincount(owner, minlength=len(images))


def editing_scores(judge: Any, originals: Sequence[Image.Image], edited: Sequence[Image.Image],
                   instructions: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(P_SC, P_PF, sqrt(P_SC * P_PF))`` per edit, each ``(n,)`` float64 in [0, 1].

    The judge sees the original first and the edited image second, once with the ``edit_sc``
    question and once with ``edit_pf`` (:mod:`paco.core.templates`), both carrying the
    instruction; one ``judge.score`` call scores all ``2n`` requests (SC of every edit, then PF).
    Source: paper §7; X-GenGroup/PaCo-RL ``consistency_for_editing.py``.

    Raises:
        ValueError: the three sequences differ in length.
        RewardError: the judge returned the wrong number of scores.
        paco.serving.judge_client.JudgeError: the judge failed (never a default score).
    """
    if not len(originals) == len(edited) == len(instructions):
        raise ValueError(f"{len(originals)} originals, {len(edited)} edits, {len(instructions)} instructions")
    sc, pf = get_template("edit_sc"), get_template("edit_pf")
    triples = ([(o, e, sc.format(prompt=t)) for o, e, t in zip(originals, edited, instructions, strict=True)]
               + [(o, e, pf.format(prompt=t)) for o, e, t in zip(originals, edited, instructions, strict=True)])
    scores = np.asarray(judge.score(triples), dtype=np.float64) if triples else np.zeros(0)
    if scores.shape != (len(triples),):
        raise RewardError(f"consistency_for_editing: the judge returned {scores.shape} scores for "
                          f"{len(triples)} requests")
    n = len(originals)
    p_sc, p_pf = scores[:n], scores[n:]
    return p_sc, p_pf, np.sqrt(p_sc * p_pf)


@register("consistency_for_editing", served=True)
def consistency_for_editing(images: Sequence[Image.Image], prompts: Sequence[SubtaskItem],
                            ctx: RewardContext) -> np.ndarray:
    """The editing reward ``sqrt(P_SC * P_PF)`` of each edited image against its prompt's
    ``reference`` (:func:`editing_scores`); ``(n,)`` float64 in [0, 1].

    Raises :class:`RewardError` for a prompt without a reference image."""
    judge = _need(ctx.judge, "judge", "consistency_for_editing")
    missing = [p.prompt_id for p in prompts if p.reference is None]
    if missing:
        raise RewardError(f"consistency_for_editing: prompts {missing[:5]} have no reference (input) image")
    return editing_scores(judge, [p.reference for p in prompts], list(images), [p.prompt for p in prompts])[2]


@register("clip_t")
def clip_t(images: Sequence[Image.Image], prompts: Sequence[SubtaskItem], ctx: RewardContext) -> np.ndarray:
    """Mean CLIP cosine of each panel with its own panel prompt; ``(n,)`` float64 in [-1, 1].

    Raises :class:`RewardError` when a prompt's panel prompts do not match its layout."""
    clip = _need(ctx.clip, "CLIP model", "clip_t")
    panels, texts, owner = [], [], []
    for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
        cut = ctx.panels(image, prompt)
        if len(prompt.panel_prompts) != len(cut):
            raise RewardError(f"clip_t: prompt {prompt.prompt_id} has {len(prompt.panel_prompts)} panel prompts "
                              f"for {len(cut)} panels")
        panels += cut
        texts += list(prompt.panel_prompts)
        owner += [i] * len(cut)
    cos = clip.cosine(clip.image_embeddings(panels), clip.text_embeddings(texts)).double().numpy()
    return np.bincount(owner, weights=cos, minlength=len(images)) / np.bincount(owner, minlength=len(images))


@register("pickscore")
def pickscore(images: Sequence[Image.Image], prompts: Sequence[SubtaskItem], ctx: RewardContext) -> np.ndarray:
    """PickScore of each whole grid against its whole prompt: ``logit_scale.exp() *
    cosine(text_emb, image_emb) / 26`` with the PickScore model (``ctx.pickscore``), float32
    embeddings, the text padded and truncated to 77 tokens with an attention mask.

    Source: X-GenGroup/PaCo-RL ``PaCo-GRPO/paco_grpo/rewards/pickscore_scorer.py`` l.17-50 (the
    normalised features, ``.diag()`` of ``logit_scale.exp() * text @ image.T``, ``/ 26``), called
    with the whole composite and ``sample['prompt']`` (``train_flux.py`` l.121-123).

    Returns ``(n,)`` float64 (about [0.7, 0.9] for PickScore_v1; not bounded). Raises
    :class:`RewardError` when the context has no PickScore scorer."""
    scorer = _need(ctx.pickscore, "PickScore model", "pickscore")
    scores = scorer.image_text_scores(list(images), [p.prompt for p in prompts]).double().numpy()
    return scores / PICKSCORE_SCALE


@register("input_fidelity")
def input_fidelity(images: Sequence[Image.Image], prompts: Sequence[SubtaskItem], ctx: RewardContext) -> np.ndarray:
    """A guard for the editing subtasks: the SSIM of each edit to its input
    (:func:`paco.grpo.monitors.input_ssim`: greyscale, the input resized to the edit's size), so an
    edit pays for drifting from its input or covering it with a texture; it enters the advantages
    under the subtask's aggregation as any reward does. Not in the paper (its editing reward is
    ``consistency_for_editing`` alone).

    Returns ``(n,)`` float64 in [-1, 1]. Raises :class:`RewardError` for a prompt without a
    reference (input) image."""
    missing = [p.prompt_id for p in prompts if p.reference is None]
    if missing:
        raise RewardError(f"input_fidelity: prompts {missing[:5]} have no reference (input) image")
    return np.array([input_ssim(im, p.reference) for im, p in zip(images, prompts, strict=True)], dtype=np.float64)


@register("grid_free")
def grid_free(images: Sequence[Image.Image], prompts: Sequence[SubtaskItem], ctx: RewardContext) -> np.ndarray:
    """A guard against grid textures (not in the paper): ``1 - grid_artifact``, the monitor
    :func:`paco.grpo.monitors.grid_artifact_score` of the whole sample (the latent patch grid is
    the image's) at ``ctx.latent_period``, so a texture at the latent patch grid costs reward; it
    enters the advantages under the subtask's aggregation as any reward does.

    Returns ``(n,)`` float64, at least 0 (about 1 without a grid texture). Raises
    :class:`RewardError` when a sample is too small for the period
    (:func:`paco.grpo.monitors.grid_measurable`)."""
    out = []
    for image, prompt in zip(images, prompts, strict=True):
        grey = greyscale(image)
        if not grid_measurable(grey.shape, ctx.latent_period):
            raise RewardError(f"grid_free: prompt {prompt.prompt_id}: a sample of {image.width} x {image.height} px "
                              f"is too small for a {ctx.latent_period} px grid (paco.grpo.monitors.grid_measurable)")
        out.append(1.0 - grid_artifact_score(grey, ctx.latent_period))
    return np.asarray(out, dtype=np.float64)


def check_reward_names(names: Iterable[str], where: str, *, source: str = "params.yaml") -> None:
    """Check that every name in ``names`` is a registered reward (:data:`REWARDS`).

    The params schema checks a subtask's ``rewards`` for shape only (it imports nothing above
    :mod:`paco.core`); the stages that compute rewards (``grpo``, ``final_samples``) call this at
    their start, and ``params_check`` for every subtask, so ``dvc repro`` stops early on a
    misspelled reward.

    Args:
        names: reward names (a ``grpo.<subtask>.rewards`` mapping gives its keys).
        where: the dotted params key of the names, e.g. ``grpo.t2is.rewards``.
        source: the params file, for the message.

    Raises:
        paco.core.params.ParamsError: ``source: invalid parameters`` and a line
            ``  <where>: unknown reward(s) [...]; registered: [...]``, as the schema's errors.
    """
    unknown = sorted(set(names) - set(REWARDS))
    if unknown:
        raise ParamsError(f"{source}: invalid parameters\n  {where}: unknown reward(s) {unknown}; "
                          f"registered: {sorted(REWARDS)}")


def compute_rewards(names: Sequence[str], images: Sequence[Image.Image], prompts: Sequence[SubtaskItem],
                    ctx: RewardContext) -> dict[str, np.ndarray]:
    """Every reward in ``names`` for every image: name -> ``(n,)`` float64.

    Raises:
        KeyError: an unknown reward name (the message lists the registry).
        RewardError: a reward returned the wrong shape or a non-finite value (the message names
            the reward, the sample index and its prompt).
        paco.serving.judge_client.JudgeError: the judge failed (never replaced by a default score).
    """
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    unknown = [n for n in names if n not in REWARDS]
    if unknown:
        raise KeyError(f"unknown reward(s) {unknown}; registered: {sorted(REWARDS)}")
    out: dict[str, np.ndarray] = {}
    for name in names:
        values = np.asarray(REWARDS[name](images, prompts, ctx), dtype=np.float64)
        if values.shape != (len(images),):
            raise RewardError(f"reward {name!r} returned shape {values.shape} for {len(images)} images")
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            raise RewardError(f"reward {name!r} is {values[i]} for sample {i} (prompt {prompts[i].prompt_id}); "
                              f"{bad.size} non-finite value(s) in all")
        out[name] = values
    return out


class OverlappedRewards:
    """Scores the served rewards (:data:`SERVED_REWARDS`, the judge) of each submitted group of
    samples on one worker thread while the caller samples the next group (the GRPO rollout and
    evaluation, the final samples), as ddpo-pytorch overlaps its reward server with sampling.

    A served reward gives each sample the same value whichever samples it is called with (the
    judge server's ``batching: auto`` is batch-invariant), so the rewards, advantages and LoRA
    equal those of scoring the whole epoch after sampling (tests/test_grpo.py). A server whose
    scores depend on what shares a batch (vLLM, ``batching: dynamic``) gives run-to-run
    differences with or without overlap alike. A failure is
    raised at the next :meth:`submit` or at :meth:`collect`; never turned into a score.
    """

    def __init__(self, names: Sequence[str], ctx: RewardContext):
        self.names = [n for n in names if n in SERVED_REWARDS]
        self.ctx = ctx
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="served-rewards") if self.names else None
        self._parts: list[Future] = []

    def submit(self, images: list[Any], infos: list[SubtaskItem]) -> None:
        """Queue one group's images; raises the error of an earlier group that failed."""
        if self._pool is None or not images:
            return
        for done in self._parts:
            if done.done() and done.exception() is not None:
                raise done.exception()
        self._parts.append(self._pool.submit(compute_rewards, self.names, list(images), list(infos), self.ctx))

    def collect(self) -> dict[str, np.ndarray]:
        """Wait for every group; reward name -> ``(n,)`` float64 in submission order."""
        parts = [f.result() for f in self._parts]
        self._parts = []
        return {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0) for n in self.names}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
