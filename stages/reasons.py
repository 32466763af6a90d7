"""Stage ``reasons``: chain-of-thought SFT targets for every pair -> ``sft.parquet``.

The pairs: the T2IS pairs (``pairs.parquet`` with their panels) and the editing pairs
(``edit_pairs.parquet``, each with its own question). With ``reasons.sft_import.enabled``, published
SFT sets in LLaMA-Factory's layout (PaCo-Dataset's ``sharegpt_editing_cot``:
:mod:`paco.judge.sft_import`) join the table as published (their images stored as PNG); with
``reasons.sft_import.strict: false`` a malformed row is skipped and listed in the report
(``import_skipped``, ``import_skipped_rows``: dataset, file and row, reason).

A teacher (``reasons.teacher.backend``: ``template`` offline measurements, ``openai`` any
OpenAI-compatible endpoint, ``local`` a transformers VLM) justifies each pair's known label in
1-3 numbered reasons; targets are ``Yes. <reason>...</reason>`` / ``No. ...`` (or bare
``Yes.``/``No.`` with ``fast``). Resumable: finished chunks persist in ``--progress``; a corrupt
chunk is discarded with a warning naming it, explained again and listed in the metrics
(``discarded_chunks``).

Multi-process (:mod:`paco.core.launch` with ``resources.stages.reasons.processes`` > 1 runs
``accelerate launch``): chunk ``n`` is explained by process ``n % processes``; the main process
checks the progress directory first and assembles ``sft.parquet`` from the chunks after everyone is
done, so the table is byte-identical for any process count (and a resumed run may use another
count).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from paco.judge import reasons as R
from paco.core.io import ArtifactError, read_parquet, write_parquet
from paco.core.distributed import launched_processes
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run, seed_everything


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=Path, required=True, help="pairs.parquet")
    p.add_argument("--panels", type=Path, required=True, help="panels.parquet")
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet (themes)")
    p.add_argument("--progress", type=Path, required=True, help="persisted per-chunk results (resume)")
    p.add_argument("--edit-pairs", type=Path, required=True, help="edit_pairs.parquet (pairs stage; may be empty)")
    p.add_argument("--sft-import", type=Path, required=True,
                   help="LLaMA-Factory dataset_dir of published SFT sets (read with reasons.sft_import.enabled)")
    p.add_argument("--out", type=Path, required=True, help="sft.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    from paco.core.run_identity import stage_identity
    from workflow.registry import member
    from paco.judge.teachers import make_teacher

    cfg = params.reasons
    seed_everything(cfg.seed)
    teacher = make_teacher(cfg.teacher.model_dump())
    pairs = read_parquet(args.pairs, required=["pair_id", "instance_id", "prompt_id", "split", "panel_a", "panel_b", "label"])
    panels = read_parquet(args.panels, required=["panel_id", "image"])
    prompts = read_parquet(args.prompts, required=["prompt_id", "global_prompt"])
    # reasons.sft_import is continuable (its folder is not in the identity either): the imported
    # sets join after the teacher's chunks, so an import change keeps the teacher's progress
    identity = stage_identity(member("reasons"), args.params, params=params, args=args)
    from paco.data.edit_pairs import EDIT_PAIR_COLUMNS

    edit_pairs = read_parquet(args.edit_pairs, required=EDIT_PAIR_COLUMNS)
    table = pd.concat([R.join_pairs(pairs, panels, prompts, instruction=cfg.instruction),
                       R.join_edit_pairs(edit_pairs)], ignore_index=True).sort_values("pair_id", ignore_index=True)
    if len(table) == 0:
        raise ArtifactError("no pairs to explain")
    procs = launched_processes()
    resumed, discarded = 0, []
    if procs.is_main:  # one process clears or checks the persisted chunks before anyone labels
        resumed = R.prepare_progress(args.progress, identity.digest)
        discarded = R.discard_invalid_chunks(table, args.progress, chunk_size=cfg.chunk_size)
        resumed -= len(discarded)
        if resumed:
            log.info("resuming: %d chunks already explained (run identity %s)", resumed, identity.digest[:12])
    procs.barrier()
    explained = R.explain_chunks(
        table, teacher, args.progress, chunk_size=cfg.chunk_size, owns=procs.owns,
        progress=lambda it: tqdm(it, desc=f"reasons (process {procs.rank + 1}/{procs.world})" if procs.world > 1
                                 else "reasons", unit="chunk", position=procs.rank),
    )
    log.info("process %d/%d explained %d chunks", procs.rank + 1, procs.world, explained)
    procs.barrier()
    if not procs.is_main:
        return StageOutput.nothing()  # the main process writes the table and the metrics
    sft = R.assemble_sft(table, teacher, args.progress, chunk_size=cfg.chunk_size)
    imported = None
    if cfg.sft_import.enabled:
        from paco.judge.sft_import import import_sft

        imp = cfg.sft_import
        imported = import_sft(args.sft_import, imp.datasets, strict=imp.strict, max_pixels=imp.max_pixels)
        log.info("imported %s from %s (%d rows skipped)", imported.rows, args.sft_import, len(imported.skipped))
        for row in imported.skipped[:50]:
            log.warning("skipped %s", row["reason"])
        sft = pd.concat([sft, imported.table], ignore_index=True).sort_values("pair_id", ignore_index=True)
    write_parquet(args.out, sft, image_columns=["image_a", "image_b"])
    metrics = R.summarise(sft)
    metrics["imported"] = imported.rows if imported else {}
    metrics["import_skipped"] = len(imported.skipped) if imported else 0
    metrics["import_skipped_rows"] = imported.skipped[:50] if imported else []
    metrics["resumed_chunks"] = resumed
    metrics["discarded_chunks"] = discarded  # corrupt persisted chunks, explained again
    log.info("explained %d pairs: %d ok, %d failed", metrics["pairs"], metrics["ok"], metrics["failed"])
    # resumed/discarded chunks differ between a resumed and a fresh run: report only
    return StageOutput({k: metrics[k] for k in ("ok", "failed")}, metrics)


def main(argv: list[str] | None = None) -> int:
    return run("reasons", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
