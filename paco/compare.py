"""Compare DVC experiments of the pipeline: the paper's ablations and a report on them.

Two commands (console script ``paco-compare``, or ``python -m paco.compare``):

``paco-compare queue ABLATION... [--dry-run]``
    queues one ``dvc exp run --queue -n <name> -S <param>=<value> ... <stage>`` per named ablation
    (:data:`ABLATIONS`; the stage: ``final_samples@<subtask>`` or ``reward_eval``); run them with ``dvc queue start -j 1`` (one worker: the stages use every
    core) and follow them with ``dvc queue status`` / ``dvc queue logs <name>``.

``paco-compare report [--exp NAME ...] [--out DIR] [--log NAME=PATH ...] [--commits N]``
    reads ``dvc exp show --json`` (DVC 3 schema), takes the baseline commit (``HEAD``) and the
    chosen experiments (default: every finished one of ``HEAD``; ``--commits N``: also those run
    on the N-1 commits before it, compared with ``HEAD``), reads each one's plot CSVs and final samples
    from the DVC cache at its revision (``dvc.api.open``) and writes ``DIR/report.md`` (headline
    metrics, differences to the baseline, their significance) and PNG figures.

The ablations (paper sections as in ``README.md``):

=====================  ============================================================  =========
name                   what differs from the baseline                                question
=====================  ============================================================  =========
``resolution``         ``grpo.<subtask>.train.resolution`` = the subtask's eval       Fig. 4 /
                       resolution (full-resolution training; the default trains at     Table 5
                       a lower one: resolution-decoupled)
``aggregation``        ``grpo.<subtask>.aggregation.method=weighted_sum`` (the         Table 5 /
                       default: log-tame, eq. 2-4)                                    Fig. 6
``first_token_weight`` ``reward_train.first_token_weight=0.1`` (paper §3.1 alpha;     Table 2
                       the default weighs the first token like the others)
``cot``                ``labels.teacher.fast=false`` (CoT reasons in the targets; the   Table 2
                       default trains on bare "Yes."/"No.")
=====================  ============================================================  =========

Statistics (all from ``scipy.stats``):

* final samples (``final_samples@<subtask>``: the same prompts and seeds in every experiment, so
  the LoRA samples pair up by ``(prompt_id, seed)``): per sample the weighted reward
  ``sum_k w_k r_k`` with the experiment's ``grpo.<subtask>.rewards`` weights (the definition of
  the trainer's ``reward`` column), experiment minus baseline: a paired t-test (``ttest_rel``)
  and a Wilcoxon signed-rank test (``wilcoxon``), both two-sided;
* training reward: the per-epoch mean training reward of the last ``window`` epochs of
  ``plots/train.csv``, experiment vs baseline: Welch's t-test (``ttest_ind``, ``equal_var=False``,
  two-sided); no pairing exists between epochs of two runs;
* the judge (``reward_eval``): per ranking instance the accuracy of the ``paco_reward`` scorer
  (:func:`paco.judge.metrics.rank_metrics`), paired by ``instance_id``: ``ttest_rel`` and
  ``wilcoxon``.

Reward ratio (our reading of the paper's Fig. 6 "reward ratio", made precise): for each reward
``k`` of ``plots/train.csv``, its standardised growth
``g_k = (mean(k_mean over the last W epochs) - mean(k_mean over the first W epochs)) / k_std(epoch 1)``
(the change of the per-epoch mean, in units of the reward's spread over the first epoch's
samples; scale-free, defined for rewards with negative means such as CLIP-T), and
``ratio = max_k |g_k| / min_k |g_k|``: 1 when every reward grows alike, large when one reward
dominates the optimisation (the imbalance log-tame aggregation is meant to reduce).

Wall time: the plot CSVs hold no timings (they are deterministic outputs), so the seconds per
training epoch come from the trainer's log lines (``epoch e/E: ... | 9.1 s``) of the
``grpo@<subtask>`` stage: ``dvc queue logs <name>`` for queued experiments, or files given with
``--log NAME=PATH`` (e.g. the output of ``dvc repro`` for the baseline). They are absent
(``n/a``) otherwise, and depend on the machine's load.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import yaml

from paco.core.statistics import paired_test, welch_test


class CompareError(RuntimeError):
    """The experiments cannot be compared (none found, a bad ``dvc exp show`` document, an
    unknown ablation or experiment name, samples that do not pair up)."""


class MissingMetricError(CompareError, KeyError):
    """An experiment lacks a metric, a params key or a file the report needs; the message
    names the experiment and the metric."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------------------------
