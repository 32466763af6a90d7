"""Stage ``reward_eval``: ConsistencyRank evaluation of the trained judge and the baselines.

On the held-out ranking instances (``reward_eval.split``) every candidate is scored against the
reference with P(Yes)/(P(Yes)+P(No)) (trained judge ``paco_reward``, base judge zero-shot
``base_zero_shot``) or CLIP-I cosine (``clip_i``); candidates are ordered by score and compared
with the reference order: accuracy, Kendall tau, Spearman rho (reference-code and rank-vector
definitions), top1-bottom1 (paper Table 2), with t-tests against chance and paired tests of the
trained judge against each baseline. The editing benchmark (``reward_eval.edit_benchmark``;
paper Table 1): pairwise preference accuracy per dimension (prompt following, consistency,
overall = sqrt(PF * SC)), strict and with ties, macro-averaged over task types, for the same
judges, on the held-out photo edits (``photos``, from ``edit_pairs.parquet``) or an
EditReward-Bench-format file (``editreward``; images bounded by ``reward_eval.editreward_max_pixels``),
with the instances whose two outputs are the same bytes counted apart.

Every input (the instances, panels and prompts, and the editing benchmark) is read and checked
before any model is loaded; ``predictions.parquet`` is written last, after every score: a bad
input fails the stage with one line naming the file, row and field, and writes nothing.

Multi-process (:mod:`paco.core.launch` with ``resources.stages.reward_eval.processes`` > 1 runs
``accelerate launch``): every scorer's batches are sharded over the processes and gathered in order
(:func:`paco.core.distributed.shard_batches`), so the predictions and metrics are byte-identical
for any process count; the main process writes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from paco.judge import evaluation as E
from paco.core.distributed import launched_processes, shard_batches
from paco.core.io import ArtifactError, read_parquet, write_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run, seed_everything


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--judge", type=Path, required=True,
                   help="judge directory: judge_endpoint.model (reward_merge's, or a released judge from the "
                        "models stage)")
    p.add_argument("--base", type=Path, required=True, help="base judge directory (zero-shot baseline)")
    p.add_argument("--clip", type=Path, required=True, help="clip model directory (CLIP-I baseline)")
    p.add_argument("--instances", type=Path, required=True, help="rank_instances.parquet")
    p.add_argument("--panels", type=Path, required=True, help="panels.parquet")
    p.add_argument("--prompts", type=Path, required=True, help="prompts.parquet (themes)")
    p.add_argument("--edit-pairs", type=Path, required=True, help="edit_pairs.parquet (edit_benchmark photos)")
    p.add_argument("--editreward", type=Path, required=True, help="EditReward-Bench jsonl (edit_benchmark editreward)")
    p.add_argument("--predictions", type=Path, required=True, help="predictions.parquet to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _read_inputs(args: argparse.Namespace, cfg) -> tuple[pd.DataFrame, dict, dict, pd.DataFrame | None]:
    """Every input, read and checked before any model is loaded: the ranking instances of the
    split, their judge instructions, their decoded panels, and the editing benchmark (``None``
    with ``edit_benchmark: none``)."""
    from paco.core.templates import judge_instruction

    instances = read_parquet(args.instances, required=["instance_id", "prompt_id", "split", "ref_panel_id", "candidate_panel_ids", "ranking"])
    instances = instances[instances["split"] == cfg.split].reset_index(drop=True)
    if instances.empty:
        raise ArtifactError(f"{args.instances}: no ranking instance in split {cfg.split!r}")
    prompts = read_parquet(args.prompts, required=["prompt_id", "global_prompt"])
    theme = dict(zip(prompts["prompt_id"], prompts["global_prompt"], strict=True))
    instruction_of = {
        pid: judge_instruction(theme[pid] if cfg.instruction == "theme" else None) for pid in instances["prompt_id"].unique()
    }
    needed = set(instances["ref_panel_id"]) | {c for cands in instances["candidate_panel_ids"] for c in cands}
    panels = E.decode_panels(read_parquet(args.panels, required=["panel_id", "image"]), needed)
    bench = None
    if cfg.edit_benchmark == "photos":
        from paco.data.edit_pairs import EDIT_PAIR_COLUMNS

        bench = E.photo_edit_benchmark(read_parquet(args.edit_pairs, required=EDIT_PAIR_COLUMNS), cfg.split)
    elif cfg.edit_benchmark == "editreward":
        bench = E.read_edit_benchmark(args.editreward, max_pixels=cfg.editreward_max_pixels)
    if bench is not None and bench.empty:
        raise ArtifactError(f"reward_eval.edit_benchmark {cfg.edit_benchmark}: no instance in split {cfg.split!r} "
                            "(set edit_benchmark: none to skip the editing benchmark)")
    return instances, instruction_of, panels, bench


def _scorers(args: argparse.Namespace, cfg, device) -> dict:
    """name -> batch scorer: the trained judge, and the configured baselines."""
    from paco.models.clip import ClipScorer
    from paco.judge.model import Judge

    scorers = {"paco_reward": Judge.from_pretrained(args.judge, answer_variants=cfg.answer_variants,
                                                    batch_size=cfg.batch_size, device=device).score}
    if "base_zero_shot" in cfg.baselines:
        scorers["base_zero_shot"] = Judge.from_pretrained(args.base, answer_variants=cfg.answer_variants,
                                                          batch_size=cfg.batch_size, device=device).score
    if "clip_i" in cfg.baselines:
        clip = ClipScorer(args.clip, device=device)

        def clip_i(triples):
            a = clip.image_embeddings([t[0] for t in triples], batch_size=cfg.batch_size)
            b = clip.image_embeddings([t[1] for t in triples], batch_size=cfg.batch_size)
            return clip.cosine(a, b).tolist()

        scorers["clip_i"] = clip_i
    return scorers


def _editing(bench: pd.DataFrame, scorers: dict, cfg) -> dict:
    """The editing benchmark's figures of every judge (``metrics["editing"]``)."""
    edit_scores = {name: E.edit_scores(bench, scorer, templates=cfg.edit_templates, single=(name == "clip_i"))
                   for name, scorer in scorers.items()}
    editing = {
        "benchmark": cfg.edit_benchmark, "templates": cfg.edit_templates, "instances": len(bench),
        "items": int(bench["item_id"].nunique()), "identical_outputs": int(bench["identical_outputs"].sum()),
        "judges": {name: E.edit_accuracy(sc) for name, sc in edit_scores.items()},
        "paco_reward_vs": {name: E.edit_paired_comparison(edit_scores["paco_reward"], sc)
                           for name, sc in edit_scores.items() if name != "paco_reward"},
    }
    for name, acc in editing["judges"].items():
        log.info("%-15s editing accuracy: %s", name, "  ".join(
            f"{d} {a['accuracy']:.3f} (p {a['p_value']:.2g})" for d, a in acc.items()))
    return editing


