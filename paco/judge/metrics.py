"""Ranking metrics for ConsistencyRank-style evaluation (paper §4, Table 2); their chance levels.

An *instance* is one reference image and ``n`` candidates; an *order* is the list of candidate
ids from most to least consistent with the reference. A judge's predicted order is compared
with the reference (human / ground-truth) order.

Two families of correlation are reported, because the released evaluation code does not use
the textbook definition:

Reference-code definition (``kendall_tau``, ``spearman_rho``)
    ``PaCo-Reward/evaluation/Consistency_Rank/eval_vllm.py`` in X-GenGroup/PaCo-RL builds, per
    instance, two lists of candidate *indices* (index = position of the file in the item's
    ``comp_images`` list)::

        pred_rank = np.argsort(scores)[::-1].tolist()          # indices, best first
        gt_rank   = [comp_images.index(img) for img in rank_images]   # indices, best first

    and calls ``scipy.stats.kendalltau(pred_rank, gt_rank)`` and
    ``scipy.stats.spearmanr(pred_rank, gt_rank)`` on them. Both lists are *orders*
    (position -> candidate index), so the correlation is taken over positions between the
    candidate labels found there. Writing the orders as permutations ``p`` and ``g``
    (position -> label), this is the correlation of the *inverse* permutations of the rank
    vectors. It therefore depends on how the candidates are labelled (the order of
    ``comp_images``): relabelling the candidates changes it, while accuracy, top-1 / bottom-1
    and the rank-vector correlations do not change.

Rank-vector definition (``kendall_tau_ranks``, ``spearman_rho_ranks``)
    For each candidate, its position in the predicted order vs its position in the reference
    order; tau / rho between those two rank vectors (invariant to candidate labelling). This
    is the usual meaning of "Kendall tau between two rankings".

When they coincide and when they differ
    Kendall: the reference-code tau counts the inversions of ``p o g^-1``; the rank-vector tau
    counts the inversions of ``g^-1 o p``. Spearman: the reference-code rho uses
    ``sum_k (p(k) - g(k))^2`` and the rank-vector rho uses ``sum_c (p^-1(c) - g^-1(c))^2``.
    Both pairs are equal when the reference order (or the predicted one) is the identity
    ``[0, 1, ..., n-1]`` in the labelling used (so pred ``[1, 2, 0, 3]`` vs ref
    ``[0, 1, 2, 3]`` gives tau 1/3, rho 0.4 under both), and for identical orders (both 1).
    They differ in general (Kendall differs for 8 of the 36 (pred, ref) pairs with 3
    candidates and 296 of the 576 with 4): e.g. pred ``[0, 1, 3, 2]`` vs ref ``[0, 2, 3, 1]``
    gives reference-code tau 2/3, rho 0.8 but rank-vector tau 0, rho 0.2. Notably a predicted
    order that is the exact reverse of the reference always has rank-vector tau = rho = -1,
    but the reference-code values need not be: pred ``[0, 2, 1]`` vs ref ``[1, 2, 0]`` gives
    reference-code tau 1/3, rho 0.5 (and pred ``[3, 2, 0, 1]`` vs ref ``[1, 0, 2, 3]`` gives
    tau -1/3, rho -0.6). Under the null of a uniformly random predicted order both have
    expectation 0.

Accuracy and top-1 / bottom-1 follow the reference code exactly: ``accuracy`` is the
fraction of positions where the two orders hold the same candidate (``sum(p == g) / n``),
``top1_accuracy`` / ``bottom1_accuracy`` compare the first / last entries and
``top1_bottom1`` is their mean. The reference code also reports a footrule distance
``sum_c |pos_ref(c) - pos_pred(c)|`` (rank-vector based), given here as
``footrule_distance``.

Tie handling differs from the reference code on purpose: ``np.argsort(scores)[::-1]`` puts
the *higher* index first among equal scores (with the default, non-stable quicksort that is
not even guaranteed); ``order_from_scores`` puts the lower index first, deterministically.

Chance levels (uniformly random predicted order, ``n`` candidates; see ``chance_levels``):
expected accuracy ``1/n``, top-1 ``1/n``, bottom-1 ``1/n``, top1_bottom1 ``1/n`` and expected
tau / rho ``0`` under both definitions. For ``n = 4``: accuracy 0.25, top1_bottom1 0.25,
tau 0.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from scipy import stats

#: per-instance metric keys, in output order
METRIC_KEYS = (
    "accuracy",
    "kendall_tau",
    "spearman_rho",
    "kendall_tau_ranks",
    "spearman_rho_ranks",
    "top1_accuracy",
    "bottom1_accuracy",
    "top1_bottom1",
    "footrule_distance",
)


# --------------------------------------------------------------------------------------------
# orders
# --------------------------------------------------------------------------------------------


def order_from_scores(scores: Sequence[float] | np.ndarray) -> list[int]:
    """Candidate indices sorted by score, highest first; ties broken by lower index first.

    Args:
        scores: 1-D sequence of real scores (any float; ``+-inf`` allowed), one per candidate.

    Returns:
        ``list[int]`` of length ``len(scores)``, a permutation of ``range(len(scores))``.

    Raises:
        ValueError: ``scores`` is not 1-D or contains NaN.

    The reference code uses ``np.argsort(scores)[::-1]``, which breaks ties the other way
    (higher index first); see the module docstring.
    """
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"scores must be 1-D, got shape {arr.shape}")
    if np.isnan(arr).any():
        bad = np.flatnonzero(np.isnan(arr)).tolist()
        raise ValueError(f"scores contain NaN at index {bad}")
    # stable sort of -score keeps the original (ascending index) order among ties
    return np.argsort(-arr, kind="stable").tolist()


def _is_int_id(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _validate_pair(pred: Sequence[Hashable], ref: Sequence[Hashable]) -> tuple[list, list]:
    pred, ref = list(pred), list(ref)
    if len(pred) != len(ref):
        raise ValueError(f"predicted order has {len(pred)} entries, reference order {len(ref)}")
    if len(ref) < 2:
        raise ValueError(f"need at least 2 candidates per instance, got {len(ref)}")
    if len(set(pred)) != len(pred):
        raise ValueError(f"predicted order has duplicate candidates: {pred}")
    if len(set(ref)) != len(ref):
        raise ValueError(f"reference order has duplicate candidates: {ref}")
    if set(pred) != set(ref):
        raise ValueError(
            f"predicted and reference orders hold different candidates: "
            f"{sorted(map(repr, set(pred) ^ set(ref)))}"
        )
    return pred, ref


def _labels(ref: list, candidates: Sequence[Hashable] | None) -> dict:
    """Numeric label per candidate, used by the reference-code correlations."""
    if candidates is not None:
        cands = list(candidates)
        if len(cands) != len(ref) or len(set(cands)) != len(cands) or set(cands) != set(ref):
            raise ValueError(
                f"candidates must be a permutation of the ordered candidates, got {cands}"
            )
        return {c: i for i, c in enumerate(cands)}
    if all(_is_int_id(c) for c in ref):
        return {c: int(c) for c in ref}
    raise ValueError(
        "the reference-code kendall_tau / spearman_rho correlate candidate *indices*; pass "
        "`candidates` (the candidate list whose positions are the indices, e.g. comp_images) "
        "when the ids are not integers"
    )


def _stat(result: Any) -> float:
    return float(result.statistic)


# Both statistics are asked of lists of candidate indices or positions of a few candidates (4 in
# ConsistencyRank-Bench: at most 24 x 24 distinct pairs of permutations of 0..3), thousands of
# times per evaluation (each a scipy call with its own fixed overhead): each distinct pair
# is computed by scipy once per process (lists that compare equal hold equal numbers, so equal
# ranks and the same statistic).
@functools.lru_cache(maxsize=1 << 14)
def _kendall_of(x: tuple, y: tuple) -> float:
    return _stat(stats.kendalltau(x, y))


@functools.lru_cache(maxsize=1 << 14)
def _spearman_of(x: tuple, y: tuple) -> float:
    with warnings.catch_warnings():
        # n = 2: scipy cannot form the p-value and warns; the statistic is fine
        warnings.simplefilter("ignore", RuntimeWarning)
        return _stat(stats.spearmanr(x, y))


def _kendall(x: Sequence[float], y: Sequence[float]) -> float:
    """scipy's Kendall tau-b of ``x`` and ``y`` (memoised per distinct pair of tuples)."""
    return _kendall_of(tuple(x), tuple(y))


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """scipy's Spearman rho of ``x`` and ``y`` (memoised per distinct pair of tuples)."""
    return _spearman_of(tuple(x), tuple(y))


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------


