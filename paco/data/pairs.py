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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from paco.core.io import ArtifactError, dataset_path, iter_text_lines

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


_FILE = re.compile(r"^([0-9]{1,18})_([0-9]{1,18})\.\w+$")

#: The keys of a ConsistencyRank-Bench record.
ANNOTATION_KEYS = ("folder", "ref_image", "comp_images", "rank_images")


def _annotation_file(path: Path) -> Path:
    """The annotation file ``path`` names: itself, or ``consistency_full_rank.jsonl`` inside a
    directory (a regular file inside it, symlinks followed: the directory is the declared
    dependency)."""
    if path.is_dir():
        return dataset_path(path, "consistency_full_rank.jsonl", what=f"{path}: annotation file")
    if not path.is_file():
        raise ArtifactError(f"{path}: no annotation file")
    return path


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an integer past the digit limit, deep nesting
        raise ArtifactError(f"{where}: invalid JSON ({exc})") from None


def _check_record(rec: Any, where: str) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise ArtifactError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    missing = [k for k in ANNOTATION_KEYS if k not in rec]
    if missing:
        raise ArtifactError(f"{where}: record lacks keys {missing} (needs {list(ANNOTATION_KEYS)})")
    folder = rec["folder"]
    if isinstance(folder, bool) or not isinstance(folder, (str, int)) or not str(folder).strip():
        raise ArtifactError(f"{where}: field 'folder' must be a prompt_id string or an integer idx, "
                            f"got {type(folder).__name__} {folder!r}")
    if not isinstance(rec["ref_image"], str):
        raise ArtifactError(f"{where}: field 'ref_image' must be an image file name string, "
                            f"got {type(rec['ref_image']).__name__} {rec['ref_image']!r}")
    for key in ("comp_images", "rank_images"):
        v = rec[key]
        if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
            raise ArtifactError(f"{where}: field {key!r} must be a non-empty list of image file name strings, got {v!r}")
    if sorted(rec["comp_images"]) != sorted(rec["rank_images"]):
        raise ArtifactError(f"{where}: rank_images is not a permutation of comp_images")
    return rec


