"""The pipeline's DVC experiments as :class:`Experiment` rows: listing, parsing, choosing.

:func:`exp_show` lists the baseline commit and its experiments the way ``dvc exp show --json``
does, in-process (DVC's ``Repo.experiments.show``, the call behind both that command and
``dvc.api.exp_show``); :func:`parse_exp_show` maps that document (DVC 3 schema) to
:class:`Experiment` rows; :func:`select` picks the baseline and the experiments to compare.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from paco.compare.errors import CompareError, MissingMetricError
from paco.core.dotted import get_dotted


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
        try:
            return get_dotted(self.metrics[path], key)
        except KeyError:
            raise MissingMetricError(f"experiment {self.name!r} ({self.rev[:7]}): metric {path}:{key} missing") from None

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
    """The baseline commit and its experiments of ``repo``, as ``dvc exp show --json -n <commits>``
    lists them (:func:`parse_exp_show`), read in-process with DVC's ``Repo.experiments.show``.

    (``dvc.api.exp_show`` calls the same method but returns its rendered table: short revisions,
    the branch name for a commit, values as display strings, metrics without their file and no
    output hashes, too little to pair experiments; hence the serialised states, ``ExpState.dumpd``,
    which are the documents ``dvc exp show --json`` prints.)

    Raises:
        CompareError: ``commits < 1``, ``repo`` is not a DVC repository or DVC cannot list its
            experiments (the message names the repository and DVC's error)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    if commits < 1:
        raise CompareError(f"commits must be >= 1, got {commits}")
    try:
        with Repo(str(repo)) as dvc_repo:
            states = dvc_repo.experiments.show(num=commits)
    except DvcException as exc:
        raise CompareError(f"cannot list the experiments of {str(repo)!r} (dvc exp show): "
                           f"{type(exc).__name__}: {exc}") from exc
    return parse_exp_show([state.dumpd() for state in states], commits)



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