def _body(args: argparse.Namespace, params: Params) -> dict:
    cfg = params.reward_eval
    seed_everything(cfg.seed)
    # read and check every input first, then compute, then write: a bad input fails the stage
    # before any model is loaded and leaves no output of this run
    instances, instruction_of, panels, bench = _read_inputs(args, cfg)
    procs = launched_processes()
    scorers = {name: shard_batches(fn, procs, cfg.batch_size)
               for name, fn in _scorers(args, cfg, procs.device).items()}  # procs.device: this process's GPU or CPU
    preds = {}
    for name, scorer in scorers.items():
        preds[name] = E.rank_predictions(
            instances, panels, instruction_of, scorer, name,
            progress=lambda it, name=name: tqdm(it, desc=f"eval {name}", unit="chunk"), chunk=4 * cfg.batch_size,
        )
    metrics = {
        "split": cfg.split,
        "instances": len(instances),
        "prompts": int(instances["prompt_id"].nunique()),
        "instruction": cfg.instruction,
        "judges": {name: E.summarise_rankings(p) for name, p in preds.items()},
        "paco_reward_vs": {
            name: E.paired_comparison(preds["paco_reward"], p) for name, p in preds.items() if name != "paco_reward"
        },
    }
    if bench is not None:
        metrics["editing"] = _editing(bench, scorers, cfg)
    for name, m in metrics["judges"].items():
        log.info("%-15s accuracy %.3f  tau %.3f  top1-bottom1 %.3f  (p vs chance %.2g)", name, m["accuracy"],
                 m["kendall_tau"], m["top1_bottom1"], m["accuracy_vs_chance"].get("p_value", float("nan")))
    if procs.is_main:  # the main process writes the predictions and the metrics
        write_parquet(args.predictions, pd.concat(preds.values(), ignore_index=True))
    # metrics.json: the ConsistencyRank figures of paper Table 2 per judge, and the trained judge's
    # accuracy gain over each baseline with its p-value; everything else in report.json
    headline = {
        "judges": {name: {k: m.get(k) for k in ("accuracy", "kendall_tau", "spearman_rho", "top1_bottom1")}
                   for name, m in metrics["judges"].items()},
        "paco_reward_vs": {name: {"accuracy_gain": c.get("mean"), "p_value": c.get("p_value")}
                           for name, c in metrics["paco_reward_vs"].items()},
    }
    if "editing" in metrics:
        headline["editing"] = {name: {d: a["accuracy"] for d, a in acc.items()}
                               for name, acc in metrics["editing"]["judges"].items()}
    return StageOutput(headline, metrics, writes=procs.is_main)


def main(argv: list[str] | None = None) -> int:
    return run("reward_eval", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
