"""Chain-of-thought SFT targets for the judge (paper §3.1-3.2, Fig. 2), resumable.

For every Yes/No pair a teacher (:mod:`paco.teacher`) writes 1-3 numbered reasons that justify
the known label; the target is ``Yes. <reason>1. ... 2. ...</reason>`` (or bare ``Yes.`` /
``No.`` for the fast variant). The instruction is the T2IS theme template filled with the
prompt's global description (the reference code's ``divide_prompt(prompt)[0]``).

Progress is persisted per chunk of pairs under a progress directory, tagged with a fingerprint
of everything that determines the result (teacher config, chunking, the pair and panel tables):
an interrupted run resumes with the chunks it finished; a changed config starts over. Failed
pairs stay in the output with ``status="failed"`` and the teacher's error; they are counted,
never relabelled or dropped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from paco.io import ArtifactError, decode_image, read_parquet, write_json, write_parquet
from paco.templates import judge_instruction
from paco.teacher import PairItem, Teacher

SFT_COLUMNS = [
    "pair_id", "instance_id", "prompt_id", "split", "instruction", "image_a", "image_b", "label",
    "reasons", "response", "teacher", "status", "error", "attempts",
]
_RESULT_COLUMNS = ["pair_id", "reasons", "response", "status", "error", "attempts"]


def file_digest(*paths: str | Path) -> str:
    """SHA-256 over the bytes of the given files (in order)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def fingerprint(config: dict[str, Any], *inputs: str | Path) -> str:
    """Hash of a JSON-able config and input files: what makes persisted progress reusable."""
    blob = json.dumps(config, sort_keys=True, default=str) + file_digest(*inputs)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_progress(progress_dir: Path, fp: str) -> int:
    """Make ``progress_dir`` hold only chunks of fingerprint ``fp``; returns how many exist.

    A directory written under another fingerprint (other config or inputs) is cleared.
    """
    marker = progress_dir / "fingerprint.json"
    if progress_dir.exists():
        old = json.loads(marker.read_text()).get("fingerprint") if marker.is_file() else None
        if old != fp:
            shutil.rmtree(progress_dir)
    progress_dir.mkdir(parents=True, exist_ok=True)
    write_json(marker, {"fingerprint": fp})
    return len(list(progress_dir.glob("chunk-*.parquet")))


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
                "theme": theme[pair["prompt_id"]],
                "instruction": judge_instruction(theme[pair["prompt_id"]] if instruction == "theme" else None),
                "image_a": images[pair["panel_a"]],
                "image_b": images[pair["panel_b"]],
            }
        )
    return pd.DataFrame.from_records(rows)


def label_pairs(
    table: pd.DataFrame,
    teacher: Teacher,
    progress_dir: Path,
    *,
    chunk_size: int,
    progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
) -> pd.DataFrame:
    """Run the teacher over ``table`` (from :func:`join_pairs`) chunk by chunk, persisting each.

    Chunk ``n`` covers rows ``[n * chunk_size, (n + 1) * chunk_size)`` and is written atomically
    to ``progress_dir/chunk-<n>.parquet``; existing chunks are reused (resume). Returns the SFT
    table (``SFT_COLUMNS``).

    Raises:
        ArtifactError: the teacher returned results for other pairs than it was given.
    """
    n_chunks = (len(table) + chunk_size - 1) // chunk_size
    for n in progress(range(n_chunks)):
        path = progress_dir / f"chunk-{n:05d}.parquet"
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
    done = pd.concat([read_parquet(p) for p in sorted(progress_dir.glob("chunk-*.parquet"))], ignore_index=True)
    sft = table.merge(done, on="pair_id", how="left", validate="one_to_one")
    if sft["status"].isna().any():
        raise ArtifactError(f"{int(sft['status'].isna().sum())} pairs have no teacher result after labelling")
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
        "yes_fraction": float(ok["label"].mean()) if len(ok) else None,
        "reasons_per_target": float(ok["reasons"].map(len).mean()) if len(ok) else None,
        "response_chars": float(ok["response"].str.len().mean()) if len(ok) else None,
        "teacher": sft["teacher"].iloc[0] if len(sft) else None,
    }
