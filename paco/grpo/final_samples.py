"""Final sampling (stage ``final_samples@<subtask>``): the prompts (or edit items) of a split with and
without the GRPO LoRA (or a released one: ``final_samples.<subtask>.lora``).

Deterministic ODE sampling (the paper's evaluation: 20 steps, 1024 px) of every prompt of
``split`` (``all``: every item, the benchmarks' whole case sets) at :func:`sample_size` (a number:
the item's aspect at that area; ``native``: each T2IS case at its own height x width, T2IS-Bench's
512 px panels), ``seeds_per_prompt`` seeds each (seed ``k`` of prompt ``p`` draws its noise from
``stable_seed(seed, "final", p, k)``, the same noise for both variants), once with the base
policy and once with the LoRA loaded through the pipeline's own ``load_lora_weights`` (exactly
what a user of the released LoRA does; a PEFT-layout LoRA, as the reference trainers save it, is
rewritten as the diffusers file first, and a LoRA the transformer takes only in part is refused:
:func:`paco.grpo.policies.lora_io.load_lora`). Every image is cut into its panels (the ``subfigures``
code; an edit is one panel) and scored with the configured rewards (the judge scores the base
samples while the LoRA samples are made, :class:`paco.grpo.rewards.OverlappedRewards`); the
metrics compare the two variants per reward with a paired t-test over samples
(``scipy.stats.ttest_rel``). Editing subtasks also get a sheet of ``input | base | LoRA``
triplets (``compare``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image, ImageDraw, ImageOps

from paco.core.seeding import stable_seed
from paco.core.statistics import paired_t_p
from paco.core.io import encode_image
from paco.core.params import FinalSamplesParams
from paco.grpo.monitors import MONITORS, monitor_warnings, sample_monitors
from paco.grpo.policies import Policy, grid_size, load_policy
from paco.grpo.policies.lora_io import load_lora
from paco.grpo.rewards import (SERVED_REWARDS, OverlappedRewards, RewardContext, SubtaskItem, compute_rewards,
                               subtask_items)
from paco.grpo.sde import ODE
from paco.data.subfigures import crop_panels

log = logging.getLogger("paco.grpo.final_samples")

VARIANTS = ("base", "lora")
SAMPLE_COLUMNS = ["sample_id", "prompt_id", "seed", "variant", "height", "width", "image", "panels", "bboxes"]


def _generate(policy: Policy, jobs: Sequence[tuple[SubtaskItem, int, tuple[int, int]]], cfg: FinalSamplesParams
              ) -> list[Image.Image]:
    """ODE samples for ``(prompt, seed, (h, w))`` jobs, batched by prompt and size."""
    out: list[Image.Image | None] = [None] * len(jobs)
    groups: dict[tuple[str, tuple[int, int]], list[int]] = {}
    for i, (p, _, size) in enumerate(jobs):
        groups.setdefault((p.prompt_id, size), []).append(i)
    for (pid, (h, w)), idx in groups.items():
        prompt = jobs[idx[0]][0]
        emb = policy.condition([prompt], h, w)
        for c0 in range(0, len(idx), cfg.batch_size):
            chunk = idx[c0:c0 + cfg.batch_size]
            gens = [torch.Generator().manual_seed(stable_seed(cfg.seed, "final", pid, jobs[i][1])) for i in chunk]
            batch = policy.generate(emb.select([0] * len(chunk)), height=h, width=w, num_steps=cfg.num_steps,
                                    sde=ODE, sde_indices=[], noise_generators=gens)
            for i, im in zip(chunk, policy.decode(batch.final_latents, h, w), strict=True):
                out[i] = im
    return out  # type: ignore[return-value]


def sample_size(height: int, width: int, resolution: int | str, multiple: int = 16) -> tuple[int, int]:
    """The ``(height, width)`` px at which an item of ``height x width`` px is sampled.

    Args:
        height, width: the item's size in px (a T2IS case's grid, an edit's input image), >= 1.
        resolution: a number: the same aspect with area ``resolution**2``
            (:func:`paco.grpo.policies.grid_size`; at 1024 a 1024 x 2048 2x4 case is 720 x 1456,
            360 x 364 px panels); ``"native"``: the item's own size, each side rounded to the nearest
            multiple of ``multiple`` (``max(multiple, round(side / multiple) * multiple)``, Python's
            ``round``, the rounding of ``grid_size`` at scale 1). T2IS-Bench's grids (512 px panels,
            512 x 1024 to 1024 x 2048) are multiples of 16 and stay exact.
        multiple: the policy's size multiple (:attr:`paco.grpo.policies.Policy.size_multiple`,
            16 for FLUX and Qwen-Image).

    Raises:
        ValueError: a side < 1, or a string other than ``"native"``.
    """
    if height < 1 or width < 1:
        raise ValueError(f"item size must be positive, got {height}x{width}")
    if isinstance(resolution, str):
        if resolution != "native":
            raise ValueError(f"resolution must be a number of px or 'native', got {resolution!r}")
        return (max(multiple, int(round(height / multiple)) * multiple),
                max(multiple, int(round(width / multiple)) * multiple))
    return grid_size(height, width, resolution, multiple)


def contact_sheet(images: Sequence[Image.Image], labels: Sequence[str], *, columns: int = 4,
                  thumb: int = 256, title: str = "") -> Image.Image:
    """A PNG-able grid of thumbnails (each scaled to a longest side of ``thumb`` px), each
    captioned with its label."""
    cols = max(1, min(columns, len(images)))
    rows = max(1, -(-len(images) // cols))
    cap, pad, head = 14, 6, 18 if title else 0
    sheet = Image.new("RGB", (cols * (thumb + pad) + pad, head + rows * (thumb + cap + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.text((pad, 3), title, fill="black")
    for k, (im, label) in enumerate(zip(images, labels, strict=True)):
        t = ImageOps.contain(im, (thumb, thumb))  # up or down to the cell, aspect kept
        x = pad + (k % cols) * (thumb + pad)
        y = head + pad + (k // cols) * (thumb + cap + pad)
        sheet.paste(t, (x + (thumb - t.width) // 2, y + (thumb - t.height) // 2))
        draw.text((x, y + thumb + 1), label[:40], fill="black")
    return sheet


def final_samples(cfg: FinalSamplesParams, prompts: pd.DataFrame, policy_dir: str | Path, lora_dir: str | Path,
                  ctx: RewardContext, *, independent: Any = None, rank: int = 0, world: int = 1,
                  accelerator: Any = None) -> tuple[pd.DataFrame, dict[str, Image.Image], dict[str, Any]]:
    """Sample, cut and score the ``cfg.split`` prompts (every one for ``all``; ``cfg.dataset``:
    ``prompts.parquet`` or ``edits.parquet`` rows) at :func:`sample_size` with and without the LoRA,
    and measure them with the reward-hacking monitors (:func:`paco.grpo.monitors.sample_monitors`
    at the policy's latent patch period) and, with ``independent``, the judge rewards of
    ``cfg.rewards`` again with that judge.

    Args:
        independent: a judge the run did not optimise (anything with ``score(triples)``, e.g. the
            base judge's :class:`paco.judge.model.Judge`), or ``None``.

    Returns:
        ``(samples, sheets, metrics)``: the ``samples.parquet`` rows (``SAMPLE_COLUMNS`` plus
        ``reward_<name>``, ``monitor_<name>`` and, with ``independent``, ``independent_<reward>``;
        ``image``/``panels`` are image cells), one contact sheet per variant (and ``compare``:
        input | base | LoRA, for edits), and the metrics (:func:`summarise`).

    Raises:
        ValueError: no prompt in the split. paco.grpo.rewards.RewardError /
            paco.serving.judge_client.JudgeError: a reward failed.
            paco.grpo.policies.lora_io.LoraLoadError: ``lora_dir`` holds no LoRA of a known layout,
            or one the transformer takes only in part.
    """
    items, by_id = subtask_items(prompts, cfg.dataset)
    chosen = items if cfg.split == "all" else items[items["split"].astype(str) == cfg.split]
    chosen = chosen.sort_values("prompt_id")
    if chosen.empty:
        raise ValueError(f"no prompts in split {cfg.split!r}")
    infos = [by_id[str(pid)] for pid in chosen["prompt_id"]]
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    dtype = torch.bfloat16 if (cfg.dtype == "bfloat16" and device.type == "cuda") else torch.float32
    policy = load_policy(cfg.family, policy_dir, None, cfg, dtype=dtype, device=device)
    ctx.connect()  # a pending judge (make_reward_context(connect=False)): its server started while the policy loaded
    ctx.latent_period = policy.size_multiple  # what the grid_free reward measures
    jobs = [(p, k, sample_size(int(r["height"]), int(r["width"]), cfg.resolution, policy.size_multiple))
            for p, r in zip(infos, chosen.to_dict("records"), strict=True) for k in range(cfg.seeds_per_prompt)]
    mine = list(range(rank, len(jobs), world))
    my_jobs = [jobs[i] for i in mine]
    my_infos = [j[0] for j in my_jobs]
    generated: dict[str, tuple[list[Image.Image], dict[str, np.ndarray]]] = {}
    # the served rewards (the judge) of the base samples are scored while the LoRA samples are made
    overlap = OverlappedRewards(list(cfg.rewards), ctx)
    local = [n for n in cfg.rewards if n not in overlap.names]  # scored here, beside the worker thread
    judged = [n for n in cfg.rewards if n in SERVED_REWARDS]  # the judge rewards the independent judge scores
    try:
        for variant in VARIANTS:
            if variant == "lora":
                from diffusers.utils import logging as df_logging

                level = df_logging.get_verbosity()
                df_logging.set_verbosity_error()  # "no LoRA keys for the text encoder": there are none by design
                try:
                    load_lora(policy.pipe, lora_dir)  # diffusers or PEFT layout, loaded in full
                finally:
                    df_logging.set_verbosity(level)
            images = _generate(policy, my_jobs, cfg)
            overlap.submit(images, my_infos)
            scores = compute_rewards(local, images, my_infos, ctx) if local else {}
            scores.update({f"monitor_{k}": v for k, v in
                           sample_monitors(images, my_infos, ctx, period=policy.size_multiple).items()})
            if independent is not None and judged:
                scores.update({f"independent_{k}": v for k, v in compute_rewards(
                    judged, images, my_infos, replace(ctx, judge=independent, pending_judge=None)).items()})
            generated[variant] = (images, scores)
        served = overlap.collect()  # base then LoRA, in submission order
    finally:
        overlap.close()
    rows: list[dict[str, Any]] = []
    for v, variant in enumerate(VARIANTS):
        images, rewards = generated[variant]
        rewards = {**rewards, **{n: x[v * len(images):(v + 1) * len(images)] for n, x in served.items()}}
        for n, (i, (p, k, (h, w)), im) in enumerate(zip(mine, my_jobs, images, strict=True)):
            boxes = ctx.panel_boxes(im, p)
            panels = crop_panels(im, boxes)
            sid = f"{p.prompt_id}-s{k}-{variant}"
            rows.append({
                "order": (VARIANTS.index(variant), i), "sample_id": sid, "prompt_id": p.prompt_id, "seed": k,
                "variant": variant, "height": h, "width": w, "image": encode_image(im, path=f"{sid}.png"),
                "panels": [encode_image(c, path=f"{sid}-p{j}.png") for j, c in enumerate(panels)],
                "bboxes": [list(map(int, b)) for b in boxes],
                **{f"reward_{name}": float(rewards[name][n]) for name in cfg.rewards},
                **{k: float(v[n]) for k, v in rewards.items() if k.startswith(("monitor_", "independent_"))},
                "_pil": im,
            })
    from paco.core.distributed import gather_objects

    rows = gather_objects(accelerator, rows)
    rows.sort(key=lambda r: r["order"])
    table = pd.DataFrame([{k: v for k, v in r.items() if k not in ("order", "_pil")} for r in rows])
    return table, _sheets(rows, infos, cfg), summarise(table, cfg.rewards)


def _sheets(rows: Sequence[dict[str, Any]], infos: Sequence[SubtaskItem], cfg: FinalSamplesParams
            ) -> dict[str, Image.Image]:
    """One contact sheet per variant, and for edits ``compare``: input | base | LoRA triplets."""
    sheets = {}
    for variant in VARIANTS:
        vr = [r for r in rows if r["variant"] == variant]
        sheets[variant] = contact_sheet([r["_pil"] for r in vr], [f"{r['prompt_id']} s{r['seed']}" for r in vr],
                                        title=f"{variant}: {len(vr)} samples, {cfg.num_steps} ODE steps")
    if cfg.dataset == "edits":
        base = [r for r in rows if r["variant"] == "base"]
        lora = {(r["prompt_id"], r["seed"]): r for r in rows if r["variant"] == "lora"}
        ref = {p.prompt_id: p.reference for p in infos}
        triplets, labels = [], []
        for r in base:
            triplets += [ref[r["prompt_id"]], r["_pil"], lora[(r["prompt_id"], r["seed"])]["_pil"]]
            labels += [f"{r['prompt_id']} input", "base", "LoRA"]
        sheets["compare"] = contact_sheet(triplets, labels, columns=3, title="input | base | LoRA")
    return sheets


def _paired(base: np.ndarray, lora: np.ndarray, *, higher: str) -> dict[str, Any] | None:
    """Over the pairs where both values are finite (a monitor is NaN where a panel is too small
    for it): their count ``pairs``, mean and std per variant, the mean LoRA - base difference, the
    fraction of pairs where the LoRA's value is higher (under the key ``higher``) and the
    two-sided paired t-test's p-value (omitted for fewer than two pairs or no difference);
    ``None`` without a finite pair."""
    keep = np.isfinite(base) & np.isfinite(lora)
    if not keep.any():
        return None
    base, lora = base[keep], lora[keep]
    d = lora - base
    entry = {"pairs": int(keep.sum()), "base_mean": float(base.mean()), "base_std": float(base.std()),
             "lora_mean": float(lora.mean()), "lora_std": float(lora.std()), "lora_minus_base": float(d.mean()),
             higher: float((d > 0).mean())}
    if len(d) > 1 and np.any(d != 0):
        entry["paired_t_p_value"] = paired_t_p(lora, base)
    return entry


def summarise(table: pd.DataFrame, rewards: Sequence[str]) -> dict[str, Any]:
    """The final samples' comparison, base against LoRA paired by ``(prompt_id, seed)``.

    Returns:
        ``samples``, ``prompts``; ``rewards``: per reward mean/std per variant, ``lora_minus_base``,
        ``improved_fraction`` and ``paired_t_p_value`` (two-sided ``scipy.stats.ttest_rel``);
        ``monitors``: the same for every ``monitor_<name>`` column (``lora_higher_fraction``);
        ``independent``: the same for every ``independent_<reward>`` column; ``hacking_gap``: per
        such reward, ``optimised_gain`` (the LoRA - base gain under the run's judge),
        ``independent_gain`` (under the independent judge), ``gap`` = their difference (in the
        reward's units: both judges score the same formula) and ``paired_t_p_value``, the
        two-sided paired t-test of the per-sample gains under the two judges.
    """
    out: dict[str, Any] = {"samples": int(len(table)), "prompts": int(table["prompt_id"].nunique()), "rewards": {}}
    base = table[table["variant"] == "base"].set_index(["prompt_id", "seed"])
    lora = table[table["variant"] == "lora"].set_index(["prompt_id", "seed"]).loc[base.index]

    def pair(col: str) -> tuple[np.ndarray, np.ndarray]:
        return base[col].to_numpy(dtype=np.float64), lora[col].to_numpy(dtype=np.float64)

    for name in rewards:
        out["rewards"][name] = _paired(*pair(f"reward_{name}"), higher="improved_fraction")
    monitors = {m: _paired(*pair(f"monitor_{m}"), higher="lora_higher_fraction")
                for m in MONITORS if f"monitor_{m}" in table}
    out["monitors"] = {m: v for m, v in monitors.items() if v is not None}
    out["independent"], out["hacking_gap"] = {}, {}
    for name in rewards:
        if f"independent_{name}" not in table:
            continue
        out["independent"][name] = _paired(*pair(f"independent_{name}"), higher="improved_fraction")
        b, lo = pair(f"reward_{name}")
        ib, ilo = pair(f"independent_{name}")
        gap = {"optimised_gain": float((lo - b).mean()), "independent_gain": float((ilo - ib).mean())}
        gap["gap"] = gap["optimised_gain"] - gap["independent_gain"]
        if len(b) > 1 and np.any((lo - b) != (ilo - ib)):
            gap["paired_t_p_value"] = paired_t_p(lo - b, ilo - ib)
        out["hacking_gap"][name] = gap
    return out


def final_warnings(metrics: dict[str, Any], where: str) -> list[str]:
    """:func:`paco.grpo.monitors.monitor_warnings` of the LoRA samples' monitor means against the
    base samples', and a line when a hacking gap is positive with a paired p-value below 0.05."""
    mons = metrics.get("monitors", {})
    lines = monitor_warnings({k: v["lora_mean"] for k, v in mons.items()},
                             {k: v["base_mean"] for k, v in mons.items()}, where=f"{where}, LoRA vs base")
    for name, g in metrics.get("hacking_gap", {}).items():
        if g["gap"] > 0 and g.get("paired_t_p_value", 1.0) < 0.05:
            lines.append(f"hacking gap of {name}: the LoRA gains {g['optimised_gain']:+.4f} under the run's judge and "
                         f"{g['independent_gain']:+.4f} under the independent judge (gap {g['gap']:+.4f}, paired p "
                         f"{g['paired_t_p_value']:.2g}): {where}; a sign of reward hacking (paco.grpo.monitors)")
    return lines
