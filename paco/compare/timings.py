"""Seconds per GRPO training epoch from the trainer's log lines (``epoch e/E: ... | 9.1 s``).

The plot CSVs hold no timings (``plots/train.csv`` rows are deterministic figures only: the GRPO
trainer's ``epoch_row``), and the trainer's per-epoch ``epoch_seconds`` go to the stage's
``report.json``, a cached DVC output that is not in git (reading it at an experiment's revision
means checking the experiment out); so the timings come from a run's log: ``dvc queue logs <name>`` (:func:`queue_log`) or a file given with
``--log NAME=PATH``.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path


_STAGE = re.compile(r"Running stage '([^']+)'")
_EPOCH = re.compile(r"\bepoch (\d+)/(\d+): reward .*\|\s*([0-9.]+) s\s*$")


def epoch_seconds(log_text: str, stage: str) -> dict[int, float]:
    """Seconds per training epoch from the trainer's log lines (``epoch e/E: reward ... | 9.1 s``)
    inside ``Running stage '<stage>'`` of a ``dvc repro`` / ``dvc exp run`` output. A text without
    any ``Running stage`` line (a bare stage log) counts entirely. A later run of the same stage
    in the text overrides an earlier one's epochs.

    Returns:
        epoch (1-based) -> seconds; empty when the log holds none."""
    has_stages = _STAGE.search(log_text) is not None
    current = None
    out: dict[int, float] = {}
    for line in log_text.splitlines():
        m = _STAGE.search(line)
        if m:
            current = m.group(1)
            continue
        if has_stages and current != stage:
            continue
        m = _EPOCH.search(line)
        if m:
            out[int(m.group(1))] = float(m.group(3))
    return out


def queue_log(repo: str | Path, name: str) -> str | None:
    """``dvc queue logs <name>`` output, or ``None`` when DVC has none (e.g. a workspace run)."""
    res = subprocess.run(["dvc", "queue", "logs", name], cwd=repo, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 and res.stdout.strip() else None
