"""Ranking metrics (paper Table 2, released eval_vllm.py): exact values."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from paco.judge import metrics as M


def inverse(order):
    """Rank vector: candidate -> position."""
    return {c: i for i, c in enumerate(order)}


def inversions(seq):
    return sum(1 for i in range(len(seq)) for j in range(i + 1, len(seq)) if seq[i] > seq[j])


def tau_from_pairs(x, y):
    """Kendall tau-a by explicit pair counting (no ties in permutations)."""
    n = len(x)
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])
    return s / (n * (n - 1) / 2)


def rho_from_d2(x, y):
    """Spearman rho of two permutations of 0..n-1: 1 - 6 sum d^2 / (n (n^2 - 1))."""
    n = len(x)
    d2 = sum((a - b) ** 2 for a, b in zip(x, y))
    return 1 - 6 * d2 / (n * (n * n - 1))


# --------------------------------------------------------------------------------------------
# order_from_scores
# --------------------------------------------------------------------------------------------


def test_order_from_scores_descending_and_ties_lower_index_first():
    assert M.order_from_scores([0.1, 0.9, 0.5, 0.7]) == [1, 3, 2, 0]
    assert M.order_from_scores([0.5, 0.9, 0.5, 0.5]) == [1, 0, 2, 3]
    assert M.order_from_scores(np.array([1.0, 1.0, 1.0])) == [0, 1, 2]
    assert M.order_from_scores([-math.inf, 0.0, math.inf]) == [2, 1, 0]
    # the released code's np.argsort(scores)[::-1] puts the *higher* index first among ties
    assert np.argsort([0.5, 0.9, 0.5], kind="stable")[::-1].tolist() == [1, 2, 0]
    assert M.order_from_scores([0.5, 0.9, 0.5]) == [1, 0, 2]


def test_order_from_scores_errors():
    with pytest.raises(ValueError, match="NaN"):
        M.order_from_scores([0.1, float("nan"), 0.3])
    with pytest.raises(ValueError, match="1-D"):
        M.order_from_scores([[0.1, 0.2]])


# --------------------------------------------------------------------------------------------
# rank_metrics: hand-checked cases
# --------------------------------------------------------------------------------------------


def test_identical_orders():
    m = M.rank_metrics([2, 0, 3, 1], [2, 0, 3, 1])
    assert m["accuracy"] == 1.0
    for k in ("kendall_tau", "spearman_rho", "kendall_tau_ranks", "spearman_rho_ranks"):
        assert m[k] == pytest.approx(1.0, abs=1e-12)
    assert m["top1_accuracy"] == m["bottom1_accuracy"] == m["top1_bottom1"] == 1.0
    assert m["footrule_distance"] == 0.0


def test_reversed_order_of_identity_reference():
    m = M.rank_metrics([3, 2, 1, 0], [0, 1, 2, 3])
    assert m["accuracy"] == 0.0
    for k in ("kendall_tau", "spearman_rho", "kendall_tau_ranks", "spearman_rho_ranks"):
        assert m[k] == pytest.approx(-1.0, abs=1e-12)
    assert m["top1_bottom1"] == 0.0
    assert m["footrule_distance"] == 3 + 1 + 1 + 3


def test_reversed_order_rank_definition_always_minus_one_reference_code_not():
    # n = 3, pred is the reverse of ref. Reference code correlates the index lists
    # p = [0, 2, 1], g = [1, 2, 0] position by position: pairs (0,1) concordant,
    # (0,2) discordant, (1,2) concordant -> tau = (2 - 1) / 3; sum d^2 = 1 + 0 + 1 = 2 ->
    # rho = 1 - 6 * 2 / 24 = 0.5. Rank vectors are exactly reversed -> -1.
    m = M.rank_metrics([0, 2, 1], [1, 2, 0])
    assert m["kendall_tau"] == pytest.approx(1 / 3, abs=1e-12)
    assert m["spearman_rho"] == pytest.approx(0.5, abs=1e-12)
    assert m["kendall_tau_ranks"] == pytest.approx(-1.0, abs=1e-12)
    assert m["spearman_rho_ranks"] == pytest.approx(-1.0, abs=1e-12)
    assert m["accuracy"] == pytest.approx(1 / 3)
    assert m["top1_bottom1"] == 0.0
    for ref in itertools.permutations(range(4)):
        m = M.rank_metrics(list(ref)[::-1], list(ref))
        assert m["kendall_tau_ranks"] == pytest.approx(-1.0, abs=1e-12)
        assert m["spearman_rho_ranks"] == pytest.approx(-1.0, abs=1e-12)
        assert m["top1_bottom1"] == 0.0
    m = M.rank_metrics([3, 2, 0, 1], [1, 0, 2, 3])
    assert m["kendall_tau"] == pytest.approx(-1 / 3, abs=1e-12)
    assert m["spearman_rho"] == pytest.approx(-0.6, abs=1e-12)


def test_definitions_coincide_when_reference_is_identity():
    # pred [1, 2, 0, 3] vs ref [0, 1, 2, 3]: the index lists are p and the identity, and the
    # rank vector of p is its inverse [2, 0, 1, 3]; inversions(p) = inversions(p^-1) = 2 ->
    # tau = 1 - 2 * 2 / 6 = 1/3; sum d^2 = 1 + 1 + 4 + 0 = 6 -> rho = 1 - 36 / 60 = 0.4.
    m = M.rank_metrics([1, 2, 0, 3], [0, 1, 2, 3])
    for k in ("kendall_tau", "kendall_tau_ranks"):
        assert m[k] == pytest.approx(1 / 3, abs=1e-12)
    for k in ("spearman_rho", "spearman_rho_ranks"):
        assert m[k] == pytest.approx(0.4, abs=1e-12)
    assert m["accuracy"] == 0.25
    assert m["top1_accuracy"] == 0.0 and m["bottom1_accuracy"] == 1.0
    assert m["top1_bottom1"] == 0.5
    assert m["footrule_distance"] == 1 + 1 + 2 + 0


def test_definitions_differ_hand_checked():
    # pred [0, 1, 3, 2] vs ref [0, 2, 3, 1].
    # Reference code: tau over positions between [0,1,3,2] and [0,2,3,1]; position pairs
    # (0,1)c (0,2)c (0,3)c (1,2)c (1,3)d (2,3)c -> (5 - 1) / 6 = 2/3;
    # sum d^2 = 0 + 1 + 0 + 1 = 2 -> rho = 1 - 12/60 = 0.8.
    # Rank vectors (candidates 0..3): pred positions [0, 1, 3, 2], ref positions [0, 3, 1, 2]
    # -> pairs (0,1)c (0,2)c (0,3)c (1,2)d (1,3)d (2,3)d -> 0; sum d^2 = 0+4+4+0 = 8 -> 0.2.
    m = M.rank_metrics([0, 1, 3, 2], [0, 2, 3, 1])
    assert m["kendall_tau"] == pytest.approx(2 / 3, abs=1e-12)
    assert m["spearman_rho"] == pytest.approx(0.8, abs=1e-12)
    assert m["kendall_tau_ranks"] == pytest.approx(0.0, abs=1e-12)
    assert m["spearman_rho_ranks"] == pytest.approx(0.2, abs=1e-12)
    assert m["accuracy"] == 0.5


def test_reference_code_correlation_is_inverse_permutation_correlation():
    """tau(p, g) counts inversions of p o g^-1; the rank version those of g^-1 o p."""
    for p in itertools.permutations(range(4)):
        for g in itertools.permutations(range(4)):
            m = M.rank_metrics(list(p), list(g))
            g_inv = [g.index(c) for c in range(4)]
            p_after_ginv = [p[g_inv[c]] for c in range(4)]
            ginv_after_p = [g_inv[p[k]] for k in range(4)]
            assert m["kendall_tau"] == pytest.approx(
                1 - 4 * inversions(p_after_ginv) / 12, abs=1e-12
            )
            assert m["kendall_tau_ranks"] == pytest.approx(
                1 - 4 * inversions(ginv_after_p) / 12, abs=1e-12
            )


def test_reference_code_definition_depends_on_labelling_rank_definition_does_not():
    pred, ref = ["a", "c", "b"], ["b", "c", "a"]
    # labelling a,b,c -> 0,1,2: index lists [0,2,1] vs [1,2,0] -> tau 1/3 (see above)
    m1 = M.rank_metrics(pred, ref, candidates=["a", "b", "c"])
    # labelling b,c,a -> 0,1,2: index lists [2,1,0] vs [0,1,2] -> tau -1
    m2 = M.rank_metrics(pred, ref, candidates=["b", "c", "a"])
    assert m1["kendall_tau"] == pytest.approx(1 / 3, abs=1e-12)
    assert m1["spearman_rho"] == pytest.approx(0.5, abs=1e-12)
    assert m2["kendall_tau"] == pytest.approx(-1.0, abs=1e-12)
    assert m2["spearman_rho"] == pytest.approx(-1.0, abs=1e-12)
    for k in ("kendall_tau_ranks", "spearman_rho_ranks", "accuracy", "top1_bottom1"):
        assert m1[k] == pytest.approx(m2[k])
    assert m1["kendall_tau_ranks"] == pytest.approx(-1.0, abs=1e-12)


def test_integer_ids_equivalent_to_candidates_list():
    m_int = M.rank_metrics([1, 2, 0, 3], [2, 0, 1, 3])
    m_str = M.rank_metrics(list("bcad"), list("cabd"), candidates=list("abcd"))
    assert m_int == pytest.approx(m_str)


# --------------------------------------------------------------------------------------------
# rank_metrics vs independent computations on random permutations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_random_permutations_against_scipy_and_formulas(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        pred = rng.permutation(n).tolist()
        ref = rng.permutation(n).tolist()
        m = M.rank_metrics(pred, ref)
        # reference code: scipy between the two ordered index lists
        assert m["kendall_tau"] == pytest.approx(stats.kendalltau(pred, ref).statistic, abs=1e-12)
        assert m["kendall_tau"] == pytest.approx(tau_from_pairs(pred, ref), abs=1e-12)
        assert m["spearman_rho"] == pytest.approx(rho_from_d2(pred, ref), abs=1e-12)
        # rank vectors: candidate -> position
        rp, rr = inverse(pred), inverse(ref)
        xp = [rp[c] for c in range(n)]
        xr = [rr[c] for c in range(n)]
        tau_xp_xr = stats.kendalltau(xp, xr).statistic
        assert m["kendall_tau_ranks"] == pytest.approx(tau_xp_xr, abs=1e-12)
        assert m["kendall_tau_ranks"] == pytest.approx(tau_from_pairs(xp, xr), abs=1e-12)
        assert m["spearman_rho_ranks"] == pytest.approx(rho_from_d2(xp, xr), abs=1e-12)
        assert m["accuracy"] == pytest.approx(np.mean(np.array(pred) == np.array(ref)))
        assert m["top1_accuracy"] == float(pred[0] == ref[0])
        assert m["bottom1_accuracy"] == float(pred[-1] == ref[-1])
        assert m["top1_bottom1"] == (m["top1_accuracy"] + m["bottom1_accuracy"]) / 2
        assert m["footrule_distance"] == sum(abs(xp[c] - xr[c]) for c in range(n))


def test_consistency_rank_metrics_means_and_per_instance():
    rng = np.random.default_rng(0)
    preds = [rng.permutation(4).tolist() for _ in range(30)]
    refs = [rng.permutation(4).tolist() for _ in range(30)]
    out = M.consistency_rank_metrics(preds, refs, per_instance=True)
    assert out["n_instances"] == 30
    rows = [M.rank_metrics(p, r) for p, r in zip(preds, refs)]
    for k in M.METRIC_KEYS:
        assert out[k] == pytest.approx(np.mean([r[k] for r in rows]), abs=1e-12)
        assert out["per_instance"][k] == [r[k] for r in rows]
    assert "per_instance" not in M.consistency_rank_metrics(preds, refs)


def test_consistency_rank_metrics_with_string_ids():
    preds = [["x", "y", "z"], ["y", "x", "z"]]
    refs = [["x", "y", "z"], ["x", "y", "z"]]
    out = M.consistency_rank_metrics(preds, refs, candidates=[["x", "y", "z"], ["x", "y", "z"]])
    assert out["accuracy"] == pytest.approx((1 + 1 / 3) / 2)
    assert out["kendall_tau"] == pytest.approx((1 + 1 / 3) / 2)
    assert out["top1_bottom1"] == pytest.approx((1 + 0.5) / 2)


# --------------------------------------------------------------------------------------------
# chance levels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", [[0, 1, 2, 3], [2, 0, 3, 1]])
def test_chance_levels_exact_by_enumeration(ref):
    all_m = [M.rank_metrics(list(p), ref) for p in itertools.permutations(range(4))]
    expected = M.chance_levels(4)
    assert expected["accuracy"] == expected["top1_bottom1"] == 0.25
    assert expected["kendall_tau"] == 0.0
    for k in M.METRIC_KEYS:
        assert np.mean([m[k] for m in all_m]) == pytest.approx(expected[k], abs=1e-12), k
    # per-instance accuracy under the null is skewed (why chance_test does not use a sign test)
    acc = np.array([m["accuracy"] for m in all_m])
    assert (acc < 0.25).sum() == 9 and (acc == 0.25).sum() == 8 and (acc > 0.25).sum() == 7
    assert 0.75 not in acc


def test_chance_levels_monte_carlo():
    rng = np.random.default_rng(123)
    refs = [rng.permutation(4).tolist() for _ in range(1500)]
    preds = [rng.permutation(4).tolist() for _ in range(1500)]
    out = M.consistency_rank_metrics(preds, refs)
    # null sd: accuracy 0.25 (var 1/8 - 1/16), top1_bottom1 ~0.31, tau sqrt(26/108) ~ 0.49;
    # 1500 draws -> se 0.0065 / 0.008 / 0.013; tolerances are ~4 se
    assert out["accuracy"] == pytest.approx(0.25, abs=0.026)
    assert out["top1_bottom1"] == pytest.approx(0.25, abs=0.032)
    assert out["kendall_tau"] == pytest.approx(0.0, abs=0.05)
    assert out["kendall_tau_ranks"] == pytest.approx(0.0, abs=0.05)
    assert out["spearman_rho"] == pytest.approx(0.0, abs=0.06)


def test_chance_levels_other_n():
    c = M.chance_levels(5)
    assert c["accuracy"] == c["top1_bottom1"] == pytest.approx(0.2)
    assert c["footrule_distance"] == pytest.approx(8.0)
    with pytest.raises(ValueError):
        M.chance_levels(1)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_errors_name_the_instance():
    good = [0, 1, 2, 3]
    with pytest.raises(ValueError, match="empty"):
        M.consistency_rank_metrics([], [])
    with pytest.raises(ValueError, match="instance 1"):
        M.consistency_rank_metrics([good, [0, 1, 2]], [good, good])
    with pytest.raises(ValueError, match="instance 2.*duplicate"):
        M.consistency_rank_metrics([good, good, [0, 0, 1, 2]], [good, good, good])
    with pytest.raises(ValueError, match="instance 0.*different candidates"):
        M.consistency_rank_metrics([[0, 1, 2, 4]], [good])
    with pytest.raises(ValueError, match="2 predicted orders but 1"):
        M.consistency_rank_metrics([good, good], [good])
    with pytest.raises(ValueError, match="instance 0.*candidates"):
        M.consistency_rank_metrics([["a", "b"]], [["b", "a"]])
    with pytest.raises(ValueError, match="instance 0.*permutation"):
        M.consistency_rank_metrics([["a", "b"]], [["b", "a"]], candidates=[["a", "c"]])
    with pytest.raises(ValueError, match="at least 2"):
        M.rank_metrics([0], [0])