def read_annotation_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Read ConsistencyRank-Bench rankings with where each record is: a ``.jsonl`` file (UTF-8,
    a leading byte-order mark ignored, blank lines skipped), a ``.json`` list, or a directory
    holding ``consistency_full_rank.jsonl``.

    Returns:
        ``(where, record)`` per record: ``where`` is ``"<file>:<line>"`` (1-based, the file's
        real line) for jsonl, ``"<file> record <n>"`` (1-based) for a ``.json`` list.

    Raises:
        ArtifactError: no such file (or, in a directory, one that leads outside it), a line that
            is not UTF-8 or JSON, a record that is not an object, lacks a key, has a field of the
            wrong type (``folder``: str or int; ``ref_image``: str; ``comp_images`` and
            ``rank_images``: non-empty lists of str), or whose ``rank_images`` is not a
            permutation of ``comp_images``. Every message names the file and line (or record).
    """
    path = _annotation_file(Path(path))
    out: list[tuple[str, dict[str, Any]]] = []
    if path.suffix == ".json":
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ArtifactError(f"{path}: not UTF-8 ({exc})") from None
        records = _parse_json(text, str(path))
        if not isinstance(records, list):
            raise ArtifactError(f"{path}: a .json annotation file must hold a list of records")
        for n, rec in enumerate(records, 1):
            out.append((f"{path} record {n}", _check_record(rec, f"{path} record {n}")))
        return out
    for n, text, err in iter_text_lines(path):
        where = f"{path}:{n}"
        if err is not None:
            raise ArtifactError(f"{where}: {err}")
        if text.strip():
            out.append((where, _check_record(_parse_json(text, where), where)))
    return out


def read_annotations(path: str | Path) -> list[dict[str, Any]]:
    """The records of :func:`read_annotation_records`, without where they are.

    Raises:
        ArtifactError: as :func:`read_annotation_records` (names the line).
    """
    return [rec for _, rec in read_annotation_records(path)]


@dataclass
class AnnotationMatch:
    """What :func:`match_annotations` made of the records.

    Attributes:
        rankings: ``{(ref_panel_id, candidate_panel_ids in seed order): ranking}``.
        duplicates: ``{"record", "same_as", "instance"}`` per record that repeats an earlier
            one's instance and ranking (kept once).
    """

    rankings: dict[tuple[str, tuple[str, ...]], list[str]] = field(default_factory=dict)
    duplicates: list[dict[str, str]] = field(default_factory=list)


class _Panels:
    """The panel table, indexed for matching annotation records."""

    def __init__(self, panels: pd.DataFrame):
        self.by_key = {(r.prompt_id, int(r.seed), int(r.index)): r.panel_id for r in panels.itertuples(index=False)}
        self.prompt_ids = set(panels["prompt_id"])
        self.seed_of = dict(zip(panels["panel_id"], panels["seed"].astype(int), strict=True))
        self.index_of = dict(zip(panels["panel_id"], panels["index"].astype(int), strict=True))
        self.seeds = {pid: sorted(int(s) for s in g.unique()) for pid, g in panels.groupby("prompt_id")["seed"]}

    def prompt(self, folder: Any, where: str) -> str:
        folder = str(folder)
        if folder in self.prompt_ids:
            return folder
        prompt_id = f"t2is-{int(folder):04d}" if folder.isascii() and folder.isdigit() else folder
        if prompt_id not in self.prompt_ids:
            raise ArtifactError(f"{where}: folder {folder!r} matches no prompt_id")
        return prompt_id

    def panel(self, name: str, prompt_id: str, where: str) -> str:
        m = _FILE.match(name)
        if not m or (prompt_id, int(m[1]), int(m[2])) not in self.by_key:
            raise ArtifactError(f"{where}: image {name!r} of {prompt_id} matches no panel")
        return self.by_key[(prompt_id, int(m[1]), int(m[2]))]


def _instance_of(rec: dict[str, Any], idx: _Panels, where: str) -> tuple[tuple[str, tuple[str, ...]], list[str]]:
    """The instance key a record annotates, and its ranking (panel ids)."""
    prompt_id = idx.prompt(rec["folder"], where)
    ref = idx.panel(rec["ref_image"], prompt_id, where)
    comps = [idx.panel(c, prompt_id, where) for c in rec["comp_images"]]
    repeated = sorted({c for c, p in zip(rec["comp_images"], comps) if comps.count(p) > 1})
    if repeated:
        raise ArtifactError(f"{where}: comp_images repeats image(s) {repeated}: an instance's candidates are "
                            "distinct panels")
    positions = sorted({idx.index_of[c] for c in comps})
    if len(positions) != 1:
        raise ArtifactError(f"{where}: comp_images are at panel positions {positions}: an instance's candidates "
                            "share one position")
    if positions[0] == idx.index_of[ref]:
        raise ArtifactError(f"{where}: comp_images are at the reference's own position {positions[0]}: an "
                            "instance's candidates are at another position")
    seeds = idx.seeds[prompt_id]
    if sorted(idx.seed_of[c] for c in comps) != seeds:
        raise ArtifactError(
            f"{where}: {len(comps)} candidates, but prompt {prompt_id} has {len(seeds)} composites (seeds {seeds}): "
            "an instance has one candidate from each"
        )
    cands = tuple(sorted(comps, key=idx.seed_of.__getitem__))
    return (ref, cands), [idx.panel(c, prompt_id, where) for c in rec["rank_images"]]


def match_annotations(records: Sequence[tuple[str, dict[str, Any]]], panels: pd.DataFrame) -> AnnotationMatch:
    """Map located annotation records (:func:`read_annotation_records`) onto ranking instances.

    ``folder`` names the prompt (a prompt_id, or the integer ``idx`` of a ``t2is-%04d`` id);
    an image file ``<k>_<q>.png`` is panel ``q`` (row-major) of the prompt's composite with seed
    ``k``. A record must annotate one ranking instance of :func:`build_instances`: a reference
    panel, and as candidates the panels at one other position from every composite of the
    prompt, each once.

    Returns:
        The rankings and the repeated records (:class:`AnnotationMatch`).

    Raises:
        ArtifactError: a record that names a prompt or a panel not in the panel table, or that
            matches no instance (candidates repeated, at several positions or at the
            reference's, or not one per composite); two records that rank the same instance
            differently (both named). Every message names the record's file and line.
    """
    idx = _Panels(panels)
    out = AnnotationMatch()
    first: dict[tuple[str, tuple[str, ...]], str] = {}
    for where, rec in records:
        key, ranking = _instance_of(_check_record(rec, where), idx, where)
        if key in first:
            if out.rankings[key] != ranking:
                raise ArtifactError(f"{first[key]} and {where} rank the same instance differently (reference "
                                    f"{key[0]}: {out.rankings[key]} vs {ranking})")
            out.duplicates.append({"record": where, "same_as": first[key], "instance": key[0]})
            continue
        first[key] = where
        out.rankings[key] = ranking
    return out


def annotation_rankings(records: Sequence[dict[str, Any]], panels: pd.DataFrame) -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """The rankings of :func:`match_annotations` for records without locations (named
    ``annotation <n>``, 1-based).

    Returns:
        ``{(ref_panel_id, candidate_panel_ids in seed order): ranking}``.

    Raises:
        ArtifactError: as :func:`match_annotations`.
    """
    return match_annotations([(f"annotation {n}", r) for n, r in enumerate(records, 1)], panels).rankings


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
