"""Checkpoint-directory plumbing shared by the resumable training stages (``reward_train``,
``grpo@<subtask>``): numbered checkpoint directories, atomic directory replacement, fingerprint
matching, and the per-stage ``plots/*.csv`` files.

A checkpoint is ``<dir>/<prefix><N>/`` holding a JSON state file; it is written to a hidden
``.tmp-<prefix><N>`` sibling and renamed into place, so a crash leaves either the previous
checkpoints or a stray temp directory (removed on the next start), never a half checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

STATE_FILE = "trainer_state.json"
_FULL_HASH_LIMIT = 1 << 30  # model weight files up to 1 GiB in total are hashed in full


def list_checkpoints(checkpoints_dir: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Complete checkpoints (``<prefix><N>`` directories holding ``trainer_state.json``),
    oldest (smallest ``N``) first."""
    d = Path(checkpoints_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = re.fullmatch(rf"{re.escape(prefix)}(\d+)", p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished directory ``tmp`` to ``target`` (replacing it)."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def resumable(checkpoints_dir: str | os.PathLike[str], prefix: str, fingerprint: str,
              parts: Mapping[str, str], *, main: bool, log: logging.Logger) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint and its state if its fingerprint matches, else ``None``.

    A mismatching newest checkpoint means the run changed: the main process logs which
    fingerprint parts differ and removes every checkpoint (a fresh start, never a wrong resume).
    Leftover ``.tmp-<prefix>*`` directories of an interrupted write are removed too.
    """
    d = Path(checkpoints_dir)
    existing = list_checkpoints(d, prefix)
    found = None
    if existing:
        latest = existing[-1]
        state = read_state(latest)
        if state.get("fingerprint") == fingerprint:
            found = (latest, state)
        elif main:
            old = state.get("fingerprint_parts", {})
            why = [k for k in parts if old.get(k) != parts[k]]
            log.warning("checkpoint %s does not match this run (different %s): starting fresh, removing %d old "
                        "checkpoint(s)", latest, ", ".join(why) or "fingerprint", len(existing))
            for p in existing:
                shutil.rmtree(p, ignore_errors=True)
    if main and d.is_dir():
        for p in d.glob(f".tmp-{prefix}*"):
            shutil.rmtree(p, ignore_errors=True)
    return found


def prune(checkpoints_dir: str | os.PathLike[str], prefix: str, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints."""
    for old in list_checkpoints(checkpoints_dir, prefix)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def write_plot_csvs(plots_dir: Path | None, history: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """``<plots_dir>/<name>.csv`` for every ``history[name]`` (rows of a table), each replaced
    atomically; ``plots_dir=None`` writes nothing (non-main processes)."""
    if plots_dir is None:
        return
    plots_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in history.items():
        tmp = plots_dir / f".{name}.csv.tmp-{os.getpid()}"
        pd.DataFrame(list(rows)).to_csv(tmp, index=False)
        os.replace(tmp, plots_dir / f"{name}.csv")


def _hash_file(h: Any, path: Path, full: bool) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}\n".encode())
    with open(path, "rb") as fh:
        if full:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
            return
        # large files: 17 evenly spaced 1 MiB samples (the first holds the safetensors header)
        for k in range(17):
            fh.seek(k * max(size - (1 << 20), 0) // 16)
            h.update(fh.read(1 << 20))


def model_digest(base_dir: str | os.PathLike[str]) -> str:
    """sha256 over a model directory's config/tokenizer files and weight files (weights hashed in
    full up to 1 GiB in total, by 17 samples of 1 MiB per file above that): what a checkpoint's
    fingerprint records of the model it was trained from."""
    base = Path(base_dir)
    files = sorted(p for p in base.rglob("*") if p.is_file())
    weights = [p for p in files if p.suffix in (".safetensors", ".bin")]
    full_weights = sum(p.stat().st_size for p in weights) <= _FULL_HASH_LIMIT
    h = hashlib.sha256()
    for p in files:
        is_weight = p in weights
        if is_weight or p.suffix in (".json", ".txt", ".jinja", ".model"):
            h.update(str(p.relative_to(base)).encode() + b"\0")
            _hash_file(h, p, full_weights or not is_weight)
    return h.hexdigest()
