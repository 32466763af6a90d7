"""First-token-weighted cross-entropy for the PaCo-Reward judge (paper §3.1) and helpers.

The judge answers "Yes"/"No" first and then gives its reasons; the answer token's probability
is the reward, so its loss is weighted separately from the reasoning tokens.

Conventions shared by every function here:

- ``logits``: float tensor ``(batch, seq, vocab)`` (any float dtype; the loss is computed in
  float32), **already aligned** with ``labels``: ``logits[b, t]`` predicts ``labels[b, t]``.
  No shifting happens here (the released trainer shifts ``logits[:, :-1]`` against
  ``labels[:, 1:]`` itself; do that before calling).
- ``labels``: integer tensor ``(batch, seq)``; ``-100`` (``IGNORE_INDEX``, set where
  :func:`paco.judge.model.encode_sft` encodes the labels) marks prompt and
  padding positions; every other value must be a token id in ``[0, vocab)``.
- The *answer token* of a row is its first non-ignored position; ``n`` (per row) is the
  number of non-ignored positions (answer + the ``n - 1`` other response tokens).

Two weightings are offered (``variant``):

``"paper"`` (paper §3.1)
    Per row, weight ``alpha`` on the answer token and ``(1 - alpha) / (n - 1)`` on each of the
    other ``n - 1`` response tokens (weights sum to 1); row loss = weighted sum of token
    cross-entropies; batch loss = mean over rows. A row with ``n == 1`` (answer only) gives
    the answer token weight 1 (there is nothing to share ``1 - alpha`` with, and weight 1
    keeps every row's weights summing to 1). ``alpha = 1 / n`` reproduces the plain
    per-row mean token cross-entropy.

``"reference"`` (released trainer)
    ``PaCo-Reward/LLaMA-Factory/src/llamafactory/train/sft/trainer.py`` in X-GenGroup/PaCo-RL,
    ``CustomSeq2SeqTrainer.compute_loss`` with ``finetuning_args.first_token_weight`` set
    (0.1 in ``PaCo-Reward/config/paco_reward_lora.yaml``) does, per micro-batch:

    1. shift (``logits[..., :-1, :]`` vs ``labels[..., 1:]``), per-token
       ``nn.CrossEntropyLoss(reduction="none")`` (ignored positions give 0);
    2. ``mask = labels != -100``; the first token is ``mask.cumsum(1) == 1 & mask``;
       ``n = mask.sum(1)`` per row;
    3. weight ``w_other = n * (1 - alpha) / clamp(n - 1, min=1e-8)`` on every token, then
       the first token's weight is replaced by ``alpha``;
    4. ``loss = (token_loss * weights * mask).sum() / mask.sum()``, i.e. the weighted token
       losses of the whole micro-batch divided by its total number of response tokens ``N``.

    For one row this equals ``(alpha / n) * l_answer + ((1 - alpha) / (n - 1)) * sum(l_other)``:
    the other tokens get exactly the paper's weight, but the answer token gets ``alpha / n``
    instead of ``alpha`` ("effectively alpha / n on the answer token"); relative to plain
    token-mean SFT (weight 1 per token) the answer token has weight ``alpha`` and the others
    ``n (1 - alpha) / (n - 1)``, so with the released ``alpha = 0.1`` the answer token is
    *down*-weighted about 9x relative to a reasoning token, whereas the paper's weighting with
    ``alpha = 0.1`` and ``n = 100`` up-weights it about 11x. Over a batch, row ``b``
    contributes with weight ``n_b / N`` (token-weighted, not row-weighted, mean). No ``alpha``
    makes it the plain token mean: that needs every weight to be 1, i.e. ``alpha = 1`` for the
    answer token but ``alpha = 1 / n`` for the others.

    Rows with ``n == 1``: the formula's intended answer weight is ``alpha``, which is what this
    implementation uses; the released code computes it in float32 as
    ``w_other + (alpha - w_other)`` with ``w_other = (1 - alpha) / 1e-8``, which loses ``alpha``
    to rounding (it yields 0 for alpha = 0.1 or 0.5, 1 for alpha = 0.9). The released code
    lets rows without response tokens contribute nothing (and a micro-batch with none gives
    0/0 = NaN); here such rows raise, as in the paper variant.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from paco.judge.model import IGNORE_INDEX

VARIANTS = ("paper", "reference")


def _check_labels(labels: torch.Tensor) -> None:
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 2:
        raise ValueError(f"labels must be (batch, seq), got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")


def _check_logits(logits: torch.Tensor, labels: torch.Tensor) -> None:
    _check_labels(labels)
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise ValueError("logits must be a floating-point torch.Tensor")
    if logits.dim() != 3:
        raise ValueError(f"logits must be (batch, seq, vocab), got shape {tuple(logits.shape)}")
    if logits.shape[:2] != labels.shape:
        raise ValueError(
            f"shape mismatch: logits {tuple(logits.shape)} vs labels {tuple(labels.shape)} "
            "(logits must already be aligned with labels: logits[b, t] predicts labels[b, t])"
        )
    vocab = logits.shape[-1]
    valid = labels != IGNORE_INDEX
    bad = valid & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        b, t = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"label {int(labels[b, t])} at (row {b}, position {t}) is neither {IGNORE_INDEX} "
            f"nor a token id in [0, {vocab})"
        )


def _response_mask(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (batch, seq) bool, n (batch,) int64); raises if some row has no response token."""
    mask = labels != IGNORE_INDEX
    n = mask.sum(dim=1)
    empty = (n == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} have no unignored label (no answer token)")
    return mask, n


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """Position of the answer token (first label != -100) of each row.

    Args:
        labels: integer tensor ``(batch, seq)``.

    Returns:
        LongTensor ``(batch,)`` with values in ``[0, seq)``, on ``labels.device``.

    Raises:
        ValueError: ``labels`` not a 2-D integer tensor, or a row with every label ``-100``.
    """
    _check_labels(labels)
    mask, _ = _response_mask(labels)
    # argmax returns the first maximal index; every row has at least one True
    return mask.to(torch.int8).argmax(dim=1).to(torch.long)


