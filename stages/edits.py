"""Stage ``edits``: the editing subtasks' items -> ``edits.parquet`` (input image, instruction, split).

``edits.source: photos`` (embedded default) edits the shipped photographs with instructions
whose correct result is computed (``target_image``), split by photograph; ``import`` reads the
GEdit-Bench layout (``--import-path``: Parquet or jsonl + images) and splits it as the
reference's ``preprocess.py`` (:mod:`paco.data.edits`). Metrics: item counts per split and task
type, every skipped row (``strict: false``) and the rows left out by ``edits.import.languages``
per language (``skipped_by_language``); a malformed row with ``strict: true`` fails the stage
naming the file, the row and the reason (exit code 2). ``input_image`` and ``target_image`` are
``datasets`` Image columns (``target_image`` null for imported items).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paco.core.io import write_parquet
from paco.core.params import Params, ParamsError
from paco.core.stage import StageOutput, log, run
from paco.data import edits as E


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import-path", type=Path, default=None, help="GEdit-Bench .parquet or .jsonl (source import)")
    p.add_argument("--out", type=Path, required=True, help="edits.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    cfg = params.edits
    skipped: list[dict[str, str]] = []
    by_language: dict[str, int] = {}
    if cfg.source == "photos":
        ph = cfg.photos
        try:
            df = E.photo_edits(list(ph.subjects), list(ph.operations), ph.size, ph.test_photos, cfg.seed)
        except ValueError as exc:  # unknown names or an impossible split: the params are wrong
            raise ParamsError(f"params.yaml: edits.photos: {exc}") from None
    else:
        im = cfg.import_
        res = E.import_gedit(args.import_path or im.path, languages=im.languages, test_items=im.test_items,
                             split_seed=im.split_seed, strict=cfg.strict, max_pixels=im.max_pixels)
        df, skipped, by_language = res.table, res.skipped, res.skipped_by_language
        for row in skipped:
            log.warning("skipped %s", row["reason"])
        if by_language:
            log.info("left out by edits.import.languages %s: %s", im.languages, by_language)
    write_parquet(args.out, df, image_columns=E.EDIT_IMAGE_COLUMNS)
    log.info("wrote %d editing items (%d skipped) to %s", len(df), len(skipped), args.out)
    return StageOutput.headline({
        "items": len(df),
        "skipped_rows": len(skipped),
        "skipped": skipped,
        "skipped_by_language": by_language,
        "per_split": df["split"].value_counts().sort_index().to_dict(),
        "per_task_type": df["task_type"].value_counts().sort_index().to_dict(),
    }, "items", "skipped_rows")


def main(argv: list[str] | None = None) -> int:
    return run("edits", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
