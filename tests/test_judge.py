"""The judge: first-token score against a hand softmax, tokenizer checks, batching, SFT labels."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from paco.core.templates import judge_instruction
from paco.judge.model import (
    IGNORE_INDEX,
    AnswerTokens,
    Judge,
    JudgeTokenizerError,
    canonical_answer,
    check_answer_tokens,
    encode_sft,
    p_yes_from_logits,
)
from paco.judge.response import format_response


def test_p_yes_matches_hand_softmax():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0], [-50.0, 40.0, 1.0, 1.0]])
    answer = AnswerTokens(yes=(0,), no=(2,))
    got = p_yes_from_logits(logits, answer)
    for row, g in zip(logits.tolist(), got.tolist()):
        p = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
        assert g == pytest.approx(p[0] / (p[0] + p[2]), abs=1e-6)
    # variants: probability mass of several ids per answer
    both = p_yes_from_logits(logits[:1], AnswerTokens(yes=(0, 1), no=(2,)))
    row = logits[0].tolist()
    p = [math.exp(v) for v in row]
    assert both.item() == pytest.approx((p[0] + p[1]) / (p[0] + p[1] + p[2]), abs=1e-6)


def test_nan_logits_raise():
    with pytest.raises(FloatingPointError):
        p_yes_from_logits(torch.tensor([[float("nan"), 0.0]]), AnswerTokens(yes=(0,), no=(1,)))


class SplittingTokenizer:
    """Encodes 'Yes' as two tokens: a judge with it must be rejected."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class MergingTokenizer:
    """'Yes' is one token, but 'Yes.' merges into another: the target would not start with it."""

    def encode(self, text, add_special_tokens=False):
        for word, ids in (("Yes.", [7]), ("No.", [8]), ("Yes", [1]), ("No", [2])):
            if text.startswith(word):
                return ids + [9] * (len(text) - len(word))
        return [9]


class VocabTokenizer:
    """A vocabulary of whole strings; encodes by greedy longest match over the first 8 (so "Yes."
    is "Yes" + "."), decodes any id."""

    TEXTS = ["Yes", "No", ".", " ", "x", "<reason>", "</reason>", "1", " yes", "YES", "\nyes", "Yes ", "\tNO\n",
             " no", "Yes.", "yes!", "Yesterday", "nope", "Noah", "eyes", "y", "n"]

    def get_vocab(self):
        return {t.replace(" ", "\u0120"): i for i, t in enumerate(self.TEXTS)}  # spelled as byte-level BPE

    def decode(self, ids):
        return "".join(self.TEXTS[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        out = []
        while text:
            i = max((i for i, t in enumerate(self.TEXTS[:8]) if text.startswith(t)), key=lambda i: len(self.TEXTS[i]),
                    default=4)
            out.append(i)
            text = text[max(len(self.TEXTS[i]), 1):]
        return out


def test_answer_variants_are_the_reference_canonicalize():
    """answer_variants: every token whose text is yes/no after strip().lower() (reference
    canonicalize=True), the exact answer first; P(Yes) sums their probabilities."""
    assert [canonical_answer(t) for t in ("Yes", " yes", "YES\n", "\tNo ", "Yes.", "nope", "", None)] == \
        ["Yes", "Yes", "Yes", "No", None, None, None, None]
    tok = VocabTokenizer()
    texts = tok.TEXTS
    answer = check_answer_tokens(tok, variants=True)
    assert answer == AnswerTokens(yes=(0, 8, 9, 10, 11), no=(1, 12, 13))
    assert check_answer_tokens(tok) == AnswerTokens(yes=(0,), no=(1,))
    logits = torch.linspace(-3.0, 2.0, len(texts)).reshape(1, -1)
    p = [math.exp(v) for v in logits[0].tolist()]
    yes = sum(p[i] for i, t in enumerate(texts) if t.strip().lower() == "yes")
    no = sum(p[i] for i, t in enumerate(texts) if t.strip().lower() == "no")
    assert p_yes_from_logits(logits, answer).item() == pytest.approx(yes / (yes + no), rel=1e-6)


def test_tokenizer_checks():
    with pytest.raises(JudgeTokenizerError, match="'Yes' as 3 tokens"):
        check_answer_tokens(SplittingTokenizer())
    with pytest.raises(JudgeTokenizerError, match="does not start the target"):
        check_answer_tokens(MergingTokenizer())


@pytest.fixture(scope="module")
def judge(tiny_model_dirs):
    return Judge.from_pretrained(tiny_model_dirs["judge_base"], batch_size=8)


def panels(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(60, 140)), 128, 3), dtype=np.uint8)) for _ in range(n)]


def test_answer_variant_ids_on_the_real_tokenizer_match_a_full_scan(judge):
    tok = judge.processor.tokenizer
    scan = {w: tuple(sorted(i for i in range(len(tok)) if tok.decode([i]).strip().lower() == w.lower()))
            for w in ("Yes", "No")}
    answer = check_answer_tokens(tok, variants=True)
    assert answer.yes[0] == tok.convert_tokens_to_ids("Yes") and answer.no[0] == tok.convert_tokens_to_ids("No")
    assert (tuple(sorted(answer.yes)), tuple(sorted(answer.no))) == (scan["Yes"], scan["No"])
    assert len(scan["Yes"]) > 1


def test_scores_are_batch_invariant_and_one_forward_per_batch(judge):
    ims = panels(6)
    triples = [(ims[i], ims[i + 1], judge_instruction("a cat" if i % 2 else None)) for i in range(5)]
    calls = []
    hook = judge.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        batched = judge.score(triples)
    finally:
        hook.remove()
    assert len(calls) == 1, "a batch of 5 must be one forward pass"
    single = [judge.score([t])[0] for t in triples]
    assert all(0.0 <= s <= 1.0 for s in batched)
    # left padding and per-row image placement must not change a row's score
    assert np.allclose(batched, single, atol=1e-5)


def test_sft_batch_labels_start_with_the_answer(judge):
    ims = panels(4, seed=1)
    rows = [
        (ims[0], ims[1], judge_instruction("a rocket"), format_response(True, ["Same palette.", "Same shape."])),
        (ims[2], ims[3], judge_instruction(None), format_response(False, None)),
    ]
    batch = encode_sft(judge.processor, rows)
    tok = judge.processor.tokenizer
    assert batch["labels"].shape == batch["input_ids"].shape
    for i, want in enumerate((judge.answer.yes[0], judge.answer.no[0])):
        lab = batch["labels"][i]
        kept = lab[lab != IGNORE_INDEX]
        assert kept[0].item() == want
        assert tok.decode(kept).startswith(rows[i][3]) and tok.decode(kept).endswith("<|im_end|>")
    # the prompt part of the training batch gives the same answer logits as scoring
    logits = judge.model(**batch).logits
    pos = (batch["labels"][0] != IGNORE_INDEX).nonzero()[0].item()
    scored = judge.first_token_logits([rows[0][:3]])
    assert torch.allclose(logits[0, pos - 1], scored[0], atol=1e-4)
