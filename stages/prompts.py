"""Stage ``prompts``: a T2IS-format jsonl prompt set -> ``prompts.parquet`` with a split by prompt.

Reads ``--jsonl`` (``prompts.jsonl`` in params), parses layouts and panel prompts
(:func:`paco.data.prompts.read_t2is_jsonl`), assigns the train/test split by prompt where the file
does not give one, and writes ``prompts.parquet`` (docs/architecture.md §3) plus metrics: prompt counts per
split, category and layout, every skipped malformed row when ``strict: false``, and the null or
blank criteria that were dropped (``dropped_criteria``). A file with no valid row fails here
(:class:`paco.data.prompts.EmptyPromptSetError`, exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paco.data import prompts as P
from paco.core.io import write_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jsonl", type=Path, required=True, help="T2IS-format prompt file")
    p.add_argument("--out", type=Path, required=True, help="prompts.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    cfg = params.prompts
    res = P.read_t2is_jsonl_report(args.jsonl, strict=cfg.strict)
    df, skipped, dropped = res.table, res.skipped, res.dropped_criteria
    for row in skipped:
        log.warning("skipped malformed row: line %s: %s", row["line"], row["reason"])
    if dropped:
        log.info("dropped %d null or blank criteria (as the reference scorer does): %s", len(dropped),
                 ", ".join(f"{d['prompt_id']} {d['dimension']}/{d['criterion']}" for d in dropped[:10]))
    split = P.assign_split(
        df["prompt_id"].tolist(), cfg.test_fraction, cfg.seed, categories=df["category"].tolist()
    )
    given = df["split"].notna()
    df.loc[~given, "split"] = df.loc[~given, "prompt_id"].map(split)
    write_parquet(args.out, df)
    layouts = (df["rows"].astype(str) + "x" + df["cols"].astype(str)).value_counts()
    log.info("wrote %d prompts (%d skipped) to %s", len(df), len(skipped), args.out)
    return StageOutput.headline({
        "prompts": len(df),
        "skipped_rows": len(skipped),
        "skipped": skipped,
        "dropped_criteria": len(dropped),
        "dropped_criteria_detail": dropped[:50],
        "per_split": df["split"].value_counts().sort_index().to_dict(),
        "per_category": df["category"].value_counts().sort_index().to_dict(),
        "per_layout": layouts.sort_index().to_dict(),
    }, "prompts", "skipped_rows")


def main(argv: list[str] | None = None) -> int:
    return run("prompts", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
