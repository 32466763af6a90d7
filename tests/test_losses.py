"""First-token-weighted loss (paper §3.1 and the released trainer): exact values by hand."""

import math

import pytest
import torch

from paco.judge import losses as L

IGN = -100


def hand_ce(logit_row, label):
    """-log softmax(logit_row)[label] with explicit loops (float64 Python math)."""
    m = max(logit_row)
    log_z = m + math.log(sum(math.exp(v - m) for v in logit_row))
    return log_z - logit_row[label]


def hand_token_losses(logits, labels):
    """{(b, t): ce} for every unignored position, from nested Python lists."""
    out = {}
    for b, row in enumerate(labels):
        for t, y in enumerate(row):
            if y != IGN:
                out[(b, t)] = hand_ce(logits[b][t], y)
    return out


def hand_paper(logits, labels, alpha):
    ce = hand_token_losses(logits, labels)
    rows = []
    for b, row in enumerate(labels):
        pos = [t for t, y in enumerate(row) if y != IGN]
        n = len(pos)
        if n == 1:
            rows.append(ce[(b, pos[0])])
            continue
        others = sum(ce[(b, t)] for t in pos[1:])
        rows.append(alpha * ce[(b, pos[0])] + (1 - alpha) / (n - 1) * others)
    return sum(rows) / len(rows)


def hand_reference(logits, labels, alpha):
    ce = hand_token_losses(logits, labels)
    total, count = 0.0, 0
    for b, row in enumerate(labels):
        pos = [t for t, y in enumerate(row) if y != IGN]
        n = len(pos)
        count += n
        total += alpha * ce[(b, pos[0])]
        if n > 1:
            total += n * (1 - alpha) / (n - 1) * sum(ce[(b, t)] for t in pos[1:])
    return total / count