# the ablations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ablation:
    """One of the paper's comparisons as a set of params changes from the baseline.

    ``settings(params, subtask)`` maps the baseline's params (the parsed ``params.yaml``) and a
    subtask key to ``{dotted params key: value}``; ``section`` is the report section holding
    its headline metrics (``grpo`` or ``judge``)."""

    name: str
    paper: str
    section: str
    settings: Callable[[Mapping[str, Any], str], dict[str, Any]]


def _get(params: Mapping[str, Any], dotted: str) -> Any:
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise MissingMetricError(f"params: no key {dotted!r} (missing {part!r})")
        node = node[part]
    return node


def _resolution(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    return {f"grpo.{subtask}.train.resolution": _get(params, f"grpo.{subtask}.eval.resolution")}


def _aggregation(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    _get(params, f"grpo.{subtask}.aggregation.method")
    return {f"grpo.{subtask}.aggregation.method": "weighted_sum"}


def _first_token_weight(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    _get(params, "reward_train.first_token_weight")
    return {"reward_train.first_token_weight": 0.1}


def _cot(params: Mapping[str, Any], subtask: str) -> dict[str, Any]:
    _get(params, "labels.teacher.fast")
    return {"labels.teacher.fast": False}


ABLATIONS: dict[str, Ablation] = {
    a.name: a
    for a in (
        Ablation("resolution", "Fig. 4 / Table 5: full-resolution vs resolution-decoupled training", "grpo",
                 _resolution),
        Ablation("aggregation", "Table 5 / Fig. 6: weighted sum vs log-tame aggregation", "grpo", _aggregation),
        Ablation("first_token_weight", "Table 2: first-token weight alpha = 0.1", "judge", _first_token_weight),
        Ablation("cot", "Table 2: CoT vs fast (bare Yes/No) labels", "judge", _cot),
    )
}


def format_value(value: Any) -> str:
    """A params value as DVC's ``-S key=value`` parses it (YAML scalars: ``true``, ``null``).

    Raises:
        CompareError: a value that is not a scalar (bool, int, float, str, None).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise CompareError(f"params value {value!r} is not a scalar")


def experiment_name(ablation: str, subtask: str) -> str:
    """``<ablation>`` for the t2is subtask and the judge ablations, ``<ablation>-<subtask>`` for
    a GRPO ablation of another subtask (experiment names are unique per baseline)."""
    if ABLATIONS[ablation].section == "grpo" and subtask != "t2is":
        return f"{ablation}-{subtask}"
    return ablation


def default_targets(ablation: str, subtask: str) -> list[str]:
    """The stages an ablation's experiment reproduces (with their upstream): ``final_samples@<subtask>``
    for a GRPO ablation, ``reward_eval`` for a judge ablation (the other subtasks' stages are not
    rerun; their metrics stay the baseline's)."""
    return [f"final_samples@{subtask}"] if ABLATIONS[ablation].section == "grpo" else ["reward_eval"]


def queue_commands(names: Sequence[str], params: Mapping[str, Any], subtask: str = "t2is",
                   targets: Sequence[str] | None = None) -> list[list[str]]:
    """The ``dvc exp run --queue -n <name> -S key=value ... <targets>`` argument lists of the named
    ablations (``targets``: ``None`` for :func:`default_targets`, ``[]`` for the whole pipeline).

    Raises:
        CompareError: no or an unknown ablation name. MissingMetricError: the params lack a key
            the ablation changes (e.g. an unknown subtask).
    """
    if not names:
        raise CompareError(f"no ablation named; choose from {sorted(ABLATIONS)}")
    out = []
    for n in names:
        if n not in ABLATIONS:
            raise CompareError(f"unknown ablation {n!r}; choose from {sorted(ABLATIONS)}")
        cmd = ["dvc", "exp", "run", "--queue", "-n", experiment_name(n, subtask)]
        for key, value in ABLATIONS[n].settings(params, subtask).items():
            cmd += ["-S", f"{key}={format_value(value)}"]
        out.append(cmd + list(default_targets(n, subtask) if targets is None else targets))
    return out


# --------------------------------------------------------------------------------------------
# dvc exp show --json
# --------------------------------------------------------------------------------------------


@dataclass
class Experiment:
    """One row of ``dvc exp show``: the baseline commit or an experiment on it.

    ``params``: dotted key -> value of ``params.yaml``; ``metrics``: metrics file -> its parsed
    JSON; ``outs``: output path -> its DVC hash (``None`` when unknown); ``state``: ``None`` for a
    finished run, else the executor's state (``queued``, ``running``, ``failed``) or ``error``
    when DVC could not read the revision; ``parent``: the commit the experiment was run on (the
    commit itself for a baseline)."""

    name: str
    rev: str
    baseline: bool
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    state: str | None = None
    outs: dict[str, str | None] = field(default_factory=dict)
    parent: str = ""

    def metric(self, path: str, key: str) -> Any:
        """The value at dotted ``key`` of metrics file ``path``.

        Raises:
            MissingMetricError: naming the experiment, file and key."""
        if path not in self.metrics:
            raise MissingMetricError(f"experiment {self.name!r} ({self.rev[:7]}): no metrics file {path} "
                                     f"(has {sorted(self.metrics)})")
        node: Any = self.metrics[path]
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise MissingMetricError(f"experiment {self.name!r} ({self.rev[:7]}): metric {path}:{key} missing")
            node = node[part]
        return node

    def param(self, key: str) -> Any:
        if key not in self.params:
            raise MissingMetricError(f"experiment {self.name!r} ({self.rev[:7]}): params key {key} missing")
        return self.params[key]


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _row(entry: Mapping[str, Any], baseline: bool, name: str | None, state: str | None, parent: str) -> Experiment:
    rev = entry.get("rev")
    if not isinstance(rev, str):
        raise CompareError(f"dvc exp show --json: an entry without a 'rev' string: {str(entry)[:200]}")
    data = entry.get("data") or {}
    params = {}
    for fname, pdata in (data.get("params") or {}).items():
        if fname == "params.yaml" and isinstance(pdata, Mapping):
            params = _flatten(pdata.get("data") or {})
    metrics = {p: (m or {}).get("data") for p, m in (data.get("metrics") or {}).items()
               if isinstance(m, Mapping) and m.get("data") is not None}
    outs = {p: (o.get("hash") if isinstance(o, Mapping) else None) for p, o in (data.get("outs") or {}).items()}
    if entry.get("error") and state is None:
        state = "error"
    return Experiment(name=name or rev[:7], rev=rev, baseline=baseline, params=params, metrics=metrics, state=state,
                      outs=outs, parent=parent or rev)


def parse_exp_show(doc: Any, commits: int = 1) -> list[Experiment]:
    """The baseline commit and its experiments from a ``dvc exp show --json`` document.

    Args:
        doc: the parsed JSON (DVC 3: a list of commit entries ``{rev, name, data: {params,
            metrics, outs, ...}, error, experiments: [{name, executor, revs: [entry]}]}``; the
            first entry is the ``workspace``).
        commits: take the experiments of the first ``commits`` commit entries (``dvc exp show
            -n N``); they are all compared with the first commit (``HEAD``).

    Returns:
        the first commit entry (``HEAD``; ``baseline=True``) followed by the experiments in the
        document's order (newest first; an experiment name met again on an older commit is
        skipped); the workspace is left out.

    Raises:
        CompareError: not a DVC 3 document (e.g. DVC 2's dict of revisions) or no commit entry.
    """
    if not isinstance(doc, list):
        raise CompareError("dvc exp show --json: expected a list of revisions (DVC 3 schema), got "
                           f"{type(doc).__name__}; is DVC older than 3.0?")
    if commits < 1:
        raise CompareError(f"commits must be >= 1, got {commits}")
    entries = [e for e in doc if isinstance(e, Mapping) and e.get("rev") != "workspace"]
    if not entries:
        raise CompareError("dvc exp show --json: no commit (baseline) entry; commit dvc.lock first")
    base = entries[0]
    out = [_row(base, True, base.get("name") or "baseline", None, str(base.get("rev", "")))]
    seen = set()
    for commit in entries[:commits]:
        for exp in commit.get("experiments") or []:
            revs = exp.get("revs") or []
            name = exp.get("name") or (revs[0].get("name") if revs else None)
            if not revs or name in seen:
                continue
            seen.add(name)
            executor = exp.get("executor") or {}
            state = executor.get("state") if isinstance(executor, Mapping) else None
            out.append(_row(revs[0], False, name, None if state in (None, "success") else state,
                            str(commit.get("rev", ""))))
    return out


def exp_show(repo: str | Path = ".", commits: int = 1) -> list[Experiment]:
    """Run ``dvc exp show --json -n <commits>`` in ``repo`` and parse it (:func:`parse_exp_show`).

    Raises:
        CompareError: dvc failed or printed no JSON."""
    res = subprocess.run(["dvc", "exp", "show", "--json", "-n", str(commits)], cwd=repo, capture_output=True, text=True)
    if res.returncode != 0:
        raise CompareError(f"dvc exp show --json failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    text = res.stdout
    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    if start < 0:
        raise CompareError(f"dvc exp show --json printed no JSON: {text[:200]!r}")
    return parse_exp_show(json.loads(text[start:]), commits)


def select(experiments: Sequence[Experiment], names: Sequence[str] | None) -> list[Experiment]:
    """The baseline and the named experiments (default: every finished one).

    Raises:
        CompareError: no finished experiment, or a named one that is unknown or not finished."""
    base = [e for e in experiments if e.baseline]
    exps = [e for e in experiments if not e.baseline]
    if not base:
        raise CompareError("no baseline commit among the experiments")
    if names:
        by_name = {e.name: e for e in exps}
        chosen = []
        for n in names:
            if n not in by_name:
                raise CompareError(f"no experiment named {n!r}; dvc exp show lists {sorted(by_name)}")
            if by_name[n].state is not None:
                raise CompareError(f"experiment {n!r} is {by_name[n].state}, not finished")
            chosen.append(by_name[n])
    else:
        chosen = [e for e in exps if e.state is None]
    if not chosen:
        raise CompareError("no finished experiments to compare; queue some with `paco-compare queue ...` "
                           "and run them with `dvc queue start -j 1`")
    return [base[0], *chosen]


def changed_params(exp: Experiment, base: Experiment) -> dict[str, Any]:
    """The params keys whose value differs from the baseline's (dotted key -> experiment value)."""
    keys = sorted(set(exp.params) | set(base.params))
    return {k: exp.params.get(k) for k in keys if exp.params.get(k) != base.params.get(k)}


# --------------------------------------------------------------------------------------------
# reading outputs at a revision
# --------------------------------------------------------------------------------------------


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


def read_parquet(repo: str | Path, exp: Experiment, path: str, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """A Parquet table at the experiment's revision; only ``columns`` (all when ``None``) are decoded.

    Raises:
        MissingMetricError: the file is unreadable or lacks one of ``columns`` (named)."""
    import pyarrow.parquet as pq

    buf = io.BytesIO(read_bytes(repo, exp.rev, path, exp.name))
    if columns is not None:
        names = pq.read_schema(buf).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise MissingMetricError(f"experiment {exp.name!r}: {path}: column(s) {missing} missing (has {names})")
        buf.seek(0)
    return pd.read_parquet(buf, columns=list(columns) if columns is not None else None)


def _need(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise MissingMetricError(f"{what}: column(s) {missing} missing (has {list(df.columns)})")


def reward_names(train: pd.DataFrame) -> list[str]:
    """The reward names of a ``plots/train.csv`` (columns ``<k>_mean`` with a ``<k>_std``)."""
    return sorted(c[:-5] for c in train.columns
                  if c.endswith("_mean") and f"{c[:-5]}_std" in train.columns and c != "advantage_abs_mean")


def standardised_growth(train: pd.DataFrame, window: int) -> dict[str, float]:
    """``g_k`` of the module docstring per reward of a ``plots/train.csv`` (epochs sorted).

    Raises:
        MissingMetricError: no reward columns. ValueError: fewer than ``2 * window`` epochs,
            ``window < 1`` or a zero first-epoch std."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    t = train.sort_values("epoch")
    if len(t) < 2 * window:
        raise ValueError(f"reward ratio: {len(t)} epochs, need >= 2 x window = {2 * window}")
    names = reward_names(t)
    if not names:
        raise MissingMetricError(f"train.csv: no <reward>_mean / <reward>_std columns (has {list(t.columns)})")
    out = {}
    for k in names:
        sd = float(t[f"{k}_std"].iloc[0])
        if not sd > 0:
            raise ValueError(f"reward ratio: {k}_std of the first epoch is {sd}; cannot standardise")
        out[k] = (float(t[f"{k}_mean"].iloc[-window:].mean()) - float(t[f"{k}_mean"].iloc[:window].mean())) / sd
    return out


def reward_ratio(growth: Mapping[str, float]) -> float:
    """``max_k |g_k| / min_k |g_k|`` (``inf`` when a reward did not move at all).

    Raises:
        ValueError: fewer than 2 rewards."""
    if len(growth) < 2:
        raise ValueError(f"reward ratio needs >= 2 rewards, got {sorted(growth)}")
    mags = [abs(v) for v in growth.values()]
    return math.inf if min(mags) == 0 else max(mags) / min(mags)


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


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


@dataclass
class GrpoData:
    exp: Experiment
    train: pd.DataFrame
    eval: pd.DataFrame
    lora: pd.DataFrame  # final samples with the LoRA, indexed by (prompt_id, seed): weighted + per reward
    weights: dict[str, float]
    seconds: dict[int, float]


def _weights(exp: Experiment, subtask: str) -> dict[str, float]:
    prefix = f"grpo.{subtask}.rewards."
    w = {k[len(prefix):]: float(v) for k, v in exp.params.items() if k.startswith(prefix)}
    if not w:
        raise MissingMetricError(f"experiment {exp.name!r}: params grpo.{subtask}.rewards missing")
    return w


def load_grpo(repo: str | Path, exp: Experiment, subtask: str, logs: Mapping[str, str]) -> GrpoData:
    """Read one experiment's GRPO curves, final LoRA samples and (if any) epoch timings."""
    base = f"data/grpo/{subtask}/plots"
    train = read_csv(repo, exp, f"{base}/train.csv")
    ev = read_csv(repo, exp, f"{base}/eval.csv")
    _need(train, ["epoch", "reward"], f"experiment {exp.name!r}: {base}/train.csv")
    _need(ev, ["epoch", "reward"], f"experiment {exp.name!r}: {base}/eval.csv")
    weights = _weights(exp, subtask)
    path = f"data/final_samples/{subtask}/samples.parquet"
    cols = [f"reward_{k}" for k in weights]
    s = read_parquet(repo, exp, path, columns=["prompt_id", "seed", "variant", *cols])
    lora = s[s["variant"] == "lora"].set_index(["prompt_id", "seed"]).sort_index()[cols]
    if lora.index.duplicated().any():
        raise CompareError(f"experiment {exp.name!r}: {path} has duplicate (prompt_id, seed) LoRA samples")
    lora = lora.rename(columns=lambda c: c[len("reward_"):])
    lora["reward"] = sum(w * lora[k] for k, w in weights.items())
    text = logs.get(exp.name)
    seconds = epoch_seconds(text, f"grpo@{subtask}") if text else {}
    return GrpoData(exp, train.sort_values("epoch"), ev.sort_values("epoch"), lora, weights, seconds)


def queue_log(repo: str | Path, name: str) -> str | None:
    """``dvc queue logs <name>`` output, or ``None`` when DVC has none (e.g. a workspace run)."""
    res = subprocess.run(["dvc", "queue", "logs", name], cwd=repo, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 and res.stdout.strip() else None


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if x != 0 and abs(x) < 10 ** -(digits - 1):
            return f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def _signed(x: float | None) -> str:
    return "n/a" if x is None else ("+" if x >= 0 else "") + _fmt(x)


def _pval(p: float | None) -> str:
    if p is None:
        return "n/a"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def _changed(exp: Experiment, base: Experiment) -> str:
    if exp.baseline:
        return "(baseline)"
    ch = changed_params(exp, base)
    return ", ".join(f"`{k}={format_value(v) if not isinstance(v, (list, dict)) else v}`" for k, v in ch.items()) or "(none)"


def grpo_section(repo: str | Path, exps: Sequence[Experiment], subtask: str, window: int,
                 logs: Mapping[str, str]) -> tuple[list[str], list[GrpoData], dict[str, Any]]:
    """The GRPO tables (markdown lines), the loaded data and the figures as a dict."""
    base = exps[0]
    mpath = f"data/grpo/{subtask}/metrics.json"
    data = [load_grpo(repo, e, subtask, logs) for e in exps]
    b = data[0]
    for d in data[1:]:
        if not d.lora.index.equals(b.lora.index):
            raise CompareError(f"experiment {d.exp.name!r}: its final samples' (prompt_id, seed) differ from the "
                               f"baseline's; final_samples.{subtask} params must match to pair them")
    results: dict[str, Any] = {}
    lines = [
        f"### GRPO `{subtask}`: headline metrics",
        "",
        f"Differences are experiment minus baseline `{base.name}`. Final samples: LoRA samples of the same "
        f"{len(b.lora)} (prompt, seed) pairs, weighted reward `sum_k w_k r_k`; p from a paired t-test / "
        f"Wilcoxon signed-rank test. Train reward: mean of the per-epoch training reward over the last "
        f"{window} epochs (at the experiment's training resolution), Welch t-test on those epochs. "
        "Reward ratio: max/min standardised growth of the reward components (module docstring of "
        "`paco.compare`). s / epoch: mean seconds per training epoch in the trainer's log lines "
        "(`dvc queue logs` or `--log`; they depend on the machine's load).",
        "",
        "| experiment | changed params | eval reward | Δ eval | final-sample reward | Δ | p (t) | p (Wilcoxon) "
        "| train reward (last epochs) | Δ | p (Welch) | s / epoch | reward ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    b_eval = float(base.metric(mpath, "eval_reward"))
    b_last = b.train["reward"].iloc[-window:].to_numpy()
    for d in data:
        e = d.exp
        ev = float(e.metric(mpath, "eval_reward"))
        fs = paired_test(d.lora["reward"].to_numpy(), b.lora["reward"].to_numpy()) if not e.baseline else None
        last = d.train["reward"].iloc[-window:].to_numpy()
        wt = welch_test(last, b_last) if not e.baseline else None
        growth = standardised_growth(d.train, window)
        ratio = reward_ratio(growth)
        sec = float(np.mean(list(d.seconds.values()))) if d.seconds else None
        results[e.name] = {"eval_reward": ev, "eval_diff": None if e.baseline else ev - b_eval,
                           "final_reward": float(d.lora["reward"].mean()), "final": fs,
                           "train_last": float(last.mean()), "train": wt, "seconds_per_epoch": sec,
                           "growth": growth, "reward_ratio": ratio}
        lines.append(
            f"| {e.name} | {_changed(e, base)} | {_fmt(ev)} | {'' if e.baseline else _signed(ev - b_eval)} "
            f"| {_fmt(float(d.lora['reward'].mean()))} | {'' if fs is None else _signed(fs['mean_diff'])} "
            f"| {'' if fs is None else _pval(fs['t_p'])} | {'' if fs is None else _pval(fs['wilcoxon_p'])} "
            f"| {_fmt(float(last.mean()))} | {'' if wt is None else _signed(wt['mean_diff'])} "
            f"| {'' if wt is None else _pval(wt['p'])} | {_fmt(sec, 2)} | {_fmt(ratio, 2)} |")
    rewards = list(b.weights)
    lines += ["", f"### GRPO `{subtask}`: final samples per reward (LoRA, paired with the baseline)", "",
              "| experiment | " + " | ".join(f"{k} | Δ | p (t)" for k in rewards) + " |",
              "|---|" + "---|---|---|" * len(rewards)]
    for d in data:
        cells = []
        for k in rewards:
            if d.exp.baseline:
                cells += [_fmt(float(d.lora[k].mean())), "", ""]
            else:
                t = paired_test(d.lora[k].to_numpy(), b.lora[k].to_numpy())
                cells += [_fmt(float(d.lora[k].mean())), _signed(t["mean_diff"]), _pval(t["t_p"])]
                results[d.exp.name].setdefault("final_per_reward", {})[k] = t
        lines.append(f"| {d.exp.name} | " + " | ".join(cells) + " |")
    lines += ["", f"### GRPO `{subtask}`: standardised growth per reward (last vs first {window} epochs)", "",
              "| experiment | " + " | ".join(reward_names(b.train)) + " | reward ratio |",
              "|---|" + "---|" * (len(reward_names(b.train)) + 1)]
    for d in data:
        g = results[d.exp.name]["growth"]
        lines.append(f"| {d.exp.name} | " + " | ".join(_signed(g[k]) for k in reward_names(b.train))
                     + f" | {_fmt(results[d.exp.name]['reward_ratio'], 2)} |")
    return lines, data, results


def judge_section(repo: str | Path, exps: Sequence[Experiment]) -> tuple[list[str], dict[str, Any]]:
    """The judge (``reward_eval``) table: ConsistencyRank accuracy / Kendall tau of ``paco_reward``
    and the per-instance paired tests of the accuracy against the baseline."""
    from paco.judge.metrics import rank_metrics

    mpath, ppath = "data/reward_eval/metrics.json", "data/reward_eval/predictions.parquet"
    per: dict[str, pd.Series] = {}
    for e in exps:
        p = read_parquet(repo, e, ppath, columns=["instance_id", "scorer", "predicted_order", "reference_order"])
        p = p[p["scorer"] == "paco_reward"]
        if p.empty:
            raise MissingMetricError(f"experiment {e.name!r}: {ppath} has no paco_reward predictions")
        per[e.name] = pd.Series([rank_metrics(list(r.predicted_order), list(r.reference_order))["accuracy"]
                                 for r in p.itertuples(index=False)], index=p["instance_id"].to_numpy()).sort_index()
    base = exps[0]
    results: dict[str, Any] = {}
    lines = ["### Judge (`reward_eval`, ConsistencyRank, scorer `paco_reward`)", "",
             "Accuracy differences are paired over the same ranking instances (t-test / Wilcoxon).", "",
             "| experiment | changed params | accuracy | Kendall tau | Δ accuracy | p (t) | p (Wilcoxon) |",
             "|---|---|---|---|---|---|---|"]
    for e in exps:
        acc = float(e.metric(mpath, "judges.paco_reward.accuracy"))
        tau = float(e.metric(mpath, "judges.paco_reward.kendall_tau"))
        t = None
        if not e.baseline:
            if not per[e.name].index.equals(per[base.name].index):
                raise CompareError(f"experiment {e.name!r}: its ranking instances differ from the baseline's")
            t = paired_test(per[e.name].to_numpy(), per[base.name].to_numpy())
        results[e.name] = {"accuracy": acc, "kendall_tau": tau, "paired": t}
        lines.append(f"| {e.name} | {_changed(e, base)} | {_fmt(acc)} | {_fmt(tau)} "
                     f"| {'' if t is None else _signed(t['mean_diff'])} | {'' if t is None else _pval(t['t_p'])} "
                     f"| {'' if t is None else _pval(t['wilcoxon_p'])} |")
    return lines, results


def plot_grpo(data: Sequence[GrpoData], window: int, out: Path, subtask: str) -> list[str]:
    """Write ``reward_curves.png`` (training and eval reward per epoch), ``reward_growth.png``
    (standardised growth of each reward per epoch: the Fig. 6 view) and, when any experiment has
    timings, ``eval_vs_wall_time.png``. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    for d in data:
        ax[0].plot(d.train["epoch"], d.train["reward"], label=d.exp.name)
        ax[1].plot(d.eval["epoch"], d.eval["reward"], marker="o", label=d.exp.name)
    ax[0].set(title=f"{subtask}: training reward (train resolution)", xlabel="epoch", ylabel="weighted reward")
    ax[1].set(title=f"{subtask}: eval reward (eval resolution)", xlabel="epoch", ylabel="weighted reward")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward_curves.png")
    plt.close(fig)
    written.append("reward_curves.png")

    names = reward_names(data[0].train)
    fig, ax = plt.subplots(1, len(names), figsize=(3 * len(names), 3), dpi=100, squeeze=False)
    for i, k in enumerate(names):
        for d in data:
            t = d.train
            g = (t[f"{k}_mean"] - t[f"{k}_mean"].iloc[:window].mean()) / float(t[f"{k}_std"].iloc[0])
            ax[0, i].plot(t["epoch"], g, label=d.exp.name)
        ax[0, i].axhline(0, color="grey", lw=0.5)
        ax[0, i].set(title=k, xlabel="epoch", ylabel="growth (first-epoch std)" if i == 0 else None)
    ax[0, -1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward_growth.png")
    plt.close(fig)
    written.append("reward_growth.png")

    timed = [d for d in data if d.seconds]
    if timed:
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        for d in timed:
            cum = np.cumsum([d.seconds.get(e, np.nan) for e in range(1, int(d.eval["epoch"].max()) + 1)])
            x = [0.0 if e == 0 else cum[int(e) - 1] for e in d.eval["epoch"]]
            ax.plot(x, d.eval["reward"], marker="o", label=d.exp.name)
        ax.set(title=f"{subtask}: eval reward vs training wall time", xlabel="training seconds (logged epochs)",
               ylabel="weighted reward")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "eval_vs_wall_time.png")
        plt.close(fig)
        written.append("eval_vs_wall_time.png")
    return written


def report(repo: str | Path = ".", names: Sequence[str] | None = None, out: str | Path = "compare",
           subtask: str = "t2is", window: int = 5, sections: Sequence[str] | None = None,
           logs: Mapping[str, str] | None = None, experiments: Sequence[Experiment] | None = None,
           commits: int = 1) -> Path:
    """Write ``out/report.md`` and the PNGs comparing the baseline with the chosen experiments.

    Args:
        repo: the DVC repository (git work tree root).
        names: experiment names (``None``: every finished experiment of ``HEAD``).
        out: output folder (created).
        subtask: the GRPO subtask whose stages are compared.
        window: epochs at each end of the training curve (train-reward test and reward ratio).
        sections: ``grpo`` and/or ``judge``; ``None``: each whose metrics file the baseline has.
        logs: experiment name -> log text (epoch timings); queued experiments' logs are read with
            ``dvc queue logs`` when not given.
        experiments: parsed ``dvc exp show`` rows (``None``: run it).
        commits: also the experiments of the last ``commits`` commits (compared with ``HEAD``).

    A section leaves out the experiments whose section output (``final_samples`` samples,
    ``reward_eval`` predictions) has the baseline's DVC hash (they did not change it) or is not
    among their outputs (a stage not in their ``dvc.lock``); the report says which.

    Returns:
        the path of ``report.md``.

    Raises:
        CompareError / MissingMetricError: see :func:`select`, :meth:`Experiment.metric`.
    """
    exps = select(experiments if experiments is not None else exp_show(repo, commits), names)
    base = exps[0]
    known = {"grpo": f"data/grpo/{subtask}/metrics.json", "judge": "data/reward_eval/metrics.json"}
    if sections is None:
        sections = [s for s, p in known.items() if p in base.metrics]
        if not sections:
            raise MissingMetricError(f"baseline {base.name!r}: none of the metrics files {sorted(known.values())}; "
                                     "run `dvc repro` and commit dvc.lock first")
    for s in sections:
        if s not in known:
            raise CompareError(f"unknown section {s!r}; choose from {sorted(known)}")
    logs = dict(logs or {})
    if "grpo" in sections:
        for e in exps:
            if e.name not in logs and not e.baseline:
                text = queue_log(repo, e.name)
                if text:
                    logs[e.name] = text
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Experiment comparison", "",
             f"Baseline `{base.name}` ({base.rev[:7]}); experiments: "
             + ", ".join(f"`{e.name}` ({e.rev[:7]}" + ("" if e.parent == base.rev else f", run on {e.parent[:7]}")
                         + ")" for e in exps[1:]) + ".", ""]
    summary: dict[str, Any] = {"baseline": base.name, "experiments": [e.name for e in exps[1:]]}
    keys = {"grpo": f"data/final_samples/{subtask}/samples.parquet", "judge": "data/reward_eval/predictions.parquet"}

    def changed(section: str) -> list[Experiment]:
        key = keys[section]
        same = [e for e in exps[1:] if e.outs.get(key) is not None and e.outs.get(key) == base.outs.get(key)]
        absent = [e for e in exps[1:] if e.outs and e.outs.get(key) is None]  # no hash: not in its dvc.lock
        if same:
            lines.extend([f"Section {section}: left out " + ", ".join(f"`{e.name}`" for e in same)
                          + f" (`{key}` identical to the baseline's).", ""])
        if absent:
            lines.extend([f"Section {section}: left out " + ", ".join(f"`{e.name}`" for e in absent)
                          + f" (no `{key}` in its dvc.lock).", ""])
        return [base, *(e for e in exps[1:] if e not in same and e not in absent)]

    if "grpo" in sections and len(g := changed("grpo")) > 1:
        glines, data, res = grpo_section(repo, g, subtask, window, logs)
        lines += glines + [""]
        figs = plot_grpo(data, window, out, subtask)
        lines += [f"![{f}]({f})" for f in figs] + [""]
        summary["grpo"] = res
    if "judge" in sections and len(j := changed("judge")) > 1:
        jlines, res = judge_section(repo, j)
        lines += jlines + [""]
        summary["judge"] = res
    (out / "report.md").write_text("\n".join(lines))
    (out / "report.json").write_text(json.dumps(summary, indent=2, default=float))
    return out / "report.md"


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paco-compare", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("queue", help="queue the named ablations as DVC experiments")
    q.add_argument("ablations", nargs="+", help=f"any of {sorted(ABLATIONS)}")
    q.add_argument("--subtask", default="t2is")
    q.add_argument("--params", default="params.yaml")
    q.add_argument("--dry-run", action="store_true", help="print the commands only")
    q.add_argument("--target", action="append", dest="targets",
                   help="stage to reproduce (repeatable; default final_samples@<subtask> or reward_eval)")
    q.add_argument("--all-stages", action="store_true", help="reproduce the whole pipeline")
    r = sub.add_parser("report", help="compare the baseline with experiments")
    r.add_argument("--exp", action="append", dest="names", help="experiment name (repeatable; default all)")
    r.add_argument("--out", default="compare")
    r.add_argument("--subtask", default="t2is")
    r.add_argument("--window", type=int, default=5)
    r.add_argument("--section", action="append", dest="sections", choices=["grpo", "judge"])
    r.add_argument("--log", action="append", default=[], metavar="NAME=PATH",
                   help="a run's log (epoch timings), e.g. the baseline's `dvc repro` output")
    r.add_argument("--repo", default=".")
    r.add_argument("--commits", type=int, default=1,
                   help="also the experiments of the last N commits (dvc exp show -n N), compared with HEAD")
    a = ap.parse_args(argv)
    try:
        if a.command == "queue":
            params = yaml.safe_load(Path(a.params).read_text())
            targets = [] if a.all_stages else a.targets
            for cmd in queue_commands(a.ablations, params, a.subtask, targets):
                print(shlex.join(cmd))
                if not a.dry_run:
                    subprocess.run(cmd, check=True)
            if not a.dry_run:
                print("run them with: dvc queue start -j 1   (then: dvc queue status; paco-compare report)")
            return 0
        logs = {}
        for item in a.log:
            name, sep, path = item.partition("=")
            if not sep:
                raise CompareError(f"--log expects NAME=PATH, got {item!r}")
            logs[name] = Path(path).read_text(errors="replace")
        path = report(a.repo, a.names, a.out, a.subtask, a.window, a.sections, logs, commits=a.commits)
        print(f"wrote {path}")
        return 0
    except (CompareError, subprocess.CalledProcessError, OSError) as exc:
        print(f"paco-compare: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