def first_token_weighted_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    variant: str = "paper",
) -> torch.Tensor:
    """First-token-weighted cross-entropy (see the module docstring for both variants).

    Args:
        logits: float ``(batch, seq, vocab)``, aligned with ``labels`` (no shift inside).
        labels: integer ``(batch, seq)``; ``-100`` ignored; others in ``[0, vocab)``.
        alpha: answer-token weight, in ``[0, 1]``.
        variant: ``"paper"`` (paper §3.1: per-row weights ``alpha`` and
            ``(1 - alpha) / (n - 1)``, mean over rows) or ``"reference"`` (released
            LLaMA-Factory trainer: weights ``alpha`` and ``n (1 - alpha) / (n - 1)``, summed
            over the batch and divided by the batch's number of response tokens).

    Returns:
        float32 scalar tensor, differentiable w.r.t. ``logits``; >= 0.

    Raises:
        ValueError: alpha outside ``[0, 1]`` (or NaN), unknown variant, wrong ranks / shape
            mismatch / non-integer labels / label ids out of range, or a row with no
            unignored label.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    alpha_f = float(alpha)
    if math.isnan(alpha_f) or not 0.0 <= alpha_f <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    _check_logits(logits, labels)
    mask, n = _response_mask(labels)

    batch, seq, vocab = logits.shape
    safe_labels = labels.masked_fill(~mask, 0).long()
    token_ce = F.cross_entropy(
        logits.float().reshape(-1, vocab), safe_labels.reshape(-1), reduction="none"
    ).reshape(batch, seq)
    token_ce = token_ce * mask  # ignored positions contribute exactly 0

    first = mask & (mask.cumsum(dim=1) == 1)
    n_f = n.to(torch.float32).unsqueeze(1)  # (batch, 1)
    n_minus_one = (n_f - 1).clamp(min=1.0)  # only used where n > 1
    single = n_f == 1

    if variant == "paper":
        w_other = torch.where(single, torch.zeros_like(n_f), (1.0 - alpha_f) / n_minus_one)
        w_first = torch.where(single, torch.ones_like(n_f), torch.full_like(n_f, alpha_f))
        weights = torch.where(first, w_first, w_other)
        return (token_ce * weights).sum(dim=1).mean()

    # reference
    w_other = torch.where(single, torch.zeros_like(n_f), n_f * (1.0 - alpha_f) / n_minus_one)
    weights = torch.where(first, torch.full_like(n_f, alpha_f), w_other)
    return (token_ce * weights).sum() / mask.sum().to(torch.float32)


def first_token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose argmax at the answer position equals the answer label.

    Same as the released ``ComputeAccuracy(first_token_only=True)``
    (``PaCo-Reward/LLaMA-Factory/src/llamafactory/train/sft/metric.py``), there computed
    after its own shift; here ``logits`` must already be aligned with ``labels``. Argmax
    ties resolve to the lowest token id (``torch.argmax``).

    Args:
        logits: float ``(batch, seq, vocab)``, aligned with ``labels``.
        labels: integer ``(batch, seq)``, ``-100`` ignored.

    Returns:
        float in ``[0, 1]``.

    Raises:
        ValueError: as ``first_token_weighted_loss`` (shapes, labels, empty rows).
    """
    _check_logits(logits, labels)
    pos = answer_positions(labels)
    rows = torch.arange(labels.shape[0], device=labels.device)
    with torch.no_grad():
        pred = logits[rows, pos].argmax(dim=-1)
        target = labels[rows, pos].long()
        return float((pred == target).float().mean())
