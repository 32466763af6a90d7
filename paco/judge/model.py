"""The pairwise consistency judge (PaCo-Reward): scoring and SFT batch construction.

Score (paper §3.2): the judge reads one user turn ``[image A, image B, instruction]`` and the
score is the probability mass of the answer token ``Yes`` relative to ``No`` at the first
generated position::

    s = P(Yes) / (P(Yes) + P(No)) = sigmoid(logit_Yes - logit_No)

from the first-token logits. ``answer_variants=True`` is the reference's ``canonicalize=True``
(``get_yes_cond_prob_from_completion`` in PaCo-GRPO/paco_grpo/utils.py of X-GenGroup/PaCo-RL):
``P(Yes)`` and ``P(No)`` are the summed probabilities of every token whose text, stripped of
surrounding whitespace and lower-cased, is ``yes`` / ``no`` (:func:`canonical_answer`). The
reference sums over the ``top_logprobs`` (20) of a served reply, which is what
:func:`paco.judge.client.yes_probability` does; in process (:class:`Judge`) the whole vocabulary
is available and every such token is summed. Training targets are ``Yes. <reason>...</reason>``
/ ``No. ...`` (:func:`paco.judge.response.format_response`), so the answer is the first response
token; :func:`check_answer_tokens` rejects a tokenizer for which that does not hold.

Context length: a prompt plus its one answer token must fit the judge's context
(``max_position_embeddings`` of the model's text config, or a smaller ``max_model_len``), as
vLLM checks ``prompt tokens + max_tokens <= max_model_len``. :meth:`Judge.encode` raises
:class:`JudgeContextError` naming both numbers; nothing is truncated. (The released reward sends
the request to vLLM, which refuses it; the reference client then scores the pair 0.0 after its
retries, silently. We fail instead.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from paco.judge.chat import build_messages
from paco.judge.response import NO, YES, format_response

#: the label of a position that is not trained on (prompt and padding) in :func:`encode_sft`'s
#: ``labels``: PyTorch's ``cross_entropy`` default ``ignore_index``, which transformers uses too
IGNORE_INDEX = -100

def canonical_answer(text: Any) -> str | None:
    """``YES`` / ``NO`` if ``text.strip().lower()`` is ``"yes"`` / ``"no"``, else ``None``.

    The token matching of the reference's ``canonicalize=True`` (PaCo-GRPO/paco_grpo/utils.py,
    ``get_yes_cond_prob_from_completion``: ``token.strip().lower()`` compared with ``"yes"`` and
    ``"no"``): ``"Yes"``, ``" yes"``, ``"YES\\n"`` match; ``"Yes."``, ``"yes!"``, ``"Yesterday"``,
    ``"nope"`` do not. Non-``str`` input gives ``None``.
    """
    if not isinstance(text, str):
        return None
    word = text.strip().lower()
    return YES if word == "yes" else NO if word == "no" else None


class JudgeTokenizerError(ValueError):
    """The judge's tokenizer does not encode ``Yes``/``No`` as single answer tokens."""


class JudgeContextError(ValueError):
    """A judge prompt does not fit the judge's context (``n_tokens + 1 > limit``).

    Attributes:
        n_tokens: the prompt's length in tokens (image tokens included).
        limit: the judge's context in positions.
    """

    def __init__(self, n_tokens: int, limit: int, what: str = "judge prompt"):
        self.n_tokens = int(n_tokens)
        self.limit = int(limit)
        # the first sentence is vLLM's wording for the same refusal, so that clients recognise it
        super().__init__(
            f"This model's maximum context length is {self.limit} tokens. However, you requested "
            f"{self.n_tokens + 1} tokens ({self.n_tokens} in the messages, 1 in the completion). "
            f"The {what} is {self.n_tokens} tokens, which with its answer token exceeds the judge's context "
            f"of {self.limit} positions; shorten the instruction (e.g. judge_endpoint.instruction: rank instead of a "
            "long theme) or the images. Nothing is truncated."
        )


