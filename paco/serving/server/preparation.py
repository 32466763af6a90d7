"""The judge server's request path before the queue: :class:`RequestPreparer` turns a body into
the worker's input, and :class:`ImageFeatureCache` keeps the image features a grid's recurring
panels hit.

The handler (asyncio, :mod:`paco.serving.server.app`) reads the body under a size bound and a
per-read timeout, then, on a thread of the server's pool, scans its JSON (size bounds, nothing
built), validates it, decodes both images (each in the format its data URL declares; the pixel
bounds, per image and per request, checked from the headers before decoding), bounds the
instruction's tokens and encodes the request with the judge's processor
(:meth:`paco.judge.model.Judge.encode`, whose exact prompt length is checked against the
context). Only then is it queued for the one worker
thread that owns the model (:class:`paco.serving.server.batching.BatchingJudge`), so the worker does
nothing but forward passes and the CPU-bound preparation of the next requests overlaps them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from paco.core.caching import BytesLRU
from paco.judge.model import JudgeContextError, check_context, encode_prompts
from paco.serving.server.limits import ServerLimits
from paco.serving.server.protocol import IMAGE_KEY, _DecodedImages, parse_chat_request


class ImageFeatureCache:
    """The judge processor's image processor with a byte-bounded LRU of per-image features,
    keyed by the image's content digest (what vLLM's multimodal processor cache does).

    In GRPO every panel of a grid appears in several pairs (a 2x2 grid's 4 panels in 6), so
    most images a server sees were decoded and preprocessed moments before. Images without a
    digest (``image.info[IMAGE_KEY]``) are processed and not cached.

    Each image is processed on its own and the features concatenated in order, which is what the
    Qwen2-VL image processor does for a list (checked bit for bit in tests/test_serve_batching.py).
    Thread-safe; other attributes are the wrapped processor's.

    Args:
        image_processor: e.g. ``Qwen2VLImageProcessorPil``.
        max_bytes: bound on the cached tensors' bytes (0 disables caching).
    """

    def __init__(self, image_processor: Any, max_bytes: int = 128 << 20):
        self._inner = image_processor
        self._cache = BytesLRU(max_bytes, sizeof=lambda feats: sum(
            v.numel() * v.element_size() for v in feats.values() if isinstance(v, torch.Tensor)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def hits(self) -> int:
        return self._cache.hits

    @property
    def misses(self) -> int:
        return self._cache.misses

    def _features(self, image: Any, kwargs: dict[str, Any], kw_key: str) -> dict[str, Any]:
        digest = getattr(image, "info", {}).get(IMAGE_KEY)
        key = (digest, kw_key)
        cached = digest is not None and self._cache.max_bytes > 0
        hit = self._cache.get(key) if cached else None
        if hit is not None:
            return hit
        feats = dict(self._inner([image], **kwargs))
        if cached:
            self._cache.put(key, feats)
        return feats

    def __call__(self, images: Any, **kwargs: Any) -> Any:
        from transformers import BatchFeature

        images = list(images) if isinstance(images, (list, tuple)) else [images]
        tensor_type = kwargs.get("return_tensors")
        kwargs = {**kwargs, "return_tensors": "pt"}
        kw_key = repr(sorted((k, repr(v)) for k, v in kwargs.items()))
        parts = [self._features(im, kwargs, kw_key) for im in images]
        merged = {name: torch.cat([p[name] for p in parts], dim=0) for name in parts[0]}
        return BatchFeature(merged, tensor_type=tensor_type)


class RequestPreparer:
    """Turns a request body into a queued item's parts: parse, decode, bound, encode.

    The instruction is bounded before the processor sees it (:meth:`check_text`); the exact
    prompt length, image tokens included, is checked once the request is encoded, both as
    :class:`paco.judge.model.JudgeContextError`.
    """

    def __init__(self, judge: Any, served_model_name: str, limits: ServerLimits, max_logprobs: int,
                 encode: bool = True):
        self.judge = judge
        self.served_model_name = served_model_name
        self.limits = limits
        self.max_logprobs = max_logprobs
        self.encode = encode
        self.max_model_len = int(getattr(judge, "max_model_len", 0) or 0)
        self.image_features = ImageFeatureCache(judge.processor.image_processor, limits.feature_cache_bytes)
        self._local = threading.local()
        self.decoded = _DecodedImages(limits.feature_cache_bytes // 4)
        tok = judge.processor.tokenizer
        self._max_token_chars = max((len(t) for t in tok.get_vocab()), default=1) or 1

    def processor(self) -> Any:
        """This thread's copy of the judge's processor: its own tokenizer (a fast tokenizer's
        padding state is not safe to share between threads) and the shared
        :class:`ImageFeatureCache`; the judge's own processor, used in process, is untouched."""
        proc = getattr(self._local, "processor", None)
        if proc is None:
            proc = copy.copy(self.judge.processor)
            proc.tokenizer = copy.deepcopy(self.judge.processor.tokenizer)
            proc.image_processor = self.image_features
            self._local.processor = proc
        return proc

    def check_text(self, text: str) -> None:
        """Raise :class:`JudgeContextError` when ``text`` has more characters than
        ``max_model_len x`` the longest token of the vocabulary: it is then longer than the context
        in tokens, whatever they are (a lower bound, no tokenizing). Shorter texts are counted
        exactly, with the images, when the request is encoded."""
        if self.max_model_len and len(text) > self.max_model_len * self._max_token_chars:
            raise JudgeContextError(len(text) // self._max_token_chars, self.max_model_len,
                                    f"judge instruction alone ({len(text)} characters; a lower bound in tokens)")

    def __call__(self, body: bytes) -> tuple[tuple[Any, Any, str], int, Any]:
        """``(triple, top_k, encoding or None)``.

        Raises:
            BadRequest: protocol or limit (400/404).
            paco.judge.model.JudgeContextError: too long for the context.
            ValueError: the processor refused the input (e.g. an extreme aspect ratio).
        """
        limits = self.limits
        triple, top_k = parse_chat_request(body, self.served_model_name, max_logprobs=self.max_logprobs,
                                           max_image_pixels=limits.max_image_pixels,
                                           max_request_pixels=limits.max_request_pixels,
                                           max_content_parts=limits.max_content_parts,
                                           max_json_values=limits.max_json_values, decoded=self.decoded)
        self.check_text(triple[2])
        if not self.encode:
            return triple, top_k, None
        inputs = encode_prompts(self.processor(), [triple])  # as judge.encode, features cached
        check_context(inputs["attention_mask"].sum(dim=1), self.max_model_len or 1 << 62)
        return triple, top_k, inputs
