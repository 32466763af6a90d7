"""Stage ``reward_merge``: merge the judge's LoRA adapter into the base -> ``model/``.

``merge_and_unload`` folds the adapter into the base weights; the merged model is saved as
safetensors with the processor, so ``transformers`` and ``vllm serve`` load it directly. The
stage checks that the unmerged adapter, the merged model in memory and the merged model reloaded
from disk give the same P(Yes) on ``reward_merge.check_pairs`` held-out pairs, within
``MERGE_ATOL`` (float32) or ``MERGE_ATOL_BF16``, and fails otherwise.

Multi-process (:mod:`paco.core.launch` with ``resources.stages.reward_merge.processes`` > 1 runs
``accelerate launch``): the check's scoring batches are sharded over the processes
(:func:`paco.core.distributed.shard_batches`); the main process saves the merged model, which every
process reloads for the third check. The model and metrics are byte-identical for any process
count.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from paco.core.distributed import broadcast_from_main, launched_processes, shard_batches
from paco.core.io import ArtifactError, decode_image, read_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run

#: max |P(Yes) difference| between unmerged, merged and reloaded models (float32: only
#: summation-order rounding of W + BA; bf16: rounding of the merged weights to 8 mantissa bits)
MERGE_ATOL = 1e-4
MERGE_ATOL_BF16 = 2e-2


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, required=True, help="base judge directory")
    p.add_argument("--adapter", type=Path, required=True, help="PEFT adapter directory")
    p.add_argument("--sft", type=Path, required=True, help="sft.parquet (pairs for the check)")
    p.add_argument("--out", type=Path, required=True, help="merged model directory to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    import torch
    from peft import PeftModel

    from paco.judge.model import Judge
    from paco.models.loading import load_judge

    cfg = params.reward_merge
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    atol = MERGE_ATOL_BF16 if cfg.dtype == "bfloat16" else MERGE_ATOL
    sft = read_parquet(args.sft, required=["pair_id", "split", "status", "instruction", "image_a", "image_b"])
    ok = sft[sft["status"] == "ok"]
    check = (ok[ok["split"] == "test"] if (ok["split"] == "test").any() else ok).head(cfg.check_pairs)
    if check.empty:
        raise ArtifactError(f"{args.sft}: no labelled pair to check the merge on")
    triples = [
        (decode_image(r.image_a, what=r.pair_id), decode_image(r.image_b, what=r.pair_id), r.instruction)
        for r in check.itertuples()
    ]
    procs = launched_processes()

    def check_scores(judge: Judge) -> list[float]:
        return shard_batches(judge.score, procs, judge.batch_size)(triples)

    # on this process's device (its GPU when one is visible): the merge and the three check
    # passes of a 7B judge on CPU take hours
    model, processor = load_judge(args.base, dtype=dtype)
    model.to(procs.device)
    peft_model = PeftModel.from_pretrained(model, str(args.adapter))
    unmerged = check_scores(Judge(peft_model, processor))
    merged_model = peft_model.merge_and_unload()
    merged = check_scores(Judge(merged_model, processor))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent)) if procs.is_main else None
    tmp = broadcast_from_main(procs.state, tmp)  # every process reloads the main process's save
    try:
        if procs.is_main:
            merged_model.save_pretrained(tmp, safe_serialization=True)
            processor.save_pretrained(tmp)
        procs.barrier()
        reloaded = check_scores(Judge.from_pretrained(tmp, dtype=dtype, device=procs.device))
        procs.barrier()  # everyone has read the save before it moves
        if not procs.is_main:
            return StageOutput.nothing()  # the main process moves the model into place and writes the metrics
        diffs = {
            "merged_vs_unmerged": max(abs(a - b) for a, b in zip(unmerged, merged, strict=True)),
            "reloaded_vs_unmerged": max(abs(a - b) for a, b in zip(unmerged, reloaded, strict=True)),
        }
        log.info("P(Yes) max abs differences: %s (tolerance %g)", diffs, atol)
        if max(diffs.values()) > atol:
            raise ArtifactError(f"merged judge disagrees with the adapter: {diffs} > {atol}")
        if args.out.exists():
            shutil.rmtree(args.out)
        tmp.rename(args.out)
    finally:
        if procs.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
    return StageOutput.headline({
        "check_pairs": len(triples),
        "tolerance": atol,
        "max_abs_diff": diffs,
        "p_yes_unmerged": unmerged,
        "dtype": cfg.dtype,
        "parameters": sum(p.numel() for p in merged_model.parameters()),
    })


def main(argv: list[str] | None = None) -> int:
    return run("reward_merge", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
