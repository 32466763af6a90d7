"""Stage ``subfigures``: cut every composite into its panels -> ``panels.parquet``.

The layout (rows x cols) comes from ``prompts.parquet``; boxes from
:func:`paco.data.subfigures.split_grid` (``subfigures.method``: ``refine`` snaps cuts to separator
bands and trims borders, ``equal`` is the reference implementation's equal split). When the
composites carry their true panel boxes (the ``photos`` source does), the stage reports the mean
and minimum IoU of the extracted boxes against them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from paco.core.io import read_parquet, write_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run
from paco.data.panels import extract_panels


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--composites", type=Path, required=True, help="composites.parquet")
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet (layouts)")
    p.add_argument("--out", type=Path, required=True, help="panels.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    cfg = params.subfigures
    composites = read_parquet(args.composites, required=["composite_id", "prompt_id", "seed", "image"])
    prompts = read_parquet(args.prompts, required=["prompt_id", "rows", "cols"])
    panels, report = extract_panels(
        composites,
        prompts,
        method=cfg.method,
        tolerance=cfg.tolerance,
        strict=cfg.strict,
        progress=lambda it: tqdm(it, total=len(composites), desc="subfigures", unit="composite"),
    )
    for row in report["skipped"]:
        log.warning("skipped composite %s: %s", row["composite_id"], row["reason"])
    write_parquet(args.out, panels, image_columns=["image"])
    log.info("wrote %d panels from %d composites to %s", len(panels), len(composites), args.out)
    return StageOutput.headline(report, "panels", "skipped_composites")


def main(argv: list[str] | None = None) -> int:
    return run("subfigures", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