def rank_metrics(
    pred: Sequence[Hashable],
    ref: Sequence[Hashable],
    candidates: Sequence[Hashable] | None = None,
) -> dict[str, float]:
    """Metrics of one instance: predicted order ``pred`` vs reference order ``ref``.

    Args:
        pred: candidate ids, most to least consistent (predicted).
        ref: the same candidate ids, most to least consistent (reference / human).
        candidates: optional list of the same ids fixing their *indices* (position in this
            list, as ``comp_images`` in the released code); only the reference-code
            ``kendall_tau`` / ``spearman_rho`` depend on it. Without it the ids must be
            integers and are used as their own indices.

    Returns:
        dict with float values: ``accuracy`` in [0, 1] (fraction of positions holding the
        same candidate), ``kendall_tau`` / ``spearman_rho`` in [-1, 1] (reference-code
        definition: scipy tau / rho between the two lists of candidate indices),
        ``kendall_tau_ranks`` / ``spearman_rho_ranks`` in [-1, 1] (rank-vector definition),
        ``top1_accuracy`` / ``bottom1_accuracy`` in {0, 1}, ``top1_bottom1`` in {0, .5, 1}
        and ``footrule_distance`` (sum over candidates of |position difference|).

    Raises:
        ValueError: orders of different lengths, fewer than 2 candidates, duplicates, not the
            same candidate set, ``candidates`` not a permutation of them, or non-integer ids
            without ``candidates``.
    """
    pred, ref = _validate_pair(pred, ref)
    n = len(ref)
    label = _labels(ref, candidates)

    # reference code: correlate the ordered lists of candidate indices position by position
    pred_idx = [label[c] for c in pred]
    ref_idx = [label[c] for c in ref]

    # rank vectors: position of each candidate (enumerated in reference order) in each order
    pos_pred = {c: i for i, c in enumerate(pred)}
    rank_pred = [pos_pred[c] for c in ref]
    rank_ref = list(range(n))

    top1 = float(pred[0] == ref[0])
    bottom1 = float(pred[-1] == ref[-1])
    return {
        "accuracy": sum(p == g for p, g in zip(pred, ref)) / n,
        "kendall_tau": _kendall(pred_idx, ref_idx),
        "spearman_rho": _spearman(pred_idx, ref_idx),
        "kendall_tau_ranks": _kendall(rank_pred, rank_ref),
        "spearman_rho_ranks": _spearman(rank_pred, rank_ref),
        "top1_accuracy": top1,
        "bottom1_accuracy": bottom1,
        "top1_bottom1": (top1 + bottom1) / 2,
        "footrule_distance": float(sum(abs(r - i) for i, r in enumerate(rank_pred))),
    }


