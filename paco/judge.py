"""The pairwise consistency judge (PaCo-Reward): scoring and SFT batch construction.

Score (paper §3.2): the judge reads one user turn ``[image A, image B, instruction]`` and the
score is the probability mass of the answer token ``Yes`` relative to ``No`` at the first
generated position::

    s = P(Yes) / (P(Yes) + P(No)) = sigmoid(logit_Yes - logit_No)

from the first-token logits (``answer_variants=True`` sums the probabilities of case and
leading-space variants ``Yes``/``yes``/`` Yes``/... that are single tokens). Training targets are
``Yes. <reason>...</reason>`` / ``No. ...`` (:func:`paco.templates.format_response`), so the
answer is the first response token; :func:`check_answer_tokens` rejects a tokenizer for which
that does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from paco.losses import IGNORE_INDEX
from paco.templates import NO, YES, build_messages, format_response

#: Case and leading-space variants of the answers, summed when ``answer_variants`` is on.
ANSWER_VARIANTS = {YES: ("Yes", "yes", "YES", " Yes", " yes", " YES"), NO: ("No", "no", "NO", " No", " no", " NO")}


class JudgeTokenizerError(ValueError):
    """The judge's tokenizer does not encode ``Yes``/``No`` as single answer tokens."""


@dataclass(frozen=True)
class AnswerTokens:
    """Token ids whose first-position probabilities make P(Yes) and P(No)."""

    yes: tuple[int, ...]
    no: tuple[int, ...]


def check_answer_tokens(tokenizer: Any, *, variants: bool = False) -> AnswerTokens:
    """Find the answer token ids and check the training target starts with them.

    ``Yes`` and ``No`` must each be exactly one token, and the tokenisation of a full target
    (``"Yes. <reason>1. x.</reason>"``) must start with that token (a tokenizer that merges
    ``"Yes."`` into one token would make the first-token score meaningless).

    Raises:
        JudgeTokenizerError: naming the word and its tokenisation.
    """
    ids: dict[str, list[int]] = {}
    for word in (YES, NO):
        tok = tokenizer.encode(word, add_special_tokens=False)
        if len(tok) != 1:
            raise JudgeTokenizerError(
                f"judge tokenizer encodes {word!r} as {len(tok)} tokens {tok}: the first-token "
                "score P(Yes)/(P(Yes)+P(No)) needs single-token answers"
            )
        for label in (True, False):
            target = tokenizer.encode(format_response(label, ["x."]), add_special_tokens=False)
            want = tokenizer.encode(YES if label else NO, add_special_tokens=False)[0]
            if target[0] != want:
                raise JudgeTokenizerError(
                    f"judge tokenizer does not start the target {format_response(label, ['x.'])!r} "
                    f"with the answer token {want} (got {target[:3]})"
                )
        ids[word] = tok
        if variants:
            for v in ANSWER_VARIANTS[word][1:]:
                t = tokenizer.encode(v, add_special_tokens=False)
                if len(t) == 1 and t[0] not in ids[word]:
                    ids[word].append(t[0])
    if set(ids[YES]) & set(ids[NO]):
        raise JudgeTokenizerError(f"Yes and No share token ids {set(ids[YES]) & set(ids[NO])}")
    return AnswerTokens(tuple(ids[YES]), tuple(ids[NO]))


def p_yes_from_logits(logits: torch.Tensor, answer: AnswerTokens) -> torch.Tensor:
    """``P(Yes)/(P(Yes)+P(No))`` from first-position logits.

    Args:
        logits: ``(batch, vocab)`` logits of the first generated token (any float dtype).

    Returns:
        ``(batch,)`` float32 in [0, 1]. Computed in log space (``logsumexp``), so it is exact for
        extreme logits; the softmax normaliser cancels and is never formed.

    Raises:
        FloatingPointError: a logit needed for the score is NaN (never turned into a score).
    """
    logits = logits.float()
    yes = torch.logsumexp(logits[:, list(answer.yes)], dim=-1)
    no = torch.logsumexp(logits[:, list(answer.no)], dim=-1)
    if torch.isnan(yes).any() or torch.isnan(no).any():
        raise FloatingPointError("judge produced NaN answer logits")
    return torch.sigmoid(yes - no)


def _left_pad(tokenizer: Any) -> None:
    tokenizer.padding_side = "left"


def encode_prompts(processor: Any, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> dict[str, torch.Tensor]:
    """Processor inputs for a batch of judge prompts, left-padded, ending at the answer position.

    Returns the processor's tensors (``input_ids``/``attention_mask`` ``(batch, seq)`` int64,
    ``pixel_values``, ``image_grid_thw``, ...).
    """
    texts, images = [], []
    for a, b, text in triples:
        messages = build_messages(a, b, text)
        texts.append(processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        images += [a, b]
    _left_pad(processor.tokenizer)
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


def encode_sft(
    processor: Any, rows: Sequence[tuple[Image.Image, Image.Image, str, str]]
) -> dict[str, torch.Tensor]:
    """A training batch: prompt (chat with generation prompt) + response + ``<|im_end|>``.

    ``labels`` ``(batch, seq)`` int64 are ``-100`` on the prompt and padding and the token ids
    on the response, so the first unignored label of each row is the answer token. Sequences
    are right-padded. Prompt and response are tokenised separately and concatenated, so the
    response's first token is exactly the answer token (no merge across the boundary).
    """
    tok = processor.tokenizer
    prompt = encode_prompts(processor, [(a, b, text) for a, b, text, _ in rows])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else end
    seqs, labels = [], []
    for i, (_, _, _, response) in enumerate(rows):
        p_ids = prompt["input_ids"][i][prompt["attention_mask"][i].bool()].tolist()
        r_ids = tok.encode(response, add_special_tokens=False) + [end]
        seqs.append(p_ids + r_ids)
        labels.append([IGNORE_INDEX] * len(p_ids) + r_ids)
    width = max(map(len, seqs))
    out = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    out["input_ids"] = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    out["attention_mask"] = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    out["labels"] = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for lab in labels])
    if "mm_token_type_ids" in prompt:
        image_id = processor.image_token_id
        out["mm_token_type_ids"] = (out["input_ids"] == image_id).long()
    return out


class Judge:
    """Scores (image A, image B, instruction) triples with P(Yes)/(P(Yes)+P(No)).

    One forward pass per batch of ``batch_size`` triples; no generation is needed for the
    score (only the first-position logits).
    """

    def __init__(self, model: Any, processor: Any, *, answer_variants: bool = False, batch_size: int = 8):
        self.model = model
        self.processor = processor
        self.batch_size = batch_size
        self.answer = check_answer_tokens(processor.tokenizer, variants=answer_variants)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw: Any) -> Judge:
        """Load a judge directory (``models`` or ``reward_merge`` output) with ``from_pretrained``."""
        from paco.models.loading import load_judge

        model, processor = load_judge(path, dtype=dtype)
        return cls(model.to(device), processor, **kw)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def first_token_logits(self, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> torch.Tensor:
        """``(batch, vocab)`` float32 logits at the first response position, one forward pass."""
        inputs = encode_prompts(self.processor, triples).to(self.device)
        logits = self.model(**inputs).logits
        return logits[:, -1, :].float()

    def score(self, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> list[float]:
        """P(Yes)/(P(Yes)+P(No)) per triple, floats in [0, 1], in input order."""
        scores: list[float] = []
        for i in range(0, len(triples), self.batch_size):
            chunk = triples[i : i + self.batch_size]
            scores += p_yes_from_logits(self.first_token_logits(chunk), self.answer).tolist()
        return scores
