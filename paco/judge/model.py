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
:func:`yes_probability` does; in process (:class:`Judge`) the whole vocabulary
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

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from paco.core.caching import BytesLRU
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


class AnswerLogprobsError(ValueError):
    """First-token ``top_logprobs`` from which no score can be computed (neither answer among
    them, or an entry that is not a token with a finite log-probability <= 0)."""


def yes_probability(top_logprobs: Sequence[dict[str, Any]], *, answer_variants: bool = False) -> float:
    """``P(Yes) / (P(Yes) + P(No))`` from one position's ``top_logprobs`` entries.

    Args:
        top_logprobs: ``[{"token": str, "logprob": float}, ...]`` (OpenAI / vLLM layout).
        answer_variants: the reference's ``canonicalize=True``: ``P(Yes)`` / ``P(No)`` sum the
            probabilities of every entry whose token, stripped and lower-cased, is ``yes`` /
            ``no`` (:func:`paco.judge.model.canonical_answer`; ``" yes"``, ``"YES\\n"`` count,
            ``"Yes."`` does not). Off: only the exact tokens ``Yes`` and ``No``.

    Returns:
        A float in [0, 1], computed in log space (``sigmoid(lse(yes) - lse(no))``; equal to the
        reference's ``sum(exp) / (sum(exp) + sum(exp))`` in float64 up to rounding). Each entry
        counts once (the reference keys a dict by token text, so of two entries with the same
        text it keeps the last; distinct token ids of a byte-level vocabulary have distinct
        texts).

    Raises:
        AnswerLogprobsError: neither answer is among the tokens, an entry is not ``{"token": str,
            "logprob": number}``, or a log-prob is a bool, NaN, infinite or above 0 (no slack: a
            float log-softmax is <= 0, its sum's largest term being exactly 1; a positive value
            means logits, e.g. vLLM's ``--logprobs-mode raw_logits``).
    """
    yes, no = [], []
    for entry in top_logprobs:
        if not isinstance(entry, dict):
            raise AnswerLogprobsError(f"invalid top_logprobs entry {entry!r:.100} (not an object)")
        token, lp = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str):
            raise AnswerLogprobsError(f"invalid token {token!r:.100} in a top_logprobs entry (not a string)")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 0:
            raise AnswerLogprobsError(f"invalid logprob {lp!r:.100} for token {token!r:.100} (a log-probability is a "
                             "finite number <= 0)")
        word = canonical_answer(token) if answer_variants else token if token in (YES, NO) else None
        if word == YES:
            yes.append(float(lp))
        elif word == NO:
            no.append(float(lp))
    if not yes and not no:
        shown = [e.get("token") for e in top_logprobs][:8]
        raise AnswerLogprobsError(f"neither {YES!r} nor {NO!r} among the {len(top_logprobs)} top first tokens {shown}")
    if not no:
        return 1.0
    if not yes:
        return 0.0

    def lse(v: list[float]) -> float:
        m = max(v)
        return m + math.log(sum(math.exp(x - m) for x in v))

    d = lse(yes) - lse(no)
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


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


class TowerCache(BytesLRU):
    """A byte-bounded LRU (:class:`paco.core.caching.BytesLRU`) of the vision tower's output per
    image, keyed by the image's preprocessed pixel rows (a BLAKE2b digest of their bytes), image
    grid, dtype and shape: what vLLM's encoder cache does for multimodal inputs. A hit returns the
    tensor the tower computed for the same rows, so scores are bit-identical with or without it.
    In GRPO a 2x2 grid's 4 panels appear in 6 pairs and an edit's input in every request of its
    group, so most images recur.

    The entries are the model's outputs for its weights when computed: a model whose weights
    change (training) needs a new cache or :meth:`clear`. Thread-safe. ``max_bytes`` 0 disables
    it (every image computed, nothing hashed).

    Raises:
        ValueError: ``max_bytes`` < 0.
    """

    def __init__(self, max_bytes: int = 64 << 20):
        super().__init__(max_bytes, sizeof=lambda t: t.numel() * t.element_size())

    @staticmethod
    def key(rows: torch.Tensor, grid: torch.Tensor) -> tuple:
        """``(digest, grid, dtype, shape)`` of one image's ``pixel_values`` rows and ``grid_thw`` row."""
        data = rows.detach().contiguous().cpu()
        digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"",
                                 digest_size=16).hexdigest()
        return digest, tuple(int(v) for v in grid.tolist()), str(rows.dtype), tuple(rows.shape)


