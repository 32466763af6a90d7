"""Stage ``pairs``: ranking instances and Yes/No pairs (paper §3.1).

Reads ``panels.parquet`` and ``prompts.parquet`` (for the split by prompt), ranks each
instance's candidates (``pairs.ranking``: ``ground_truth`` drift levels, ConsistencyRank-Bench
``annotations``, or ``auto`` CLIP-I with the ``clip`` model), and writes
``rank_instances.parquet`` and ``pairs.parquet``. With ``pairs.editing`` it also reads
``edits.parquet`` and writes the editing questions' pairs (:mod:`paco.data.edit_pairs`) to
``edit_pairs.parquet``, which is otherwise written empty.

``annotations`` (:func:`paco.data.pairs.read_annotation_records`): every record must annotate one
ranking instance of the panels (a malformed record, one naming an unknown prompt or panel, or one
whose candidates are not one panel at another position from each composite is an error naming
its line), two records ranking one instance differently are an error naming both, and identical
repeats are kept once and counted in the report (``duplicate_annotations``). Instances without
an annotation are counted (``unannotated_instances``). Nothing is written before every input
is checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import pandas as pd

from paco.data import pairs as P
from paco.data.edit_pairs import EDIT_PAIR_COLUMNS, make_edit_pairs
from paco.core.io import ArtifactError, decode_image, read_parquet, write_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--panels", type=Path, required=True, help="panels.parquet")
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet (split)")
    p.add_argument("--clip", type=Path, required=True, help="clip model directory (auto ranking)")
    p.add_argument("--annotations", type=Path, required=True, help="rankings (annotations ranking)")
    p.add_argument("--instances", type=Path, required=True, help="rank_instances.parquet to write")
    p.add_argument("--pairs", type=Path, required=True, help="pairs.parquet to write")
    p.add_argument("--edits", type=Path, required=True, help="edits.parquet (read with pairs.editing)")
    p.add_argument("--edit-pairs", type=Path, required=True, help="edit_pairs.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _ranker(cfg, args: argparse.Namespace, panels) -> tuple[P.Ranker, dict]:
    """The ranker, and what the report says about its input (the annotation counts)."""
    if cfg.ranking == "ground_truth":
        return P.ground_truth_ranker(panels), {}
    if cfg.ranking == "annotations":
        records = P.read_annotation_records(args.annotations)
        match = P.match_annotations(records, panels)
        if match.duplicates:
            log.warning("%d annotation record(s) repeat an earlier record (same instance and ranking; kept once): %s",
                        len(match.duplicates), ", ".join(d["record"] for d in match.duplicates[:5]))
        return P.annotation_ranker(match.rankings), {
            "annotation_records": len(records),
            "duplicate_annotations": len(match.duplicates),
            "duplicate_annotation_records": match.duplicates[:50],
        }
    from paco.models.clip import ClipScorer  # torch + transformers: import only when used

    scorer = ClipScorer(args.clip)
    images = [decode_image(c, what=f"panel {pid}") for pid, c in zip(panels["panel_id"], panels["image"])]
    emb = scorer.image_embeddings(images, batch_size=cfg.batch_size).numpy().astype(np.float64)
    return P.similarity_ranker(dict(zip(panels["panel_id"], emb, strict=True))), {}


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    cfg = params.pairs
    panels = read_parquet(args.panels, required=["panel_id", "prompt_id", "seed", "index", "image"])
    prompts = read_parquet(args.prompts, required=["prompt_id", "split"])
    split_of = dict(zip(prompts["prompt_id"], prompts["split"], strict=True))
    unknown = sorted(set(panels["prompt_id"]) - split_of.keys())
    if unknown:
        raise ArtifactError(f"panels reference prompt_id(s) missing from prompts: {unknown[:5]}")
    instances = P.build_instances(panels, cfg.candidates)
    ranker, ranker_report = _ranker(cfg, args, panels)
    ranked, unannotated = P.rank_instances(instances, ranker, cfg.ranking, split_of)
    if unannotated:
        log.warning("%d of %d instances have no annotation and are not used", unannotated, len(instances))
    if ranked.empty:
        raise ArtifactError("no ranked instances: nothing to train or evaluate on")
    pairs = P.make_pairs(ranked)
    edit_pairs, no_target = pd.DataFrame(columns=EDIT_PAIR_COLUMNS), 0
    if cfg.editing:
        edits = read_parquet(args.edits, required=["item_id", "split", "subject", "task_type", "instruction",
                                                   "input_image", "target_image"])
        edit_pairs, no_target = make_edit_pairs(edits, seed=cfg.seed, repeats=cfg.editing_repeats)
        if no_target:
            log.info("%d edit items have no target image (an import): no editing pairs from them", no_target)
    write_parquet(args.instances, ranked)
    write_parquet(args.pairs, pairs)
    write_parquet(args.edit_pairs, edit_pairs, image_columns=["image_a", "image_b"])
    log.info("wrote %d instances, %d pairs and %d editing pairs", len(ranked), len(pairs), len(edit_pairs))
    per_prompt = ranked.groupby("prompt_id").size()
    return StageOutput.headline({
        "ranking": cfg.ranking,
        "instances": len(ranked),
        "unannotated_instances": unannotated,
        "instances_per_prompt": {"min": int(per_prompt.min()), "max": int(per_prompt.max())},
        "pairs": len(pairs),
        "per_split": {
            split: {"prompts": int(g["prompt_id"].nunique()), "instances": len(g),
                    "pairs": int((pairs["split"] == split).sum())}
            for split, g in ranked.groupby("split")
        },
        "yes_fraction": float(pairs["label"].mean()),
        "edit_pairs": len(edit_pairs),
        "edit_items_without_target": no_target,
        "edit_pairs_per_split": {s: int(len(g)) for s, g in edit_pairs.groupby("split")},
        **ranker_report,
    }, "instances", "pairs", "edit_pairs")


def main(argv: list[str] | None = None) -> int:
    return run("pairs", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
