"""Stage ``composites``: multi-panel composites per prompt -> ``composites.parquet``.

``composites.source`` picks the source: ``photos`` (real photographs, embedded default),
``generate`` (the ``policy_t2is`` FLUX pipeline, N seeds per prompt) or ``import`` (a folder of
existing composites plus a manifest). See :mod:`paco.composites`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from paco import composites as C
from paco.io import read_parquet, write_parquet
from paco.params import Params
from paco.stage import log, run, seed_everything


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet")
    p.add_argument("--policy", type=Path, required=True, help="policy model directory (generate)")
    p.add_argument("--import-dir", type=Path, required=True, help="folder of composites (import)")
    p.add_argument("--out", type=Path, required=True, help="composites.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> dict:
    cfg = params.composites
    seed_everything(cfg.seed)
    prompts = read_parquet(args.prompts, required=["prompt_id", "prompt", "rows", "cols", "height", "width"])
    skipped: list[dict[str, str]] = []
    if cfg.source == "photos":
        from paco.photos import render_composites

        df = render_composites(prompts, cfg.photos, cfg.seeds_per_prompt, cfg.seed)
    elif cfg.source == "generate":
        from paco.models.loading import load_flux_pipeline

        pipe = load_flux_pipeline(args.policy)
        pipe.set_progress_bar_config(disable=True)
        df = C.generate_composites(
            prompts, pipe, cfg.generate, cfg.seeds_per_prompt, cfg.seed,
            progress=lambda it: tqdm(it, desc="generate", unit="batch"),
        )
    else:
        import_cfg = cfg.import_.model_copy(update={"dir": str(args.import_dir)})
        df, skipped = C.import_composites(import_cfg, set(prompts["prompt_id"]), strict=cfg.strict)
        for row in skipped:
            log.warning("skipped composite %s: %s", row["composite_id"], row["reason"])
    write_parquet(args.out, df, image_columns=["image"])
    log.info("wrote %d composites (%s) to %s", len(df), cfg.source, args.out)
    per_prompt = df.groupby("prompt_id").size()
    return {
        "source": cfg.source,
        "composites": len(df),
        "prompts": int(df["prompt_id"].nunique()),
        "composites_per_prompt": {"min": int(per_prompt.min()), "max": int(per_prompt.max())} if len(df) else {},
        "skipped_composites": len(skipped),
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    return run("composites", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