def consistency_rank_metrics(
    predicted_orders: Sequence[Sequence[Hashable]],
    reference_orders: Sequence[Sequence[Hashable]],
    candidates: Sequence[Sequence[Hashable] | None] | None = None,
    *,
    per_instance: bool = False,
) -> dict[str, Any]:
    """Mean ranking metrics over instances (paper Table 2 / ConsistencyRank-Bench).

    Args:
        predicted_orders: one order per instance (candidate ids, best first).
        reference_orders: the reference order per instance, same candidates as the
            prediction of that instance.
        candidates: optional, per instance, the list fixing candidate indices for the
            reference-code tau / rho (see ``rank_metrics``); ``None`` or a list of
            ``None``/lists.
        per_instance: also return ``"per_instance"``: metric name -> list of per-instance
            values (e.g. for :func:`paco.core.statistics.chance_test`).

    Returns:
        dict: every key of ``METRIC_KEYS`` mapped to its mean over instances (float), plus
        ``n_instances`` (int) and, if requested, ``per_instance``.

    Raises:
        ValueError: empty input, different numbers of predicted and reference orders, or an
            invalid instance (the message names its index).
    """
    preds, refs = list(predicted_orders), list(reference_orders)
    if not refs:
        raise ValueError("no instances: reference_orders is empty")
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predicted orders but {len(refs)} reference orders")
    cands = [None] * len(refs) if candidates is None else list(candidates)
    if len(cands) != len(refs):
        raise ValueError(f"{len(cands)} candidate lists but {len(refs)} instances")

    rows = []
    for i, (p, r, c) in enumerate(zip(preds, refs, cands)):
        try:
            rows.append(rank_metrics(p, r, c))
        except ValueError as exc:
            raise ValueError(f"instance {i}: {exc}") from exc

    out: dict[str, Any] = {k: float(np.mean([row[k] for row in rows])) for k in METRIC_KEYS}
    out["n_instances"] = len(rows)
    if per_instance:
        out["per_instance"] = {k: [row[k] for row in rows] for k in METRIC_KEYS}
    return out


def chance_levels(n_candidates: int) -> dict[str, float]:
    """Expected metric values for a uniformly random predicted order of ``n_candidates``.

    Each position holds the reference candidate with probability ``1/n``, so accuracy,
    top-1, bottom-1 and top1_bottom1 have expectation ``1/n``; the predicted order is
    independent of the reference, so tau and rho (both definitions) have expectation 0.
    Exact, not simulated (the tests check it by enumerating all permutations).

    Raises:
        ValueError: ``n_candidates < 2``.
    """
    if n_candidates < 2:
        raise ValueError(f"need at least 2 candidates, got {n_candidates}")
    inv = 1.0 / n_candidates
    return {
        "accuracy": inv,
        "kendall_tau": 0.0,
        "spearman_rho": 0.0,
        "kendall_tau_ranks": 0.0,
        "spearman_rho_ranks": 0.0,
        "top1_accuracy": inv,
        "bottom1_accuracy": inv,
        "top1_bottom1": inv,
        # E|pos_pred - pos_ref| summed over candidates = n * (n^2 - 1) / (3n) = (n^2 - 1) / 3
        "footrule_distance": (n_candidates**2 - 1) / 3.0,
    }