@torch.no_grad()
def image_features(model: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                   cache: TowerCache | None = None) -> Any:
    """The vision tower's output for each image on its own: image ``i`` is the ``t*h*w`` rows of
    ``pixel_values`` (``(patches, channels x temporal x patch^2)``, the Qwen2-VL processor's
    layout) after the previous images', with ``grid_thw[i]`` (``(images, 3)`` int). Returns a
    ``BaseModelOutputWithPooling`` whose ``pooler_output`` is a tuple of one
    ``(merged tokens, hidden)`` tensor per image, as a Qwen2.5-VL forward pass's
    ``mm_encoder_outputs["image"]`` takes it. Images whose rows ``cache`` holds are not computed
    again.

    Per image, because CPU GEMM kernels round few rows differently from many (the tower over a
    pair's two 64 px panels, 8 merged tokens each, gave other features than over one: ~1e-7, and
    ~3e-6 in the logits; torch 2.13 / transformers 5.24): an image's features then depend on its
    own pixels only, not on the other image of its pair nor on a batch's other rows.

    Raises:
        ValueError: ``pixel_values`` has another number of rows than ``grid_thw`` names.
    """
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    cache = cache if cache is not None else TowerCache(0)
    device = next(model.parameters()).device
    patches = grid_thw.prod(dim=-1).tolist()
    if sum(patches) != pixel_values.shape[0]:
        raise ValueError(f"{pixel_values.shape[0]} pixel rows, the image grids name {sum(patches)}")
    embeds, start = [], 0
    for i, n in enumerate(patches):
        rows = pixel_values[start:start + n]
        key = TowerCache.key(rows, grid_thw[i]) if cache.max_bytes else None
        out = cache.get(key) if key is not None else None
        if out is None:
            (out,) = model.get_image_features(rows.to(device), grid_thw[i:i + 1].to(device),
                                              return_dict=True).pooler_output
            if key is not None:
                cache.put(key, out)
        embeds.append(out)
        start += n
    return BaseModelOutputWithPooling(pooler_output=tuple(embeds))


@torch.no_grad()
def last_position_logits(model: Any, inputs: dict[str, torch.Tensor], cache: TowerCache | None = None) -> torch.Tensor:
    """``(batch, vocab)`` float32 logits at the last position of a processor's ``inputs`` (left
    padded), one language-model forward pass with the head on that position only
    (``logits_to_keep=1``).

    Inputs with ``image_grid_thw`` (the Qwen2-VL family) get their image features from
    :func:`image_features`, one tower call per image (``cache``: a :class:`TowerCache`, or none),
    so a row's logits do not depend on the other rows of a batch nor an image's features on the
    other image of its pair; the language model over rows of one length is row-invariant (checked
    up to 32 rows). Other models run their own forward pass on ``inputs``.
    """
    device = next(model.parameters()).device
    pixel_values = inputs.get("pixel_values") if "image_grid_thw" in inputs else None
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
             if pixel_values is None or k != "pixel_values"}
    if pixel_values is not None:
        moved["mm_encoder_outputs"] = {"image": image_features(model, pixel_values, inputs["image_grid_thw"], cache)}
    return model(**moved, logits_to_keep=1).logits[:, -1, :].float()


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
        tower_cache_bytes: bound of the :class:`TowerCache` of per-image vision features
            (0: none).

    Raises:
        JudgeTokenizerError: see :func:`check_answer_tokens`.
        ValueError: ``max_model_len`` < 2 or larger than the model's context; a negative
            ``tower_cache_bytes``.
    """

    def __init__(self, model: Any, processor: Any, *, answer_variants: bool = False, batch_size: int = 8,
                 max_model_len: int | None = None, tower_cache_bytes: int = 64 << 20):
        self.model = model
        self.processor = processor
        self.batch_size = batch_size
        self.answer = check_answer_tokens(processor.tokenizer, variants=answer_variants)
        limit = context_limit(model)
        if max_model_len is not None and not 2 <= int(max_model_len) <= limit:
            raise ValueError(f"max_model_len {max_model_len} must be in [2, {limit}] (the model's "
                             "max_position_embeddings)")
        self.max_model_len = int(max_model_len) if max_model_len is not None else limit
        self.tower_cache = TowerCache(tower_cache_bytes)

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
        concatenated along the batch): :func:`last_position_logits` with this judge's
        :class:`TowerCache`."""
        return last_position_logits(self.model, inputs, self.tower_cache)

    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """:func:`image_features` of this judge's model, with its :class:`TowerCache`."""
        return image_features(self.model, pixel_values, grid_thw, self.tower_cache)

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