@pytest.fixture
def tiny():
    """vocab 5, batch 2, seq 6; row 0 has 4 response tokens, row 1 has 2 then padding."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 5, generator=g) * 2.0
    labels = torch.tensor(
        [
            [IGN, IGN, 3, 1, 4, 0],
            [IGN, IGN, IGN, 2, 0, IGN],
        ]
    )
    return logits, labels


# --------------------------------------------------------------------------------------------
# exact values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_paper_variant_matches_hand_computation(tiny, alpha):
    logits, labels = tiny
    got = L.first_token_weighted_loss(logits, labels, alpha, variant="paper")
    want = hand_paper(logits.tolist(), labels.tolist(), alpha)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_reference_variant_matches_hand_computation(tiny, alpha):
    logits, labels = tiny
    got = L.first_token_weighted_loss(logits, labels, alpha, variant="reference")
    want = hand_reference(logits.tolist(), labels.tolist(), alpha)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_explicit_weights_for_the_tiny_batch(tiny):
    """Spell the two weightings out for alpha = 0.1 (row n = 4 and n = 2, N = 6)."""
    logits, labels = tiny
    ce = hand_token_losses(logits.tolist(), labels.tolist())
    a = 0.1
    paper = 0.5 * (a * ce[0, 2] + 0.3 * (ce[0, 3] + ce[0, 4] + ce[0, 5])) + 0.5 * (
        a * ce[1, 3] + 0.9 * ce[1, 4]
    )
    reference = (
        a * ce[0, 2] + 1.2 * (ce[0, 3] + ce[0, 4] + ce[0, 5]) + a * ce[1, 3] + 1.8 * ce[1, 4]
    ) / 6
    assert L.first_token_weighted_loss(logits, labels, a).item() == pytest.approx(paper, rel=1e-6)
    assert L.first_token_weighted_loss(logits, labels, a, "reference").item() == pytest.approx(
        reference, rel=1e-6
    )


def test_reference_single_row_is_alpha_over_n_on_answer(tiny):
    logits, labels = tiny
    row_logits, row_labels = logits[:1], labels[:1]  # n = 4
    ce = hand_token_losses(row_logits.tolist(), row_labels.tolist())
    for a in (0.1, 0.7):
        want = (a / 4) * ce[0, 2] + (1 - a) / 3 * (ce[0, 3] + ce[0, 4] + ce[0, 5])
        got = L.first_token_weighted_loss(row_logits, row_labels, a, "reference")
        assert got.item() == pytest.approx(want, rel=1e-6)
        # the other tokens carry exactly the paper's weight; only the answer weight differs
        paper = L.first_token_weighted_loss(row_logits, row_labels, a, "paper")
        assert paper.item() - got.item() == pytest.approx((a - a / 4) * ce[0, 2], abs=2e-5)


def test_released_trainer_algorithm_reimplemented_with_shift():
    """Follow the released compute_loss step by step on unshifted inputs; ours gets the
    shifted (aligned) tensors and must agree (rows with n >= 2)."""
    g = torch.Generator().manual_seed(3)
    b, t, v = 3, 9, 7
    full_logits = torch.randn(b, t, v, generator=g)
    full_labels = torch.tensor(
        [
            [IGN, IGN, IGN, 4, 2, 6, 1, 0, 3],
            [IGN, IGN, IGN, IGN, IGN, 5, 5, IGN, IGN],
            [IGN, IGN, 1, 2, 3, 4, 0, 6, IGN],
        ]
    )
    alpha = 0.1
    shifted_logits = full_logits[:, :-1, :]
    shifted_labels = full_labels[:, 1:]
    total, count = 0.0, 0
    for i in range(b):
        valid = [k for k in range(t - 1) if shifted_labels[i, k] != IGN]
        n = len(valid)
        count += n
        w_other = n * (1.0 - alpha) / max(n - 1, 1e-8)
        for j, k in enumerate(valid):
            w = alpha if j == 0 else w_other
            total += w * hand_ce(shifted_logits[i, k].tolist(), int(shifted_labels[i, k]))
    want = total / count
    got = L.first_token_weighted_loss(shifted_logits, shifted_labels, alpha, variant="reference")
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_alpha_one_over_n_is_plain_mean_token_ce_per_row():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 5, generator=g)
    labels = torch.tensor([[IGN, 0, 1, 2, IGN], [IGN, IGN, 4, 3, 2]])  # n = 3 in both rows
    got = L.first_token_weighted_loss(logits, labels, 1 / 3, "paper")
    rows = [
        torch.nn.functional.cross_entropy(logits[i], labels[i], ignore_index=IGN) for i in range(2)
    ]
    assert got.item() == pytest.approx(((rows[0] + rows[1]) / 2).item(), rel=1e-6)
    # single row with n = 4: plain mean CE
    logits1 = torch.randn(1, 6, 5, generator=g)
    labels1 = torch.tensor([[IGN, IGN, 1, 2, 3, 4]])
    plain = torch.nn.functional.cross_entropy(logits1[0], labels1[0], ignore_index=IGN)
    assert L.first_token_weighted_loss(logits1, labels1, 0.25).item() == pytest.approx(
        plain.item(), rel=1e-6
    )
    # the reference variant is not the plain mean at alpha = 1/n (answer weight alpha/n)
    ref = L.first_token_weighted_loss(logits1, labels1, 0.25, "reference")
    assert ref.item() != pytest.approx(plain.item(), rel=1e-3)


def test_single_token_rows():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 5, generator=g)
    labels = torch.tensor([[IGN, IGN, 3, IGN], [IGN, 1, 2, 0]])  # n = 1 and n = 3
    ce = hand_token_losses(logits.tolist(), labels.tolist())
    a = 0.3
    paper = 0.5 * ce[0, 2] + 0.5 * (a * ce[1, 1] + 0.35 * (ce[1, 2] + ce[1, 3]))
    reference = (a * ce[0, 2] + a * ce[1, 1] + 3 * 0.7 / 2 * (ce[1, 2] + ce[1, 3])) / 4
    assert L.first_token_weighted_loss(logits, labels, a).item() == pytest.approx(paper, rel=1e-6)
    assert L.first_token_weighted_loss(logits, labels, a, "reference").item() == pytest.approx(
        reference, rel=1e-6
    )


def test_half_precision_logits_computed_in_float32(tiny):
    logits, labels = tiny
    bf = logits.to(torch.bfloat16)
    got = L.first_token_weighted_loss(bf, labels, 0.2)
    want = hand_paper(bf.float().tolist(), labels.tolist(), 0.2)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want, rel=1e-6)


# --------------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["paper", "reference"])
def test_gradient_flows_and_matches_analytic(tiny, variant):
    logits, labels = tiny
    x = logits.clone().requires_grad_(True)
    loss = L.first_token_weighted_loss(x, labels, 0.2, variant=variant)
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # d loss / d logits[b, t] = w[b, t] * (softmax - onehot); zero where ignored
    a = 0.2
    if variant == "paper":
        w = {0: (a / 2, (1 - a) / 3 / 2), 1: (a / 2, (1 - a) / 1 / 2)}
    else:
        w = {0: (a / 6, 4 * (1 - a) / 3 / 6), 1: (a / 6, 2 * (1 - a) / 1 / 6)}
    p = torch.softmax(logits.double(), dim=-1)
    for b in range(2):
        valid = [t for t in range(6) if labels[b, t] != IGN]
        for t in range(6):
            if t not in valid:
                assert torch.all(x.grad[b, t] == 0)
                continue
            wt = w[b][0] if t == valid[0] else w[b][1]
            onehot = torch.nn.functional.one_hot(labels[b, t], 5).double()
            expect = wt * (p[b, t] - onehot)
            assert torch.allclose(x.grad[b, t].double(), expect, atol=1e-6)


# --------------------------------------------------------------------------------------------
# answer positions and first-token accuracy
# --------------------------------------------------------------------------------------------


def test_answer_positions(tiny):
    _, labels = tiny
    pos = L.answer_positions(labels)
    assert pos.dtype == torch.long and pos.tolist() == [2, 3]
    assert L.answer_positions(torch.tensor([[5, IGN, 1], [IGN, IGN, 0]])).tolist() == [0, 2]


def test_first_token_accuracy_hand_built():
    v = 4
    labels = torch.tensor(
        [
            [IGN, 2, 1, IGN],  # answer at 1, label 2
            [IGN, IGN, 3, 0],  # answer at 2, label 3
            [0, 1, IGN, IGN],  # answer at 0, label 0
        ]
    )
    logits = torch.zeros(3, 4, v)
    logits[0, 1, 2] = 5.0  # correct
    logits[0, 2, 0] = 5.0  # a wrong later token does not matter
    logits[1, 2, 1] = 5.0  # wrong (predicts 1, label 3)
    logits[1, 1, 3] = 5.0  # the right token one position early does not count
    logits[2, 0, 0] = 1.0  # correct
    assert L.first_token_accuracy(logits, labels) == pytest.approx(2 / 3)
    logits[1, 2, 3] = 9.0
    assert L.first_token_accuracy(logits, labels) == 1.0


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_errors(tiny):
    logits, labels = tiny
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            L.first_token_weighted_loss(logits, labels, bad)
    with pytest.raises(ValueError, match="variant"):
        L.first_token_weighted_loss(logits, labels, 0.1, variant="hf")
    with pytest.raises(ValueError, match="shape mismatch"):
        L.first_token_weighted_loss(logits[:, :-1], labels, 0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        L.first_token_weighted_loss(logits, labels[:1], 0.1)
    with pytest.raises(ValueError, match="batch, seq, vocab"):
        L.first_token_weighted_loss(logits[0], labels, 0.1)
    with pytest.raises(ValueError, match="integer"):
        L.first_token_weighted_loss(logits, labels.float(), 0.1)
    with pytest.raises(ValueError, match="token id"):
        L.first_token_weighted_loss(logits, labels.masked_fill(labels == 4, 5), 0.1)
    empty = labels.clone()
    empty[1] = IGN
    for variant in ("paper", "reference"):
        with pytest.raises(ValueError, match=r"rows \[1\]"):
            L.first_token_weighted_loss(logits, empty, 0.1, variant=variant)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        L.answer_positions(empty)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        L.first_token_accuracy(logits, empty)
    with pytest.raises(ValueError, match="shape mismatch"):
        L.first_token_accuracy(logits[:, 1:], labels)