def context_limit(model: Any) -> int:
    """The judge's context in positions: ``max_position_embeddings`` of the text config.

    Raises:
        ValueError: the model config has no ``max_position_embeddings``.
    """
    config = model.config
    for cfg in (getattr(config, "text_config", None), config):
        n = getattr(cfg, "max_position_embeddings", None) if cfg is not None else None
        if isinstance(n, int) and n > 0:
            return n
    raise ValueError(f"{type(config).__name__} has no max_position_embeddings: cannot bound the judge's context")


def check_context(n_tokens: Sequence[int] | torch.Tensor, limit: int) -> None:
    """Raise :class:`JudgeContextError` for the first prompt whose length + 1 exceeds ``limit``.

    Args:
        n_tokens: prompt lengths in tokens, one per prompt.
        limit: context length in positions (vLLM's ``max_model_len``).
    """
    for n in (n_tokens.tolist() if isinstance(n_tokens, torch.Tensor) else n_tokens):
        if int(n) + 1 > limit:
            raise JudgeContextError(int(n), limit)


@dataclass(frozen=True)
class AnswerTokens:
    """Token ids whose first-position probabilities make P(Yes) and P(No)."""

    yes: tuple[int, ...]
    no: tuple[int, ...]


def canonical_answer_ids(tokenizer: Any) -> dict[str, list[int]]:
    """Every vocabulary id whose decoded text is a :func:`canonical_answer`, by answer.

    Candidates are the vocabulary entries (``tokenizer.get_vocab()``, added tokens included)
    whose spelling contains ``yes``/``no`` in any case (byte-level BPE and SentencePiece spell
    ASCII letters as themselves); each is then decoded alone (``tokenizer.decode([id])``) and
    kept if :func:`canonical_answer` of its text is the answer.

    Returns:
        ``{YES: [ids...], NO: [ids...]}``, each sorted ascending.
    """
    out: dict[str, list[int]] = {YES: [], NO: []}
    for spelling, i in tokenizer.get_vocab().items():
        low = str(spelling).lower()
        if "yes" not in low and "no" not in low:
            continue
        word = canonical_answer(tokenizer.decode([int(i)]))
        if word is not None:
            out[word].append(int(i))
    return {w: sorted(set(v)) for w, v in out.items()}


