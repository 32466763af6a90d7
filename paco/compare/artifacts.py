"""An experiment's outputs at its revision (DVC cache, ``dvc.api.open``): plot CSVs, Parquet tables,
and the GRPO curves and final samples one report row needs (:func:`load_grpo`)."""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from paco.compare.errors import CompareError, MissingMetricError
from paco.compare.experiments import Experiment
from paco.compare.timings import epoch_seconds


def read_bytes(repo: str | Path, rev: str, path: str, who: str) -> bytes:
    """``path`` as committed (DVC-tracked: from the cache) at ``rev``.

    Raises:
        MissingMetricError: naming ``who`` (the experiment) and ``path``."""
    import dvc.api

    try:
        with dvc.api.open(path, repo=str(repo), rev=rev, mode="rb") as f:
            return f.read()
    except Exception as exc:  # dvc raises PathMissingError, FileNotFoundError, OutputNotFoundError...
        raise MissingMetricError(f"experiment {who!r} ({rev[:7]}): cannot read {path}: "
                                 f"{type(exc).__name__}: {exc}") from exc


def read_csv(repo: str | Path, exp: Experiment, path: str) -> pd.DataFrame:
    return pd.read_csv(io.BytesIO(read_bytes(repo, exp.rev, path, exp.name)))


def read_parquet(repo: str | Path, exp: Experiment, path: str, columns: Sequence[str] | None = None, *,
                 optional_prefix: str | None = None) -> pd.DataFrame:
    """A Parquet table at the experiment's revision; only ``columns`` (all when ``None``) are decoded,
    and with ``optional_prefix`` also every column whose name starts with it (none is required).

    Raises:
        MissingMetricError: the file is unreadable or lacks one of ``columns`` (named)."""
    import pyarrow.parquet as pq

    buf = io.BytesIO(read_bytes(repo, exp.rev, path, exp.name))
    if columns is not None:
        names = pq.read_schema(buf).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise MissingMetricError(f"experiment {exp.name!r}: {path}: column(s) {missing} missing (has {names})")
        if optional_prefix is not None:
            columns = [*columns, *(n for n in names if n.startswith(optional_prefix) and n not in columns)]
        buf.seek(0)
    return pd.read_parquet(buf, columns=list(columns) if columns is not None else None)


def _need(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise MissingMetricError(f"{what}: column(s) {missing} missing (has {list(df.columns)})")


@dataclass
class GrpoData:
    """One experiment's GRPO data: ``plots/train.csv`` and ``plots/eval.csv`` (sorted by epoch), its
    LoRA final samples, the ``grpo.<subtask>.rewards`` weights and the logged seconds per epoch
    (epoch, 1-based -> seconds; empty without a log)."""

    exp: Experiment
    train: pd.DataFrame
    eval: pd.DataFrame
    lora: pd.DataFrame  # final samples with the LoRA, indexed by (prompt_id, seed): weighted + per reward
    weights: dict[str, float]
    seconds: dict[int, float]
    monitors: pd.DataFrame  # the same samples' reward-hacking monitors (paco.grpo.monitors); no columns: none


def _weights(exp: Experiment, subtask: str) -> dict[str, float]:
    prefix = f"grpo.{subtask}.rewards."
    w = {k[len(prefix):]: float(v) for k, v in exp.params.items() if k.startswith(prefix)}
    if not w:
        raise MissingMetricError(f"experiment {exp.name!r}: params grpo.{subtask}.rewards missing")
    return w


def load_grpo(repo: str | Path, exp: Experiment, subtask: str, logs: Mapping[str, str],
              weights: Mapping[str, float] | None = None) -> GrpoData:
    """Read one experiment's GRPO curves, final LoRA samples (with their monitors, if any) and (if
    any) epoch timings. The final-sample reward is ``sum_k w_k r_k`` over ``weights`` (default: the
    experiment's own ``grpo.<subtask>.rewards``; the report passes the baseline's, so that an
    experiment that adds a guard reward is scored with the same formula)."""
    base = f"data/grpo/{subtask}/plots"
    train = read_csv(repo, exp, f"{base}/train.csv")
    ev = read_csv(repo, exp, f"{base}/eval.csv")
    _need(train, ["epoch", "reward"], f"experiment {exp.name!r}: {base}/train.csv")
    _need(ev, ["epoch", "reward"], f"experiment {exp.name!r}: {base}/eval.csv")
    weights = dict(_weights(exp, subtask) if weights is None else weights)
    path = f"data/final_samples/{subtask}/samples.parquet"
    cols = [f"reward_{k}" for k in weights]
    s = read_parquet(repo, exp, path, columns=["prompt_id", "seed", "variant", *cols], optional_prefix="monitor_")
    lora = s[s["variant"] == "lora"].set_index(["prompt_id", "seed"]).sort_index()
    if lora.index.duplicated().any():
        raise CompareError(f"experiment {exp.name!r}: {path} has duplicate (prompt_id, seed) LoRA samples")
    monitors = lora[[c for c in lora.columns if c.startswith("monitor_")]].rename(
        columns=lambda c: c[len("monitor_"):])
    lora = lora[cols].rename(columns=lambda c: c[len("reward_"):])
    lora["reward"] = sum(w * lora[k] for k, w in weights.items())
    text = logs.get(exp.name)
    seconds = epoch_seconds(text, f"grpo@{subtask}") if text else {}
    return GrpoData(exp, train.sort_values("epoch"), ev.sort_values("epoch"), lora, weights, seconds, monitors)
