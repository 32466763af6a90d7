"""Ranking instances and Yes/No pairs for PaCo-Reward (paper §3.1).

A *ranking instance* is a reference panel (composite i, position j) and, as candidates, the
panels at one other position y taken from every composite of the same prompt (one per seed, in
seed order). With 4 composites of 2x2 panels a prompt gives 4 x 4 x 3 = 48 instances. The
candidates are ranked from most to least consistent with the reference by one of:

- ``ground_truth``: the ``photos`` source's drift levels; rank by ``|level_ref - level_cand|``
  ascending (tie-free for Golomb-ruler levels, see ``PhotosParams``);
- ``annotations``: imported human rankings in the ConsistencyRank-Bench format
  (``{"folder", "ref_image", "comp_images": [4], "rank_images": [4]}``, file names
  ``<seed>_<panel index>.png`` inside the prompt's folder, as in the released benchmark);
- ``auto``: CLIP-I cosine similarity between reference and candidate embeddings, descending.

Each instance yields two training pairs: (reference, rank-1 candidate) labelled Yes and
(reference, last-ranked candidate) labelled No. Splits are inherited from the prompt, so no
prompt is on both sides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from paco.core.io import ArtifactError

INSTANCE_COLUMNS = [
    "instance_id", "prompt_id", "split", "ref_panel_id", "ref_index", "candidate_index",
    "candidate_panel_ids", "ranking", "source",
]
PAIR_COLUMNS = ["pair_id", "instance_id", "prompt_id", "split", "panel_a", "panel_b", "label", "source"]

#: ranker(ref_panel_id, candidate_panel_ids) -> candidate ids from most to least consistent
Ranker = Callable[[str, list[str]], list[str]]


def build_instances(panels: pd.DataFrame, candidates: int = 4) -> pd.DataFrame:
    """Enumerate ranking instances (without rankings) from the panel table.

    Args:
        panels: ``panels.parquet`` rows (panel_id, prompt_id, seed, index).
        candidates: the number of composites every prompt must have (one candidate each).

    Returns:
        One row per instance: instance_id (``<ref_panel_id>-y<candidate_index>``), prompt_id,
        ref_panel_id, ref_index, candidate_index, candidate_panel_ids (seed order).

    Raises:
        ArtifactError: a prompt has a number of composites other than ``candidates``, or its
            composites do not all have the same panel count.
    """
    rows: list[dict[str, Any]] = []
    for prompt_id, group in panels.groupby("prompt_id", sort=True):
        seeds = sorted(group["seed"].unique())
        if len(seeds) != candidates:
            raise ArtifactError(
                f"prompt {prompt_id}: {len(seeds)} composites (seeds {seeds}), but each ranking "
                f"instance needs exactly {candidates} candidates (pairs.candidates)"
            )
        grid = {(int(r.seed), int(r.index)): r.panel_id for r in group.itertuples(index=False)}
        counts = group.groupby("seed")["index"].nunique()
        if counts.nunique() != 1:
            raise ArtifactError(f"prompt {prompt_id}: composites have different panel counts {counts.to_dict()}")
        n_panels = int(counts.iloc[0])
        for seed in seeds:
            for j in range(n_panels):
                ref = grid[(seed, j)]
                for y in range(n_panels):
                    if y == j:
                        continue
                    rows.append(
                        {
                            "instance_id": f"{ref}-y{y}",
                            "prompt_id": prompt_id,
                            "ref_panel_id": ref,
                            "ref_index": j,
                            "candidate_index": y,
                            "candidate_panel_ids": [grid[(s, y)] for s in seeds],
                        }
                    )
    return pd.DataFrame.from_records(
        rows, columns=["instance_id", "prompt_id", "ref_panel_id", "ref_index", "candidate_index", "candidate_panel_ids"]
    )


def ground_truth_ranker(panels: pd.DataFrame) -> Ranker:
    """Rank by drift-level distance ``|level_ref - level_cand|`` (ascending).

    Raises:
        ArtifactError: a panel has no level (the composites were not made by the ``photos``
            source), or two candidates tie (levels that are not a Golomb ruler).
    """
    if "level" not in panels.columns or panels["level"].isna().any():
        missing = panels.loc[panels["level"].isna(), "panel_id"].head(3).tolist() if "level" in panels else []
        raise ArtifactError(
            "ranking: ground_truth needs drift levels on every panel (composites.source: photos); "
            f"missing for e.g. {missing}"
        )
    level = dict(zip(panels["panel_id"], panels["level"].astype(int), strict=True))

    def rank(ref: str, cands: list[str]) -> list[str]:
        dist = [abs(level[ref] - level[c]) for c in cands]
        if len(set(dist)) != len(dist):
            raise ArtifactError(f"reference {ref}: tied level distances {dist} for {cands}")
        return [c for _, c in sorted(zip(dist, cands, strict=True))]

    return rank


def similarity_ranker(embeddings: dict[str, np.ndarray]) -> Ranker:
    """Rank by cosine similarity of L2-normalised embeddings (descending), e.g. CLIP-I.

    Ties (identical scores) keep candidate order, which is the seed order.
    """

    def rank(ref: str, cands: list[str]) -> list[str]:
        sims = np.array([float(embeddings[ref] @ embeddings[c]) for c in cands])
        if not np.all(np.isfinite(sims)):
            raise ArtifactError(f"reference {ref}: non-finite similarity {sims.tolist()}")
        order = np.argsort(-sims, kind="stable")
        return [cands[i] for i in order]

    return rank


_FILE = re.compile(r"^(\d+)_(\d+)\.\w+$")


def read_annotations(path: str | Path) -> list[dict[str, Any]]:
    """Read ConsistencyRank-Bench rankings: a ``.jsonl`` file, a ``.json`` list, or a directory
    holding ``consistency_full_rank.jsonl``.

    Raises:
        ArtifactError: unreadable file or a malformed record (names the line).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "consistency_full_rank.jsonl"
    if not path.is_file():
        raise ArtifactError(f"{path}: no annotation file")
    text = path.read_text()
    try:
        records = json.loads(text) if path.suffix == ".json" else [
            json.loads(line) for line in text.splitlines() if line.strip()
        ]
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: invalid JSON ({exc})") from exc
    for n, rec in enumerate(records, 1):
        keys = {"folder", "ref_image", "comp_images", "rank_images"}
        if not isinstance(rec, dict) or not keys <= rec.keys():
            raise ArtifactError(f"{path}: record {n} lacks keys {sorted(keys)}")
        if sorted(rec["comp_images"]) != sorted(rec["rank_images"]):
            raise ArtifactError(f"{path}: record {n}: rank_images is not a permutation of comp_images")
    return records


