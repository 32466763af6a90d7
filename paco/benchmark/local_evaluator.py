"""The benchmarks' in-process evaluator: the three request kinds of
:class:`paco.benchmark.evaluator.Evaluator` (``yes_no``, ``reply``, ``score_tokens``) answered by a
``transformers`` vision-language model loaded in this process (``AutoModelForImageTextToText`` + its processor's chat template; any
number of images), for GPU nodes without vLLM and for CPU tests. Only the transport differs from
the OpenAI client: requests, the answer cache, the stored answer records (``{"content",
"top_logprobs"}`` / ``{"content", "finish_reason"}``) and the scores computed from them
(``_yes``, :func:`~paco.benchmark.evaluator.token_logprobs`, the protocols' reply parsing) are
:class:`Evaluator`'s own.

How each answer is computed (one request at a time under ``torch.no_grad``, greedy, the weights
in one fixed dtype):

* chat: one user turn of the images (decoded from the exact bytes the OpenAI client would send,
  :func:`paco.core.io.decode_image`, as the project's judge server decodes them) and the text, in
  the request's layout (images first, or the text first), through the processor's chat template
  with the generation prompt (``apply_chat_template(..., add_generation_prompt=True)``; the same
  template vLLM's chat endpoint applies).
* ``yes_no`` / ``score_tokens``: one forward pass; the first generated token's log-probs are
  ``log_softmax`` (float32) of the last position's logits, the top ``top_logprobs`` of them
  (``torch.topk``) stored as ``[{"token": tokenizer.decode([id]), "logprob"}]``, ``content`` the
  greedy token's text. This is vLLM's default ``logprobs`` (``--logprobs-mode raw_logprobs``: the
  log-softmax of the raw model distribution, before temperature, penalties or other logits
  processors) and exactly what ``paco.serving.server`` returns
  (:meth:`paco.serving.server.batching.BatchingJudge._score`); vLLM may add the sampled token as an
  extra entry, which is then among the top ones anyway. The yes/no score is then
  ``sigmoid(lse(Yes) - lse(No))`` of those log-probs (:func:`paco.judge.model.yes_probability`),
  equal to the soft-max of the ``Yes`` / ``No`` logits against each other (T2IS
  ``test_prompt_consistency.py`` lines 147-158) when both are among the top entries.
* ``reply``: ``model.generate(max_new_tokens=max_tokens, do_sample=False)`` on the model's own
  ``generation_config`` otherwise (its EOS ids stop it; a ``repetition_penalty`` there applies, as
  in vLLM's default ``--generation-config auto`` and in Step1X-Edit's ``qwen25vl_eval.py``, which
  calls ``generate`` on the model's defaults); the text is the new tokens decoded with
  ``skip_special_tokens=True`` (vLLM's default), ``finish_reason`` ``stop`` when the last new
  token is an EOS id, else ``length``.

Context: a prompt of ``n`` tokens with ``max_tokens`` to generate must have
``n + max_tokens <= max_model_len`` (the model's ``max_position_embeddings``, or a smaller bound),
vLLM's check; else :class:`~paco.benchmark.evaluator.EvaluatorContextLengthError`, nothing
truncated.

Cache key: :class:`Evaluator`'s fields plus ``backend: "transformers"`` and ``dtype`` (the
configured one), so answers of a served model and of this backend never mix. The model is loaded
on the first request the cache cannot answer (or by :meth:`LocalEvaluator.load`): a rerun whose
answers are all cached loads nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from paco.benchmark.answer_cache import AnswerCache
from paco.benchmark.evaluator import Evaluator, EvaluatorContextLengthError
from paco.core.io import decode_image
from paco.models.loading import check_transformers_dir, load_image_text_to_text

__all__ = ["BACKEND", "DTYPES", "LocalEvaluator", "chat_messages"]

#: this backend's name in the params (``benchmark.<k>.evaluators.<name>.backend``) and cache keys
BACKEND = "transformers"
#: the weights' dtypes accepted (``auto``: the checkpoint's own ``torch_dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def chat_messages(images: list[Any], text: str, *, text_first: bool = False) -> list[dict[str, Any]]:
    """One user turn of ``images`` and ``text`` for a transformers processor's chat template:
    :func:`paco.judge.chat.build_messages` for any number of images (equal to it for two images
    and ``text_first=False``), the layout of :func:`paco.benchmark.evaluator.build_chat`.

    Returns:
        ``[{"role": "user", "content": [{"type": "image", "image": im} ..., {"type": "text",
        "text": text}]}]`` (the text item first when ``text_first``).
    """
    items = [{"type": "image", "image": im} for im in images]
    item = {"type": "text", "text": text}
    return [{"role": "user", "content": [item, *items] if text_first else [*items, item]}]


class LocalEvaluator(Evaluator):
    """An :class:`~paco.benchmark.evaluator.Evaluator` whose answers come from a transformers
    model in this process (module docstring: how, the cache key).

    Args:
        name: this evaluator's name in the cache key and the scores.
        model_dir: the model directory (``config.json``, safetensors weights, processor files).
        model: the model's name in the cache key (the served model name it stands for).
        device: ``auto`` (``cuda`` if available, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: one of :data:`DTYPES` (``float32`` on CPU; ``bfloat16`` on GPU, as vLLM serves).
        max_model_len: the context bound in positions (``None``: the model's
            ``max_position_embeddings``, :func:`paco.judge.model.context_limit`).
        top_logprobs, answer_variants, cache, cache_part: as :class:`Evaluator`'s.

    Attributes:
        asked: answers computed by the model; ``hits``: answers the cache gave; ``loaded``:
        whether the model is loaded.

    Raises:
        ValueError: an empty name or model, ``top_logprobs`` < 1, an unknown ``dtype`` or
            ``device``, ``max_model_len`` < 2.
        paco.models.loading.ModelDirectoryError: ``model_dir`` does not exist or has no
            ``config.json`` or no complete weights
            (:func:`paco.models.loading.check_transformers_dir`).
        paco.benchmark.answer_cache.AnswerCacheError: the cache directory cannot be used.
    """

    concurrency = 1

    def __init__(self, name: str, model_dir: str | Path, model: str, *, device: str = "auto",
                 dtype: str = "float32", max_model_len: int | None = None, top_logprobs: int = 20,
                 answer_variants: bool = False, cache: AnswerCache | str | Path | None = None,
                 cache_part: str = "0"):
        self._setup(name, model, top_logprobs, answer_variants)
        if dtype not in DTYPES:
            raise ValueError(f"evaluator {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
            raise ValueError(f"evaluator {name!r}: device {device!r}: auto, cpu, cuda or cuda:N")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 2):
            raise ValueError(f"evaluator {name!r}: max_model_len must be an int >= 2 or None, got {max_model_len!r}")
        self.model_dir = check_transformers_dir(model_dir, f"evaluator {name!r}")
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        self.base_url = f"transformers:{self.model_dir}"
        self.cache = cache if isinstance(cache, AnswerCache) else AnswerCache(cache, part=cache_part)
        self._model: Any = None
        self._processor: Any = None
        self._load_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalEvaluator({self.name!r}, {str(self.model_dir)!r}, model={self.model!r})"

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def _key_fields(self) -> dict[str, Any]:
        return {"backend": BACKEND, "dtype": self.dtype}

    def describe(self) -> dict[str, Any]:
        """``{name, backend, model_dir, model, device, dtype, top_logprobs, answer_variants}``."""
        return {"name": self.name, "backend": BACKEND, "model_dir": str(self.model_dir), "model": self.model,
                "device": self.device, "dtype": self.dtype, "top_logprobs": self.top_logprobs,
                "answer_variants": self.answer_variants}

    def check_model(self) -> None:
        """Load the model now (:meth:`load`): raises what loading raises."""
        self.load()

    def load(self) -> None:
        """Load the model and processor onto ``device`` (once; later calls return at once; safe
        from several threads): :func:`paco.models.loading.load_image_text_to_text`
        (``AutoModelForImageTextToText``, weights checked; the image-only Qwen2.5-VL processor for
        ``qwen2_5_vl``, without torchvision, else ``AutoProcessor``) in :data:`DTYPES` [``dtype``].

        Raises:
            paco.models.loading.ModelDirectoryError, paco.models.loading.WeightsMismatchError:
                see :func:`~paco.models.loading.load_image_text_to_text`.
        """
        with self._load_lock:
            if self._model is not None:
                return
            model, processor = load_image_text_to_text(self.model_dir, dtype=DTYPES[self.dtype], what="evaluator")
            device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
            self._processor, self._model = processor, model.to(device)

    def close(self) -> None:
        """Drop the model (its memory is freed with the last reference; the CUDA cache emptied)."""
        with self._load_lock:
            was_cuda = self._model is not None and next(self._model.parameters()).is_cuda
            self._model = self._processor = None
        if was_cuda:
            torch.cuda.empty_cache()

    def _where(self, cached: bool) -> str:
        return (f"evaluator {self.name!r} {'cached answer' if cached else 'answer'} of the transformers model "
                f"{self.model_dir} ({self.model!r})")

    # ------------------------------------------------------------------ the transport

    def encode(self, pngs: list[bytes], text: str, *, text_first: bool = False) -> dict[str, torch.Tensor]:
        """The processor's tensors (batch of one, on the model's device; floating ones in its
        dtype) of one request: :func:`chat_messages` of the decoded images through the chat
        template with the generation prompt. Loads the model if need be.

        Raises:
            paco.core.io.ImageDecodeError: an image cannot be decoded.
        """
        self.load()
        images = [decode_image(p, what=f"evaluator {self.name!r} image {i + 1}") for i, p in enumerate(pngs)]
        prompt = self._processor.apply_chat_template(chat_messages(images, text, text_first=text_first),
                                                     tokenize=False, add_generation_prompt=True)
        inputs = self._processor(text=[prompt], images=images or None, return_tensors="pt")
        param = next(self._model.parameters())
        return {k: (v.to(param.device, dtype=param.dtype) if v.is_floating_point() else v.to(param.device))
                if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _check_context(self, n_tokens: int, max_tokens: int) -> None:
        from paco.judge.model import context_limit

        limit = context_limit(self._model) if self.max_model_len is None else self.max_model_len
        if n_tokens + max_tokens > limit:
            raise EvaluatorContextLengthError(
                f"evaluator {self.name!r}: This model's maximum context length is {limit} tokens. However, you "
                f"requested {n_tokens + max_tokens} tokens ({n_tokens} in the messages, {max_tokens} in the "
                "completion). Nothing is truncated.", n_tokens, limit)

    @torch.no_grad()
    def first_token_logprobs(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(vocab,)`` float32 log-probs of the first generated token: ``log_softmax`` of the
        last position's logits of one forward pass (``inputs`` from :meth:`encode`), computed as
        the project's judge server computes them (:func:`paco.judge.model.last_position_logits`:
        the head on the last position only, a Qwen2-VL model's tower once per image), so a
        two-image question gets the server's numbers bit for bit on one device."""
        from paco.judge.model import last_position_logits

        logits = last_position_logits(self._model, inputs)[0]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def generate(self, inputs: dict[str, torch.Tensor], max_tokens: int) -> tuple[list[int], str]:
        """``(new token ids, finish_reason)`` of the greedy reply (module docstring)."""
        out = self._model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        eos = self._model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        return new, "stop" if new and new[-1] in eos else "length"

    def _ask(self, request: dict[str, Any], pngs: list[bytes]) -> None:
        """Answer one request with the model and cache the answer record the OpenAI client stores."""
        inputs = self.encode(pngs, request["text"], text_first=request["layout"] == "text_first")
        self._check_context(int(inputs["input_ids"].shape[1]), request["max_tokens"])
        tokenizer = self._processor.tokenizer
        if request["kind"] == "reply":
            new, finish = self.generate(inputs, request["max_tokens"])
            answer: dict[str, Any] = {"content": tokenizer.decode(new, skip_special_tokens=True),
                                      "finish_reason": finish}
        else:
            lp = self.first_token_logprobs(inputs)
            values, ids = torch.topk(lp, min(request["top_logprobs"], lp.shape[-1]))
            top = [{"token": tokenizer.decode([int(i)]), "logprob": float(v)} for i, v in zip(ids, values)]
            answer = {"content": tokenizer.decode([int(ids[0])], skip_special_tokens=True), "top_logprobs": top}
        self.cache.put(request, answer)
        with self._lock:
            self.asked += 1