def check_answer_tokens(tokenizer: Any, *, variants: bool = False) -> AnswerTokens:
    """Find the answer token ids and check the training target starts with them.

    ``Yes`` and ``No`` must each be exactly one token, and the tokenisation of a full target
    (``"Yes. <reason>1. x.</reason>"``) must start with that token (a tokenizer that merges
    ``"Yes."`` into one token would make the first-token score meaningless). With ``variants``,
    every other id whose text is ``yes``/``no`` after ``strip().lower()``
    (:func:`canonical_answer_ids`, the reference's ``canonicalize=True``) is added after the
    exact token.

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
        found = canonical_answer_ids(tokenizer)
        for word in (YES, NO):
            ids[word] += [i for i in found[word] if i not in ids[word]]
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

    Args:
        model, processor: a Qwen2.5-VL judge and its processor.
        answer_variants: sum every ``yes``/``no`` token (see the module docstring).
        batch_size: triples per forward pass in :meth:`score`.
        max_model_len: context bound in positions (vLLM's ``--max-model-len``); ``None``: the
            model's :func:`context_limit`.

    Raises:
        JudgeTokenizerError: see :func:`check_answer_tokens`.
        ValueError: ``max_model_len`` < 2 or larger than the model's context.
    """

    def __init__(self, model: Any, processor: Any, *, answer_variants: bool = False, batch_size: int = 8,
                 max_model_len: int | None = None):
        self.model = model
        self.processor = processor
        self.batch_size = batch_size
        self.answer = check_answer_tokens(processor.tokenizer, variants=answer_variants)
        limit = context_limit(model)
        if max_model_len is not None and not 2 <= int(max_model_len) <= limit:
            raise ValueError(f"max_model_len {max_model_len} must be in [2, {limit}] (the model's "
                             "max_position_embeddings)")
        self.max_model_len = int(max_model_len) if max_model_len is not None else limit

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw: Any) -> Judge:
        """Load a judge directory (``models`` or ``reward_merge`` output) with ``from_pretrained``
        (:func:`paco.models.loading.load_judge`).

        Raises:
            paco.models.loading.ModelDirectoryError: the directory, a file or a readable,
                complete weights file is missing.
            paco.models.loading.WeightsMismatchError: the checkpoint's tensors are not the model's.
        """
        from paco.models.loading import load_judge

        model, processor = load_judge(path, dtype=dtype)
        return cls(model.to(device), processor, **kw)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode(self, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> dict[str, torch.Tensor]:
        """:func:`encode_prompts` (left-padded, on CPU) after checking every prompt fits.

        Raises:
            JudgeContextError: a prompt's length + 1 exceeds :attr:`max_model_len`.
            ValueError: the processor refused an input (e.g. an extreme aspect ratio).
        """
        inputs = encode_prompts(self.processor, triples)
        check_context(inputs["attention_mask"].sum(dim=1), self.max_model_len)
        return inputs

    @torch.no_grad()
    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(batch, vocab)`` float32 logits at the last position of encoded ``inputs``, one
        language-model forward pass (``inputs`` from :meth:`encode`, or such encodings
        concatenated along the batch).

        The vision tower runs once per row (:meth:`image_features`), so a row's logits do not
        depend on the other rows' images: batched, the tower's linear layers see more rows, and
        CPU GEMM kernels for few rows (a 64 px panel gives 8 merged tokens) round differently
        (measured: ~1e-7 in the image features, ~3e-6 in the logits, torch 2.13 / transformers
        5.24). The language model over rows of one length is row-invariant (checked up to 32 rows).
        """
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if inputs.get("pixel_values") is not None and inputs["input_ids"].shape[0] > 1:
            pixel_values = inputs.pop("pixel_values")
            inputs["mm_encoder_outputs"] = {"image": self.image_features(inputs["input_ids"], pixel_values,
                                                                         inputs["image_grid_thw"])}
        return self.model(**inputs).logits[:, -1, :].float()

    def image_features(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """The vision tower's output for ``input_ids``' images, computed row by row: each row's
        images (counted by their ``<|vision_start|>`` tokens; ``grid_thw`` rows in order, each
        image ``t*h*w`` rows of ``pixel_values``) in their own call, exactly as when the row is
        scored alone. Returns the model's ``get_image_features`` output with every image's
        embeddings in ``pooler_output`` (a tuple, one ``(tokens, hidden)`` tensor per image), as
        the forward pass's ``mm_encoder_outputs["image"]`` takes it.

        Raises:
            ValueError: the rows' image count differs from ``grid_thw``'s.
        """
        per_row = (input_ids == self.model.config.vision_start_token_id).sum(dim=1).tolist()
        if sum(per_row) != grid_thw.shape[0]:
            raise ValueError(f"{sum(per_row)} images in the prompts, {grid_thw.shape[0]} image grids")
        patches = grid_thw.prod(dim=-1).tolist()
        first, embeds, image, patch = None, [], 0, 0
        for n in per_row:
            if n == 0:
                continue
            rows = sum(patches[image:image + n])
            out = self.model.get_image_features(pixel_values[patch:patch + rows], grid_thw[image:image + n],
                                                return_dict=True)
            first = first if first is not None else out
            embeds += list(out.pooler_output)
            image, patch = image + n, patch + rows
        first.pooler_output = tuple(embeds)
        return first

    def first_token_logits(self, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> torch.Tensor:
        """``(batch, vocab)`` float32 logits at the first response position, one forward pass.

        Raises:
            JudgeContextError, ValueError: see :meth:`encode`.
        """
        return self.logits(self.encode(triples))

    def score(self, triples: Sequence[tuple[Image.Image, Image.Image, str]]) -> list[float]:
        """P(Yes)/(P(Yes)+P(No)) per triple, floats in [0, 1], in input order.

        Raises:
            JudgeContextError, ValueError: see :meth:`encode`.
        """
        scores: list[float] = []
        for i in range(0, len(triples), self.batch_size):
            chunk = triples[i : i + self.batch_size]
            scores += p_yes_from_logits(self.first_token_logits(chunk), self.answer).tolist()
        return scores
