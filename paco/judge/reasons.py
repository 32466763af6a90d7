"""Chain-of-thought SFT targets for the judge (paper §3.1-3.2, Fig. 2), resumable.

For every Yes/No pair a teacher (:mod:`paco.judge.teachers`) writes 1-3 numbered reasons that justify
the known label; the target is ``Yes. <reason>1. ... 2. ...</reason>`` (or bare ``Yes.`` /
``No.`` for the fast variant). The instruction of a T2IS pair is the theme template filled with
the prompt's global description (the reference code's ``divide_prompt(prompt)[0]``); an editing
pair (:mod:`paco.data.edit_pairs`) carries its own question (``edit_pf`` / ``edit_sc`` with the
edit instruction). The ``task`` column says which (``t2is``, ``edit_pf``, ``edit_sc``).

Progress is persisted per chunk of pairs under a progress directory, tagged with the stage's run
identity (:mod:`paco.core.run_identity`: the ``reasons`` params, the pair, panel and prompt tables, the
code the stage runs): an interrupted run resumes with the chunks it finished; any change starts
over. A chunk file that cannot be read, or does not hold exactly its chunk's pairs, is discarded
with a warning naming it and explained again; an unreadable identity marker clears the directory. Failed
pairs stay in the output with ``status="failed"`` and the teacher's error; they are counted,
never relabelled or dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from paco.core.io import ArtifactError, decode_image, read_parquet, write_parquet
from paco.core.templates import judge_instruction
from paco.judge.teachers.base import PairItem, Teacher

SFT_COLUMNS = [
    "pair_id", "instance_id", "prompt_id", "split", "task", "instruction", "image_a", "image_b", "label",
    "reasons", "response", "teacher", "status", "error", "attempts",
]
_RESULT_COLUMNS = ["pair_id", "reasons", "response", "status", "error", "attempts"]
_STATUSES = frozenset({"ok", "failed"})

log = logging.getLogger("paco.judge.reasons")


def prepare_progress(progress_dir: Path, identity: str) -> int:
    """Make ``progress_dir`` hold only chunks written under run identity ``identity`` (a digest);
    returns how many exist (:func:`paco.core.checkpoints.keep_under_identity`: a directory of
    another identity, or with an unreadable marker, is cleared).
    """
    from paco.core.checkpoints import keep_under_identity

    path = keep_under_identity(progress_dir, identity, what="reasons progress", log=log)
    return len(list(path.glob("chunk-*.parquet")))


def join_pairs(
    pairs: pd.DataFrame, panels: pd.DataFrame, prompts: pd.DataFrame, *, instruction: str = "theme"
) -> pd.DataFrame:
    """Pairs with their two panel image cells, theme and judge instruction, sorted by pair_id.

    ``instruction``: ``theme`` fills the T2IS theme template with the prompt's global
    description (a prompt without one gets the theme-free template); ``rank`` always uses the
    theme-free ConsistencyRank template.

    Raises:
        ArtifactError: a pair names a panel or prompt that does not exist (names the pair_id).
    """
    images = dict(zip(panels["panel_id"], panels["image"], strict=True))
    theme = {
        pid: (None if pd.isna(text) or not str(text).strip() else str(text))
        for pid, text in zip(prompts["prompt_id"], prompts["global_prompt"], strict=True)
    }
    rows = []
    for pair in pairs.sort_values("pair_id").to_dict("records"):
        for col in ("panel_a", "panel_b"):
            if pair[col] not in images:
                raise ArtifactError(f"pair {pair['pair_id']}: panel {pair[col]!r} is not in panels.parquet")
        if pair["prompt_id"] not in theme:
            raise ArtifactError(f"pair {pair['pair_id']}: prompt {pair['prompt_id']!r} is not in prompts.parquet")
        rows.append(
            {
                **{k: pair[k] for k in ("pair_id", "instance_id", "prompt_id", "split", "label")},
                "task": "t2is",
                "theme": theme[pair["prompt_id"]],
                "instruction": judge_instruction(theme[pair["prompt_id"]] if instruction == "theme" else None),
                "image_a": images[pair["panel_a"]],
                "image_b": images[pair["panel_b"]],
            }
        )
    return pd.DataFrame.from_records(rows)


def join_edit_pairs(edit_pairs: pd.DataFrame) -> pd.DataFrame:
    """Editing pairs (``edit_pairs.parquet``) in :func:`join_pairs`' layout: ``instance_id`` is
    ``<item>-<question>``, ``prompt_id`` the item, ``task`` ``edit_pf`` / ``edit_sc``, the
    ``instruction`` the pair's own question, no theme; sorted by ``pair_id``."""
    rows = [
        {"pair_id": r["pair_id"], "instance_id": f"{r['item_id']}-{r['question']}", "prompt_id": r["item_id"],
         "split": r["split"], "label": bool(r["label"]), "task": f"edit_{r['question']}", "theme": None,
         "instruction": r["instruction"], "image_a": r["image_a"], "image_b": r["image_b"]}
        for r in edit_pairs.sort_values("pair_id").to_dict("records")
    ]
    return pd.DataFrame.from_records(rows, columns=["pair_id", "instance_id", "prompt_id", "split", "label", "task",
                                                    "theme", "instruction", "image_a", "image_b"])


