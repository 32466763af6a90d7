"""Stage ``composites``: multi-panel composites per prompt -> ``composites.parquet``.

``composites.source`` picks the source: ``photos`` (real photographs, embedded default),
``generate`` (the ``policy_t2is`` FLUX pipeline, N seeds per prompt) or ``import`` (a folder of
existing composites plus a manifest). See :mod:`paco.data.composites`.

``import`` reads only inside ``composites.import.dir`` (the declared dependency): a manifest or a
row's ``file`` that is absolute or leads out of it (``..``, a symlink) is refused. It decodes each
image by its real mode and orientation and reports in the metrics how many were rotated by their
EXIF orientation, scaled from 16 to 8 bits, or had transparent pixels composited onto white
(``import_conversions``); with ``strict: false`` bad manifest rows and unreadable, oversized
(``composites.import.max_pixels``), unsupported or outside files, and images smaller than
:data:`paco.data.composites.MIN_PANEL_PX` per panel of their prompt's grid, are skipped and listed
in ``skipped``. Two rows with one composite_id or one (prompt_id, seed) are refused. ``photos``
refuses a prompt whose ``subject`` names no shipped photograph before rendering anything. A run
that produces no composite fails here, not stages later.

Multi-process (:mod:`paco.core.launch` with ``resources.stages.composites.processes`` > 1 runs
``accelerate launch``; the work is ``generate``'s): render batch ``n`` belongs to process
``n % processes``; each process writes its composites to a part file beside the output, and the main
process assembles the table in batch order, so it is byte-identical for any process count.
``photos`` and ``import`` run in the main process only.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from paco.data import composites as C
from paco.core.distributed import launched_processes
from paco.core.io import ALPHA_BACKGROUND, ArtifactError, read_parquet, write_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run, seed_everything


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet")
    p.add_argument("--policy", type=Path, required=True, help="policy model directory (generate)")
    p.add_argument("--import-dir", type=Path, required=True, help="folder of composites (import)")
    p.add_argument("--out", type=Path, required=True, help="composites.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    cfg = params.composites
    seed_everything(cfg.seed)
    prompts = read_parquet(args.prompts, required=["prompt_id", "prompt", "rows", "cols", "height", "width"])
    skipped: list[dict] = []
    conversions: dict = {}
    procs = launched_processes()
    if not procs.is_main and cfg.source != "generate":
        return StageOutput.nothing()  # photos / import: the main process does everything
    if cfg.source == "photos":
        from paco.data.photos import render_composites

        _check_subjects(prompts)
        df = render_composites(prompts, cfg.photos, cfg.seeds_per_prompt, cfg.seed)
    elif cfg.source == "generate":
        from paco.models.loading import load_flux_pipeline

        pipe = load_flux_pipeline(args.policy).to(procs.device)  # this process's GPU, or the CPU
        pipe.set_progress_bar_config(disable=True)
        df = C.generate_composites(
            prompts, pipe, cfg.generate, cfg.seeds_per_prompt, cfg.seed,
            progress=lambda it: tqdm(it, desc=f"generate (process {procs.rank + 1}/{procs.world})", unit="batch",
                                     position=procs.rank),
            owns=procs.owns,
        )
        if procs.world > 1:
            df = _assemble(df, prompts, cfg, procs, args.out)
            if df is None:
                return StageOutput.nothing()  # the main process writes the table and the metrics
    else:
        import_cfg = cfg.import_.model_copy(update={"dir": str(args.import_dir)})
        layouts = {pid: (int(r), int(c)) for pid, r, c in zip(prompts["prompt_id"], prompts["rows"], prompts["cols"])}
        df, skipped, conversions = C.import_composites(import_cfg, set(prompts["prompt_id"]), strict=cfg.strict,
                                                       layouts=layouts)
        for row in skipped:
            log.warning("skipped manifest row: %s", row["reason"])
        if conversions["alpha_flattened"]:
            log.warning(
                "%d imported composite(s) had transparent pixels, composited onto white %s: %s",
                conversions["alpha_flattened"], ALPHA_BACKGROUND, conversions["alpha_flattened_ids"][:10],
            )
        if conversions["rescaled_16bit"] or conversions["exif_rotated"]:
            log.info("imported composites: %d 16-bit greyscale scaled to 8 bits, %d rotated by their EXIF orientation",
                     conversions["rescaled_16bit"], conversions["exif_rotated"])
    if len(df) == 0:
        raise ArtifactError(f"composites ({cfg.source}): no composite was produced from {len(prompts)} prompt(s)")
    write_parquet(args.out, df, image_columns=["image"])
    log.info("wrote %d composites (%s) to %s", len(df), cfg.source, args.out)
    per_prompt = df.groupby("prompt_id").size()
    return StageOutput.headline({
        "source": cfg.source,
        "composites": len(df),
        "prompts": int(df["prompt_id"].nunique()),
        "composites_per_prompt": {"min": int(per_prompt.min()), "max": int(per_prompt.max())} if len(df) else {},
        "skipped_composites": len(skipped),
        "skipped": skipped,
        "import_conversions": {k: v for k, v in conversions.items() if k != "alpha_flattened_ids"},
        "alpha_flattened_ids": conversions.get("alpha_flattened_ids", [])[:50],
    }, "composites", "skipped_composites")


def _check_subjects(prompts) -> None:
    """The ``photos`` source builds a prompt's grids from its ``subject`` photograph: refuse, before
    anything is rendered, a subject that names no shipped photograph (a prompt without one gets
    one picked by :func:`paco.data.photos.render_composites`)."""
    from paco.data.photos import SUBJECTS

    if "subject" not in prompts.columns:
        return
    for pid, subject in zip(prompts["prompt_id"], prompts["subject"]):
        if isinstance(subject, str) and subject in SUBJECTS:
            continue
        if subject is None or (isinstance(subject, float) and subject != subject) or subject is pd.NA:
            continue
        raise ArtifactError(f"prompts: prompt {pid!r}: subject {subject!r} names no shipped photograph "
                            f"(known subjects: {sorted(SUBJECTS)})")


def _assemble(df, prompts, cfg, procs, out: Path):
    """Every process's composites, in batch order, on the main process (``None`` elsewhere):
    each writes ``part-<rank>.parquet`` in a directory beside ``out``, removed afterwards."""
    parts = out.parent / f".{out.name}.parts"
    if procs.is_main:
        shutil.rmtree(parts, ignore_errors=True)  # a killed run's leftovers
        parts.mkdir(parents=True)
    procs.barrier()
    write_parquet(parts / f"part-{procs.rank}.parquet", df, image_columns=["image"])
    procs.barrier()
    if not procs.is_main:
        return None
    try:
        table = pd.concat([read_parquet(parts / f"part-{r}.parquet") for r in range(procs.world)], ignore_index=True)
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    order = C.composite_order(prompts, cfg.generate, cfg.seeds_per_prompt)
    if sorted(table["composite_id"]) != sorted(order):
        raise ArtifactError(f"the processes rendered {len(table)} composites, expected {len(order)}")
    return table.set_index("composite_id").loc[order].reset_index()[C.COMPOSITE_COLUMNS]


def main(argv: list[str] | None = None) -> int:
    return run("composites", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