def annotation_rankings(records: Sequence[dict[str, Any]], panels: pd.DataFrame) -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """Map annotation records onto panel IDs.

    ``folder`` names the prompt (a prompt_id, or the integer ``idx`` of a ``t2is-%04d`` id);
    an image file ``<k>_<q>.png`` is panel ``q`` (row-major) of the prompt's composite with seed
    ``k``.

    Returns:
        ``{(ref_panel_id, candidate_panel_ids in seed order): ranking}``.

    Raises:
        ArtifactError: a record names a prompt or a panel that is not in the panel table.
    """
    by_key = {(r.prompt_id, int(r.seed), int(r.index)): r.panel_id for r in panels.itertuples(index=False)}
    prompt_ids = set(panels["prompt_id"])
    seed_of = dict(zip(panels["panel_id"], panels["seed"].astype(int), strict=True))
    out: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for n, rec in enumerate(records, 1):
        folder = str(rec["folder"])
        prompt_id = folder if folder in prompt_ids else (f"t2is-{int(folder):04d}" if folder.isdigit() else folder)
        if prompt_id not in prompt_ids:
            raise ArtifactError(f"annotation {n}: folder {folder!r} matches no prompt_id")

        def pid(name: str, n: int = n, prompt_id: str = prompt_id) -> str:
            m = _FILE.match(name)
            if not m or (prompt_id, int(m[1]), int(m[2])) not in by_key:
                raise ArtifactError(f"annotation {n}: image {name!r} of {prompt_id} matches no panel")
            return by_key[(prompt_id, int(m[1]), int(m[2]))]

        ref = pid(rec["ref_image"])
        cands = sorted((pid(c) for c in rec["comp_images"]), key=seed_of.__getitem__)
        out[(ref, tuple(cands))] = [pid(c) for c in rec["rank_images"]]
    return out


def annotation_ranker(rankings: dict[tuple[str, tuple[str, ...]], list[str]]) -> Ranker:
    """Look rankings up; an instance without an annotation raises (counted by the caller)."""

    def rank(ref: str, cands: list[str]) -> list[str]:
        try:
            return rankings[(ref, tuple(cands))]
        except KeyError:
            raise KeyError(ref) from None

    return rank


def rank_instances(
    instances: pd.DataFrame, ranker: Ranker, source: str, split_of: dict[str, str]
) -> tuple[pd.DataFrame, int]:
    """Attach rankings and splits; returns ``(ranked instances, number left unannotated)``.

    Only an ``annotations`` ranker may leave instances out (a benchmark annotates a subset);
    that count is returned for the stage's metrics, never dropped silently.
    """
    ranked, unannotated = [], 0
    for inst in instances.to_dict("records"):
        try:
            inst["ranking"] = ranker(inst["ref_panel_id"], list(inst["candidate_panel_ids"]))
        except KeyError:
            unannotated += 1
            continue
        inst["source"] = source
        inst["split"] = split_of[inst["prompt_id"]]
        ranked.append(inst)
    return pd.DataFrame.from_records(ranked, columns=INSTANCE_COLUMNS), unannotated


def make_pairs(instances: pd.DataFrame) -> pd.DataFrame:
    """Two pairs per ranked instance: (ref, rank-1) -> Yes, (ref, last rank) -> No (paper §3.1)."""
    rows = []
    for inst in instances.itertuples(index=False):
        for label, cand in ((True, inst.ranking[0]), (False, inst.ranking[-1])):
            rows.append(
                {
                    "pair_id": f"{inst.instance_id}-{'yes' if label else 'no'}",
                    "instance_id": inst.instance_id,
                    "prompt_id": inst.prompt_id,
                    "split": inst.split,
                    "panel_a": inst.ref_panel_id,
                    "panel_b": cand,
                    "label": label,
                    "source": inst.source,
                }
            )
    return pd.DataFrame.from_records(rows, columns=PAIR_COLUMNS)