def _chunk_path(progress_dir: Path, n: int) -> Path:
    return progress_dir / f"chunk-{n:05d}.parquet"


def _chunk_problem(path: Path, pair_ids: list[str]) -> str | None:
    """Why a persisted chunk cannot be reused (None if it can): unreadable, wrong columns,
    other pairs than its chunk's (in order), or a status other than ok/failed."""
    try:
        df = read_parquet(path, required=_RESULT_COLUMNS)
    except ArtifactError as exc:
        return str(exc)
    if df["pair_id"].tolist() != pair_ids:
        return f"holds pairs {df['pair_id'].tolist()[:3]}... instead of its chunk's {pair_ids[:3]}..."
    bad = sorted(set(df["status"].astype(str)) - _STATUSES)
    if bad:
        return f"unknown status value(s) {bad}"
    return None


def discard_invalid_chunks(table: pd.DataFrame, progress_dir: Path, *, chunk_size: int) -> list[dict[str, str]]:
    """Delete persisted chunks of ``table`` that cannot be reused, so they are explained again.

    A chunk is discarded when its file cannot be read as Parquet, lacks a result column, holds
    other pair_ids than rows ``[n * chunk_size, (n + 1) * chunk_size)`` of ``table`` (in that
    order) or has a status other than ``ok``/``failed``. Each discard is logged as a warning
    naming the file and the reason.

    Returns:
        ``[{"chunk": file name, "reason": str}]`` for every discarded chunk.
    """
    discarded = []
    n_chunks = (len(table) + chunk_size - 1) // chunk_size
    for n in range(n_chunks):
        path = _chunk_path(progress_dir, n)
        if not path.is_file():
            continue
        ids = table["pair_id"].iloc[n * chunk_size : (n + 1) * chunk_size].tolist()
        problem = _chunk_problem(path, ids)
        if problem is not None:
            log.warning("discarding corrupt progress chunk %s (%s); it will be explained again", path, problem)
            path.unlink()
            discarded.append({"chunk": path.name, "reason": problem})
    return discarded


def explain_pairs(
    table: pd.DataFrame,
    teacher: Teacher,
    progress_dir: Path,
    *,
    chunk_size: int,
    progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
) -> pd.DataFrame:
    """Run the teacher over ``table`` (from :func:`join_pairs`) chunk by chunk, persisting each,
    in one process: :func:`discard_invalid_chunks`, :func:`explain_chunks`, :func:`assemble_sft`.

    Returns the SFT table (``SFT_COLUMNS``).

    Raises:
        ArtifactError: no pairs, or the teacher returned results for other pairs than it was
            given.
    """
    if len(table) == 0:
        raise ArtifactError("no pairs to explain")
    discard_invalid_chunks(table, progress_dir, chunk_size=chunk_size)
    explain_chunks(table, teacher, progress_dir, chunk_size=chunk_size, progress=progress)
    return assemble_sft(table, teacher, progress_dir, chunk_size=chunk_size)


