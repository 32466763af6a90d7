"""Stage ``benchmark@<subtask>``: T2IS-Bench or GEdit-Bench on final_samples' base and LoRA samples.

``dvc repro`` runs it through :mod:`paco.core.launch` (``benchmark.<subtask>.resources``: in place for
one process, under ``accelerate launch`` for several), here the embedded default's ``t2is``::

    python -m paco.core.launch --config_file workflow/accelerate/cpu.yaml --num_processes 1 \\
        --resources benchmark.t2is.resources -m stages.benchmark --params params.yaml --subtask t2is \\
        --samples data/final_samples/t2is/samples.parquet --items data/prompts/prompts.parquet \\
        --answers data/benchmark/t2is/answers --scores data/benchmark/t2is/scores.parquet \\
        --table data/benchmark/t2is/table.md --metrics data/benchmark/t2is/metrics.json

Params ``benchmark.<subtask>`` (:class:`paco.core.params.BenchmarkParams`): the protocol (``t2is``:
:mod:`paco.benchmark.t2is_run`; ``gedit``: :mod:`paco.benchmark.gedit_run`), the cases, the
evaluators (a URL each, or ``url: null``: served by this stage with ``judge_endpoint.server``'s
settings, :mod:`paco.benchmark.serving`). Every answer goes to the persisted answer cache
``--answers``, kept only under the same run identity (:func:`run_identity`): a rerun asks
nothing it has asked, and starts no server when every answer is cached. Writes ``scores.parquet``
(one row per question asked), ``metrics.json`` (per variant and evaluator the protocol's figures,
LoRA minus base with paired tests over cases, skipped and unparsed counts) and ``table.md`` (the
paper's table with its rows beside this run's), each atomically; ``report.json`` beside the
metrics holds the request counts, cache hits and timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from paco.core.io import ArtifactError, atomic_write_bytes, read_parquet, write_parquet
from paco.core.params import Params
from paco.core.stage import StageOutput, log, run, subtask_params


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--subtask", required=True, help="key of params.yaml benchmark.<subtask> (a final_samples key)")
    p.add_argument("--samples", type=Path, required=True, help="final_samples' samples.parquet of the subtask")
    p.add_argument("--items", type=Path, required=True,
                   help="prompts.parquet (protocol t2is: layouts, criteria) or edits.parquet (gedit: input images, "
                        "instructions, task types, languages)")
    p.add_argument("--answers", type=Path, required=True, help="persisted answer cache directory")
    p.add_argument("--scores", type=Path, required=True, help="scores.parquet to write")
    p.add_argument("--table", type=Path, required=True, help="table.md to write")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.json to write")


def _evaluators(params: Params, cfg, answers: Path, subtask: str) -> list:
    """The member's evaluators (:class:`paco.benchmark.serving.BenchEvaluator`), in params order."""
    import os

    from paco.benchmark.serving import BenchEvaluator
    from paco.serving.local import server_options

    s = params.judge_endpoint.server
    server = server_options(s, request_timeout_s=cfg.timeout_s, max_logprobs=max(s.max_logprobs, cfg.top_logprobs))
    out = []
    for name, ev in cfg.evaluators.items():
        key = os.environ.get(ev.api_key_env) if ev.api_key_env else None
        if ev.api_key_env and not key:
            raise ArtifactError(f"benchmark.{subtask}.evaluators.{name}.api_key_env: ${ev.api_key_env} is not set")
        client = {"concurrency": cfg.concurrency, "timeout_s": cfg.timeout_s, "retries": cfg.retries,
                  "top_logprobs": cfg.top_logprobs, "api_key": key}
        out.append(BenchEvaluator(name, ev.served_model_name, url=ev.url, model_dir=ev.model, cache_dir=answers,
                                  server_kwargs={**server, "log_path": Path("logs") / f"benchmark_{subtask}.{name}.log"},
                                  client_kwargs=client, backend=ev.backend))
    return out