def explain_chunks(
    table: pd.DataFrame,
    teacher: Teacher,
    progress_dir: Path,
    *,
    chunk_size: int,
    owns: Callable[[int], bool] = lambda n: True,
    progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
) -> int:
    """Have the teacher explain the chunks of ``table`` that ``owns(n)`` selects and that are not persisted yet.

    Chunk ``n`` covers rows ``[n * chunk_size, (n + 1) * chunk_size)`` and is written atomically
    to ``progress_dir/chunk-<n>.parquet``; an existing chunk is reused (resume). A chunk's result
    depends only on its rows and the teacher (the local teacher seeds every call), so which
    process explains it, and in what order, changes nothing (``owns``: e.g.
    :meth:`paco.core.distributed.Processes.owns`). Run :func:`discard_invalid_chunks` first, in
    one process.

    Returns the number of chunks explained by this call.

    Raises:
        ArtifactError: the teacher returned results for other pairs than it was given.
    """
    n_chunks = (len(table) + chunk_size - 1) // chunk_size
    explained = 0
    for n in progress([n for n in range(n_chunks) if owns(n)]):
        path = _chunk_path(progress_dir, n)
        if path.is_file():
            continue
        chunk = table.iloc[n * chunk_size : (n + 1) * chunk_size]
        items = [
            PairItem(
                pair_id=r["pair_id"],
                image_a=decode_image(r["image_a"], what=f"pair {r['pair_id']} image_a"),
                image_b=decode_image(r["image_b"], what=f"pair {r['pair_id']} image_b"),
                label=bool(r["label"]),
                theme=r["theme"],
                question=None if r["task"] == "t2is" else r["instruction"],
            )
            for r in chunk.to_dict("records")
        ]
        results = teacher.explain(items)
        if [r.pair_id for r in results] != [i.pair_id for i in items]:
            raise ArtifactError(f"teacher returned results for other pairs in chunk {n}")
        write_parquet(
            path,
            pd.DataFrame.from_records(
                [
                    {
                        "pair_id": r.pair_id,
                        "reasons": list(r.reasons),
                        "response": r.response if r.ok else None,
                        "status": "ok" if r.ok else "failed",
                        "error": r.error,
                        "attempts": int(r.attempts),
                    }
                    for r in results
                ],
                columns=_RESULT_COLUMNS,
            ),
        )
        explained += 1
    return explained


def assemble_sft(table: pd.DataFrame, teacher: Teacher, progress_dir: Path, *, chunk_size: int) -> pd.DataFrame:
    """The SFT table (``SFT_COLUMNS``, rows in ``table``'s order) from every persisted chunk.

    Raises:
        ArtifactError: a chunk is missing or unreadable, or a pair has no teacher result.
    """
    n_chunks = (len(table) + chunk_size - 1) // chunk_size
    missing = [n for n in range(n_chunks) if not _chunk_path(progress_dir, n).is_file()]
    if missing:
        raise ArtifactError(f"{len(missing)} of {n_chunks} label chunks missing in {progress_dir} (first: {missing[0]})")
    done = pd.concat([read_parquet(_chunk_path(progress_dir, n)) for n in range(n_chunks)], ignore_index=True)
    sft = table.merge(done, on="pair_id", how="left", validate="one_to_one")
    if sft["status"].isna().any():
        raise ArtifactError(f"{int(sft['status'].isna().sum())} pairs have no teacher result after the teacher ran")
    sft["teacher"] = json.dumps(teacher.describe(), sort_keys=True)
    return sft[SFT_COLUMNS]


def summarise(sft: pd.DataFrame) -> dict[str, Any]:
    """Metrics: counts per split and status, failure reasons, reasons per target, label balance."""
    ok = sft[sft["status"] == "ok"]
    failures = sft.loc[sft["status"] == "failed", ["pair_id", "error"]]
    return {
        "pairs": len(sft),
        "ok": len(ok),
        "failed": len(failures),
        "failures": failures.head(50).to_dict("records"),
        "per_split": {s: {"ok": int((g["status"] == "ok").sum()), "failed": int((g["status"] != "ok").sum())}
                      for s, g in sft.groupby("split")},
        "per_task": {t: int(len(g)) for t, g in sft.groupby("task")},
        "yes_fraction": float(ok["label"].mean()) if len(ok) else None,
        "reasons_per_target": float(ok["reasons"].map(len).mean()) if len(ok) else None,
        "response_chars": float(ok["response"].str.len().mean()) if len(ok) else None,
        "teacher": next((t for t in sft["teacher"] if not str(t).startswith("import:")), None),
    }