def _score(args: argparse.Namespace, params: Params, cfg, evaluators: list) -> tuple:
    """(scores, metrics, report, table text) of the member's protocol."""
    from paco.benchmark import gedit_run, t2is_local, t2is_run
    from paco.benchmark.cases import SAMPLE_COLUMNS, monitor_summary
    from paco.benchmark.gedit_bench import OFFICIAL_TASK_TYPES
    from paco.benchmark.tables import gedit_table, stand_in_notes, t2is_table

    samples = read_parquet(args.samples, required=SAMPLE_COLUMNS)
    # the project's CPU servers (one thread each) are asked at once; vLLM servers and in-process
    # (transformers) evaluators one after the other: each has the member's GPUs to itself
    together = params.judge_endpoint.server.engine == "paco" and all(
        ev.backend == "openai" for ev in cfg.evaluators.values())
    chunk = 4 * cfg.concurrency
    described = {n: ev.model_dump() for n, ev in cfg.evaluators.items()}
    doubled = [f"`{ev.name}`" for ev in evaluators if ev.doubles_single_images]
    single = (cfg.protocol == "gedit" or cfg.t2is.prompt_alignment == "yes_no") and doubled
    extra = [f"{', '.join(doubled)}: served by the project's judge server, which takes exactly two images: each "
             "one-image question (PQ, PA) is sent with its image twice"] if single else []
    if cfg.protocol == "t2is":
        items = read_parquet(args.items, required=t2is_run.PROMPT_COLUMNS)
        plan = t2is_run.plan_t2is(samples, items, seeds_per_prompt=cfg.seeds_per_prompt, max_prompts=cfg.max_prompts,
                                  prompt_alignment=cfg.t2is.prompt_alignment)
        log.info("benchmark@%s: T2IS-Bench, %d cases, %d questions per evaluator", args.subtask,
                 len(plan.cases["base"]), len(plan.requests))
        t2is_local.check_local(plan, cfg.t2is)  # t2v_metrics / aesthetic weights missing: fail before asking
        answers = t2is_run.ask_t2is(plan, evaluators, together=together, chunk=chunk)
        local = t2is_local.score_local(plan, cfg.t2is)  # VQAScore and aesthetics (GPU), after the evaluators closed
        scores, metrics, report = t2is_run.score_t2is(plan, answers, prompt_alignment=cfg.t2is.prompt_alignment,
                                                      local=local)
        notes = stand_in_notes("t2is", cfg, described, report["not_scored"], extra)
        metrics["monitors"] = monitor_summary(samples, seeds_per_prompt=cfg.seeds_per_prompt, max_prompts=cfg.max_prompts)
        table = t2is_table(args.subtask, metrics, described, notes) + _monitor_text(metrics["monitors"])
        return scores, metrics, report, table, len(plan.requests)
    items = read_parquet(args.items, required=gedit_run.EDIT_COLUMNS)
    plan = gedit_run.plan_gedit(samples, items, seeds_per_prompt=cfg.seeds_per_prompt, max_prompts=cfg.max_prompts)
    log.info("benchmark@%s: GEdit-Bench, %d cases, %d SC + %d PQ requests per evaluator", args.subtask,
             len(plan.units) // 2, len(plan.units), len(plan.units))
    answers = gedit_run.ask_gedit(plan, evaluators, cfg.gedit, together=together, chunk=chunk)
    scores, metrics, report = gedit_run.score_gedit(plan, answers, cfg.gedit)
    if report["task_types"] != list(OFFICIAL_TASK_TYPES):
        extra.append(f"task types averaged: those present, {report['task_types']} (not GEdit-Bench's 11)")
    for cell, missing in report["partial_cells"].items():
        extra.append(f"{cell.upper().replace('_I', '-I')}: a mean over fewer than the {len(report['task_types'])} "
                     f"task types (no scored item of {', '.join(missing)} for some variant or evaluator: see "
                     "metrics.json missing_task_types; GEdit-Bench's own mean would be NaN)")
    notes = stand_in_notes("gedit", cfg, described, report["not_scored"], extra)
    metrics["monitors"] = monitor_summary(samples, seeds_per_prompt=cfg.seeds_per_prompt, max_prompts=cfg.max_prompts)
    table = gedit_table(args.subtask, metrics, described, notes) + _monitor_text(metrics["monitors"])
    return scores, metrics, report, table, 2 * len(plan.units)


def _monitor_text(monitors: dict) -> str:
    """The reward-hacking monitors' section of ``table.md`` (:func:`paco.benchmark.tables.monitor_lines`)."""
    from paco.benchmark.tables import monitor_lines

    lines = monitor_lines(monitors)
    return "\n".join(lines) + "\n" if lines else ""


def run_identity(params: Params, subtask: str, params_path: str | Path, *, args: argparse.Namespace | None = None,
                 root: str | Path = ".") -> Any:
    """The identity the member's answer cache is kept under (:func:`paco.core.run_identity.stage_identity`:
    its deps, code and params, less what changes no evaluator's answer: the t2is scorers' keys,
    which are the stage's ``evaluation`` keys, and the LAION predictor's files), extended by ``vllm_tensor_parallel_size`` when ``judge_endpoint.server.engine`` is
    ``vllm`` and an evaluator is served by the stage: ``judge_endpoint.server.gpus`` is a launch key
    of the params, yet it becomes the served evaluator's vLLM tensor-parallel size, which changes
    its log-probs, so a change must clear the answer cache (:func:`~paco.benchmark.serving.prepare_answers`).

    Raises:
        OSError: a dependency cannot be read.
    """
    from paco.core.run_identity import stage_identity
    from workflow.registry import member

    identity = stage_identity(member(f"benchmark@{subtask}", params.model_dump(mode="json", by_alias=True)),
                              params_path, root=root, params=params, args=args)
    server = params.judge_endpoint.server
    cfg = subtask_params(params, "benchmark", subtask)
    # the LAION predictor's CLIP and weights (any member's: the dependencies are shared) change no
    # evaluator's answer: out of the identity, as the t2is scorer keys are (the stage's evaluation keys)
    laion = {f"dep:{p}" for c in params.benchmark.values() for p in (c.t2is.aesthetics_clip, c.t2is.aesthetics_weights)
             if p is not None}
    identity = type(identity)(identity.member, {k: v for k, v in identity.parts.items() if k not in laion},
                              identity.evaluation)
    if server.engine == "vllm" and any(ev.url is None and ev.backend == "openai" for ev in cfg.evaluators.values()):
        identity = identity.extended(vllm_tensor_parallel_size=max(server.gpus, 1))
    return identity


def _body(args: argparse.Namespace, params: Params) -> StageOutput:
    from paco.benchmark.answer_cache import compact_answers
    from paco.benchmark.evaluator import EvaluatorError
    from paco.benchmark.cases import SCORE_SCHEMA
    from paco.benchmark.serving import prepare_answers
    cfg = subtask_params(params, "benchmark", args.subtask)
    identity = run_identity(params, args.subtask, args.params, args=args)
    kept = prepare_answers(args.answers, identity.digest)
    evaluators = _evaluators(params, cfg, args.answers, args.subtask)
    t0 = time.perf_counter()
    try:
        if params.judge_endpoint.server.engine == "paco":
            for ev in evaluators:  # nothing cached: it will be asked; its server loads while the questions are made
                if len(ev.cache) == 0 and ev.backend == "openai":  # in-process models load in turn, when asked
                    ev.start()
        scores, metrics, report, table, per_evaluator = _score(args, params, cfg, evaluators)
    except EvaluatorError as exc:
        raise ArtifactError(f"benchmark@{args.subtask}: {exc} (nothing was scored; the answers so far are cached "
                            f"in {args.answers})") from None
    finally:
        for ev in evaluators:
            ev.close()
    seconds = time.perf_counter() - t0
    compact_answers(args.answers)  # the persisted answers' bytes: sorted by key, not by arrival
    write_parquet(args.scores, scores, schema=SCORE_SCHEMA)
    atomic_write_bytes(args.table, table.encode("utf-8"))
    report.update(run_identity=identity.digest, answer_files_kept=kept, evaluator_seconds=round(seconds, 3),
                  requests_per_evaluator=per_evaluator,
                  evaluators={ev.name: {**ev.describe(), "asked": ev.asked, "cache_hits": ev.hits}
                              for ev in evaluators})
    for ev in evaluators:
        log.info("benchmark@%s evaluator %s: %d asked, %d from the cache", args.subtask, ev.name, ev.asked, ev.hits)
    log.info("benchmark@%s: %d questions scored in %.1f s; table %s", args.subtask, len(scores), seconds, args.table)
    return StageOutput(metrics, {**metrics, **report})


def main(argv: list[str] | None = None) -> int:
    return run("benchmark", argv, _args, _body, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
