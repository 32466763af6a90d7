"""Serve a PaCo-Reward judge over the OpenAI-compatible subset that vLLM exposes (FastAPI + uvicorn).

At paper scale the judge is served by vLLM on GPUs::

    vllm serve data/reward_merge/model --served-model-name paco-reward --port 8000

and the GRPO stage is pointed at it with ``judge_endpoint.url: http://<host>:8000/v1``. This module is
the same protocol on a transformers backend, for CPUs, single GPUs and tests::

    paco-serve-judge --model data/reward_merge/model --served-model-name paco-reward --port 8000

Endpoints:

* ``POST /v1/chat/completions`` -- one user message whose content is two ``image_url`` items
  (``data:image/png;base64,...`` or JPEG) and one ``text`` item, ``max_tokens`` (or
  ``max_completion_tokens``) 1, ``logprobs: true``, ``top_logprobs`` from 0 to ``--max-logprobs``
  (default 20, as vLLM's flag of the same name). The body is validated by pydantic models of
  the OpenAI schema (:class:`ChatCompletionRequest`; fields outside the served subset such as
  ``temperature`` or ``seed`` are accepted and do not change the answer). The answer is the
  greedy first token; ``choices[0].logprobs.content[0]`` carries its log-prob and the
  ``top_logprobs`` most likely first tokens with their log-probs (``log_softmax`` of the
  first-position logits, float32), as vLLM returns them. Only first-token scoring is served:
  ``max_tokens > 1`` is a 400.
* ``GET /v1/models`` -- the served model name and its ``max_model_len``.
* ``GET /health`` -- the worker's real state: 200 ``{"status": "ok", ...}`` while the batching
  worker is alive and no forward pass has run longer than ``--stall-s``; otherwise 503 with
  ``"status": "stalled"`` (and how long it has been busy) or ``"stopped"``. Counters:
  ``requests``, ``forward_passes``, ``max_batch``, ``isolated_batches``, ``refused``,
  ``rejected`` (limits and overload), ``in_flight``, ``queued``.

Request path: the handler (asyncio) reads the body under a size bound and a per-read timeout,
then, on a thread of the server's pool, validates it, decodes both images (pixel bound checked
from the header, before decoding), bounds the instruction's tokens and encodes the request with
the judge's processor (:meth:`paco.judge.model.Judge.encode`, whose exact prompt length is
checked against the context). Only then is it queued for the one worker thread that owns the
model, so the worker does nothing but forward passes and the CPU-bound preparation of the next
requests overlaps them.

Batching (``--batching``): the worker takes the first waiting request, then keeps taking
requests until ``max_batch_size`` are collected or ``max_wait_ms`` have passed since the first,
or no other request is being read or prepared (a lone request is not kept waiting).
What it does with them depends on the mode:

* ``single``: every request is its own forward pass, without waiting ``max_wait_ms``. Nothing in
  a request's computation depends on what else is queued, so its log-probs are bit-identical
  however requests arrive, on any backend (a forward pass of one request has the same shapes,
  hence the same kernels, whatever else is queued; batched, CPU GEMM kernels and cuBLAS may
  choose another kernel per row count). The server still overlaps decoding and encoding the
  next requests with the forward pass.
* ``auto`` (default): ``single``, on every device.
* ``same_shape``: requests whose encodings have identical shapes (token count, image grids,
  pixel rows) are concatenated along the batch and scored in one forward pass, each other
  shape in its own; a request whose two images have different grids is always scored alone.
  Nothing is padded and the vision tower runs per request (:meth:`paco.judge.model.Judge.logits`),
  but the language model's GEMMs see ``n`` times the rows, and whether a row then rounds as it
  does alone is the CPU's GEMM kernels' choice, not this code's: bit-identical on an AVX2 and an
  AVX-512 AMD host, ~1.2e-7 apart on an AVX-512/AMX Intel host, and on an AVX-512 Intel Xeon
  (Cascade Lake) grpo@kontext_editing's LoRA bytes differ from ``single``'s. Less judge CPU
  time (about 1.35x less on 64 px panels, tiny judge, 1 thread; the same GRPO wall time there,
  133 s, where rewards overlap sampling); not for runs that must give the same bytes.
* ``dynamic``: all collected requests encoded together, left-padded, in one forward pass (the
  fastest, but a request's logits then depend on the others through padding, by up to ~3e-6,
  so GRPO runs are not reproducible run to run).

Limits (each checked before the model sees the request; a 400 names the limit unless noted):

* ``--max-body-mb``: a declared ``Content-Length`` above it is refused before the body is read;
  a chunked body is counted as it arrives. A body that stops arriving for ``--read-timeout-s``
  is a 408. A malformed ``Content-Length`` (negative, not a number) is refused by the HTTP
  parser (uvicorn's 400).
* ``--max-image-pixels``: width x height of each image, read from its header; decompression
  bombs are refused without decoding.
* context: an instruction longer in characters than ``--max-model-len`` (default: the model's
  ``max_position_embeddings``) times the vocabulary's longest token is refused without
  tokenizing; otherwise the full prompt, image tokens included, is counted exactly when the
  request is encoded. Either refusal is worded as vLLM's (``This model's maximum context
  length is 4096 tokens. However, you requested 9688 tokens (9687 in the messages, 1 in the
  completion).``). Nothing is truncated (see :class:`paco.judge.model.JudgeContextError`).
* ``--max-in-flight``: requests accepted and not yet answered; above it a request is a 503
  (overloaded, retried by the official client with backoff).
* uvicorn's listen backlog (``--backlog``, default 2048) and connection bound
  (``--max-connections``, a 503 above it).

Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``): a
malformed request is a 400 with the reason, an unknown model name a 404 (vLLM's behaviour), an
input the judge's processor refuses (``ValueError``, e.g. an extreme aspect ratio) a 400 for that
request only. A request whose client disconnects while it waits is dropped from the queue (not
computed; counted as ``abandoned``), so a client's timeout and retry do not double the work.
When a batched forward pass fails, its requests are scored again one at a time,
so only the request that caused it fails (a 500). A request not answered within
``--request-timeout-s`` is a 503 and is dropped from the queue (not computed later). The
server keeps running.

Lifetime: ``--parent-pid PID`` makes the server shut down when that process is gone (checked
every half second), so a trainer killed with SIGKILL leaves no judge server behind
(:class:`paco.judge.client.LocalJudgeServer` passes its own pid). SIGTERM / SIGINT shut down
gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import copy
import hashlib
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from paco.core.io import ImageDecodeError, decode_image
from paco.core.numerics import fix_numerics_env, loaded_too_late
from paco.judge.model import JudgeContextError, check_context, encode_prompts

log = logging.getLogger("paco.judge.serve")

#: The largest ``top_logprobs`` accepted by default (vLLM's default ``--max-logprobs``).
MAX_TOP_LOGPROBS = 20


class BadRequest(ValueError):
    """The request does not follow the served protocol or breaks a limit (HTTP 400, or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


#: ``--batching`` modes (see the module docstring).
BATCHING_MODES = ("auto", "same_shape", "single", "dynamic")


def resolve_batching(mode: str, device: Any) -> str:
    """``auto`` -> ``single`` (on every ``device``: the only mode whose log-probs cannot depend on
    the batch, see the module docstring); other modes unchanged.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {BATCHING_MODES}, got {mode!r}")
    if mode == "auto":
        torch.device(device)  # a malformed device is still an error
        return "single"
    return mode


# --------------------------------------------------------------------------------------------
# the OpenAI request schema (the served subset; other fields are accepted and ignored)
# --------------------------------------------------------------------------------------------


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Schema):
    url: str
    detail: str | None = None


class ImagePart(_Schema):
    type: Literal["image_url"]
    image_url: ImageURL


class TextPart(_Schema):
    type: Literal["text"]
    text: str


ContentPart = Annotated[ImagePart | TextPart, Field(discriminator="type")]


class UserMessage(_Schema):
    role: Literal["user"]
    content: list[ContentPart]


class ChatCompletionRequest(_Schema):
    """``POST /v1/chat/completions`` as the OpenAI API defines it, narrowed to what is served."""

    model: str
    messages: list[UserMessage] = Field(min_length=1, max_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    n: int = 1
    stream: bool = False


@dataclass(frozen=True)
class ServerLimits:
    """What one request may cost before the model sees it (see the module docstring).

    Attributes:
        max_body_bytes: request body bound (bytes).
        max_image_pixels: width x height bound per image.
        max_in_flight: accepted, unanswered requests; more are a 503.
        read_timeout_s: longest wait for the next piece of a request body (s).
        request_timeout_s: longest wait for a request's score once queued (s), then a 503.
        stall_s: a forward pass running longer than this makes ``/health`` report ``stalled``.
        feature_cache_bytes: bound on the per-image feature cache (:class:`ImageFeatureCache`);
            a quarter of it again bounds the decoded-image cache. 0 disables both.
        prepare_threads: threads reading, decoding and encoding requests (each holds a copy of
            the tokenizer).
    """

    max_body_bytes: int = 32 << 20
    max_image_pixels: int = 4096 * 4096
    max_in_flight: int = 256
    read_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    stall_s: float = 120.0
    feature_cache_bytes: int = 128 << 20
    prepare_threads: int = 4


@dataclass
class _Item:
    triple: tuple[Any, Any, str]
    top_k: int
    inputs: Any = None  # the request's own encoding (None: the worker encodes; dynamic encodes batches)
    future: Future = field(default_factory=Future)


def _shape_key(inputs: Any) -> tuple | None:
    """What must be equal for two encodings to share an unpadded forward pass: every tensor's
    shape, and the image grids (which set the vision tower's attention windows). ``None`` when
    the request's images have different grids: the Qwen2.5-VL vision tower then computes a
    request's features differently inside a batch than alone (measured: ~1e-7 on CPU, for
    every such batch), so such a request gets a forward pass of its own."""
    if "image_grid_thw" in inputs and len({tuple(g) for g in inputs["image_grid_thw"].tolist()}) > 1:
        return None
    key = []
    for name in sorted(inputs):
        v = inputs[name]
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"judge encoding field {name!r} is a {type(v).__name__}, not a tensor")
        key.append((name, tuple(v.shape)))
    if "image_grid_thw" in inputs:
        key.append(("grid", tuple(inputs["image_grid_thw"].flatten().tolist())))
    return tuple(key)


def _concat(encodings: list[Any]) -> dict[str, torch.Tensor]:
    """Same-shape encodings of one prompt each, concatenated along dim 0 (token tensors
    ``(1, seq)`` -> ``(n, seq)``, ``pixel_values`` / ``image_grid_thw`` rows in request order),
    which is what the processor returns for the batch when no padding is needed."""
    if len(encodings) == 1:
        return dict(encodings[0])
    return {name: torch.cat([e[name] for e in encodings], dim=0) for name in encodings[0]}


class BatchingJudge:
    """Scores queued requests in batches on one worker thread (see the module docstring).

    Args:
        judge: a :class:`paco.judge.model.Judge` (its ``batch_size`` is not used here); the worker
            calls its ``logits`` (and its ``encode`` for requests queued without an encoding).
        max_batch_size: at most this many requests collected per round.
        max_wait_ms: after the first request of a round arrives, wait at most this long for more.
        batching: one of :data:`BATCHING_MODES`; ``auto`` is resolved on the judge's device.
        track_arrivals: the caller reports requests on their way (:meth:`arriving`), so a round
            stops waiting for company as soon as none is coming (a server); otherwise a round
            waits the full ``max_wait_ms``.

    Raises:
        ValueError: ``max_batch_size`` < 1, ``max_wait_ms`` < 0, or an unknown ``batching``.
    """

    def __init__(self, judge: Any, *, max_batch_size: int = 16, max_wait_ms: float = 10.0,
                 batching: str = "auto", track_arrivals: bool = False):
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size must be >= 1 and max_wait_ms >= 0")
        self.judge = judge
        self.batching = resolve_batching(batching, getattr(judge, "device", "cpu"))
        self.tokenizer = judge.processor.tokenizer
        self.max_batch_size = int(max_batch_size)
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.queue: queue.Queue[_Item | None] = queue.Queue()
        self.requests = 0
        self.forward_passes = 0
        self.max_batch = 0
        self.isolated_batches = 0  # batches whose forward pass failed and were rescored one by one
        self.refused = 0  # requests whose input the judge refused (too long, processor error)
        self.busy_since: float | None = None  # monotonic start of the round being computed
        self.preparing = 0  # requests a server is preparing (see arriving)
        self.track_arrivals = bool(track_arrivals)
        self._lock = threading.Lock()
        self._token_text: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="judge-batcher", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, triple: tuple[Any, Any, str], top_k: int, inputs: Any = None) -> Future:
        """Queue one request (``inputs``: its own encoding from ``judge.encode([triple])``, or
        ``None`` to let the worker encode it); the future resolves to ``(token_id, logprob,
        [(id, logprob), ...])`` or raises (:class:`paco.judge.model.JudgeContextError` /
        ``ValueError`` for a refused input)."""
        item = _Item(triple, top_k, inputs)
        with self._lock:
            self.requests += 1
        self.queue.put(item)
        return item.future

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=10)

    def token_text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def arriving(self, n: int) -> None:
        """A request starts (``+1``) or ends (``-1``) its preparation before :meth:`submit`
        (with ``track_arrivals``)."""
        with self._lock:
            self.preparing += n

    def note_refused(self) -> None:
        """Count a request whose input was refused before it was queued."""
        with self._lock:
            self.refused += 1

    def _collect(self, first: _Item) -> tuple[list[_Item], bool]:
        batch, stop = [first], False
        # single: nothing is gained by waiting for company, take only what is already queued
        deadline = time.monotonic() + (0.0 if self.batching == "single" else self.max_wait_s)
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining > 0 and self.track_arrivals:
                # a server knows what is coming: wait only while a request is being prepared
                if self.queue.empty() and self.preparing == 0:
                    break
                remaining = min(remaining, 0.001)
            try:
                item = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                if self.track_arrivals and deadline - time.monotonic() > 0:
                    continue
                break
            if item is None:
                stop = True
                break
            batch.append(item)
        return batch, stop

    def _score(self, batch: list[_Item]) -> None:
        """One forward pass for ``batch``; sets each item's result (raises on failure).

        Items carrying their own encoding (``same_shape``/``single``) are concatenated unpadded;
        otherwise (``dynamic``) the triples are encoded together, left-padded.
        """
        self.busy_since = time.monotonic()  # /health: how long this forward pass has run
        try:
            if batch[0].inputs is not None and self.batching != "dynamic":
                logits = self.judge.logits(_concat([it.inputs for it in batch]))
            else:
                logits = self.judge.logits(self.judge.encode([it.triple for it in batch]))
        finally:
            self.busy_since = None
        with self._lock:
            self.forward_passes += 1
            self.max_batch = max(self.max_batch, len(batch))
        results = []
        for row, it in zip(logits, batch, strict=True):
            # row by row: log_softmax and top-k of a 1-D row do not see the batch
            lp = torch.log_softmax(row.float(), dim=-1)
            k = min(max(it.top_k, 1), lp.shape[-1])
            values, ids = torch.topk(lp, k)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
            results.append((top[0][0], top[0][1], top[: it.top_k]))
        for it, result in zip(batch, results, strict=True):  # all rows computed: none answered twice
            it.future.set_result(result)

    def _refuse(self, it: _Item, exc: Exception) -> None:
        self.note_refused()
        if isinstance(exc, ValueError):
            log.warning("refused a request: %s", exc)
        else:
            log.exception("encoding a request failed", exc_info=exc)
        it.future.set_exception(exc)

    def _score_isolating(self, batch: list[_Item]) -> None:
        """:meth:`_score`; if a pass of several requests fails, score them one at a time so only
        the request that caused it fails."""
        try:
            self._score(batch)
        except Exception as exc:  # noqa: BLE001 - isolated below, then sent to the waiting request
            if len(batch) == 1:
                if isinstance(exc, ValueError):
                    self._refuse(batch[0], exc)
                else:
                    log.exception("judge forward pass failed")
                    batch[0].future.set_exception(exc)
                return
            with self._lock:
                self.isolated_batches += 1
            log.warning("judge forward pass failed for a batch of %d (%s: %s); scoring its "
                        "requests one at a time", len(batch), type(exc).__name__, exc)
            for it in batch:
                if it.future.done():  # answered before the pass failed
                    continue
                try:
                    self._score([it])
                except ValueError as one:  # this request's input was refused
                    self._refuse(it, one)
                except Exception as one:  # noqa: BLE001 - this request's own error
                    log.exception("judge forward pass failed for one request")
                    it.future.set_exception(one)

    def _process(self, batch: list[_Item]) -> None:
        if self.batching == "dynamic":
            self._score_isolating(batch)
            return
        groups: dict[tuple, list[_Item]] = {}
        for it in batch:
            try:
                if it.inputs is None:
                    it.inputs = self.judge.encode([it.triple])
                key = _shape_key(it.inputs) if self.batching == "same_shape" else None
                key = (id(it),) if key is None else key
            except Exception as exc:  # noqa: BLE001 - this request's own input
                self._refuse(it, exc)
                continue
            groups.setdefault(key, []).append(it)
        for group in groups.values():
            self._score_isolating(group)

    def _run(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch, stop = self._collect(first)
            # requests whose handler gave up (timeout) were cancelled: do not compute them
            batch = [it for it in batch if it.future.set_running_or_notify_cancel()]
            if batch:
                try:
                    self._process(batch)
                except Exception as exc:  # noqa: BLE001 - never leave a request waiting
                    log.exception("judge batcher failed")
                    for it in batch:
                        if not it.future.done():
                            it.future.set_exception(exc)
            if stop:
                return


# --------------------------------------------------------------------------------------------
# request preparation (runs on the server's thread pool, not on the worker)
# --------------------------------------------------------------------------------------------

#: ``PIL.Image.info`` key under which the server records an image's content digest.
IMAGE_KEY = "paco_digest"


class ImageFeatureCache:
    """The judge processor's image processor with a byte-bounded LRU of per-image features,
    keyed by the image's content digest (what vLLM's multimodal processor cache does).

    In GRPO every panel of a grid appears in several pairs (a 2x2 grid's 4 panels in 6), so
    most images a server sees were decoded and preprocessed moments before. Images without a
    digest (``image.info[IMAGE_KEY]``) are processed and not cached.

    Each image is processed on its own and the features concatenated in order, which is what the
    Qwen2-VL image processor does for a list (checked bit for bit in tests/test_serve.py).
    Thread-safe; other attributes are the wrapped processor's.

    Args:
        image_processor: e.g. ``Qwen2VLImageProcessorPil``.
        max_bytes: bound on the cached tensors' bytes (0 disables caching).
    """

    def __init__(self, image_processor: Any, max_bytes: int = 128 << 20):
        self._inner = image_processor
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple, tuple[dict, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _features(self, image: Any, kwargs: dict[str, Any], kw_key: str) -> dict[str, Any]:
        digest = getattr(image, "info", {}).get(IMAGE_KEY)
        key = (digest, kw_key)
        if digest is not None and self.max_bytes > 0:
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return hit[0]
        feats = dict(self._inner([image], **kwargs))
        if digest is not None and self.max_bytes > 0:
            size = sum(v.numel() * v.element_size() for v in feats.values() if isinstance(v, torch.Tensor))
            with self._lock:
                self.misses += 1
                if key not in self._entries and size <= self.max_bytes:
                    self._entries[key] = (feats, size)
                    self._bytes += size
                    while self._bytes > self.max_bytes:
                        _, (_, old) = self._entries.popitem(last=False)
                        self._bytes -= old
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


class _DecodedImages:
    """A byte-bounded LRU of decoded images keyed by the digest of their base64 payload."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> Any:
        with self._lock:
            im = self._entries.get(digest)
            if im is not None:
                self._entries.move_to_end(digest)
            return im

    def put(self, digest: bytes, image: Any) -> None:
        size = image.width * image.height * len(image.getbands())
        if self.max_bytes <= 0 or size > self.max_bytes:
            return
        with self._lock:
            if digest in self._entries:
                return
            self._entries[digest] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.width * old.height * len(old.getbands())


def _decode_data_url(url: str, what: str, max_pixels: int | None, decoded: _DecodedImages | None = None):
    """The image of a ``data:image/...;base64,`` URL, its ``info[IMAGE_KEY]`` set to the
    payload's digest (served from ``decoded`` when seen before).

    Raises:
        BadRequest: not a base64 data URL, invalid base64, not decodable, or over ``max_pixels``.
    """
    if not url.startswith("data:image/") or ";base64," not in url:
        raise BadRequest(f"{what}: only data:image/...;base64 URLs are served")
    payload = url.split(";base64,", 1)[1]
    digest = hashlib.blake2b(payload.encode("ascii", "replace"), digest_size=20).digest()
    if decoded is not None:
        hit = decoded.get(digest)
        if hit is not None:
            return hit
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{what}: invalid base64 ({exc})") from None
    try:
        image = decode_image(data, what=what, max_pixels=max_pixels)
    except ImageDecodeError as exc:  # ImageTooLargeError included: checked from the header
        raise BadRequest(str(exc)) from None
    image.info[IMAGE_KEY] = digest
    if decoded is not None:
        decoded.put(digest, image)
    return image


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def parse_chat_request(body: bytes | str | dict[str, Any], served_model_name: str, *,
                       max_logprobs: int = MAX_TOP_LOGPROBS, max_image_pixels: int | None = None,
                       decoded: _DecodedImages | None = None) -> tuple[tuple[Any, Any, str], int]:
    """Validate a ``/v1/chat/completions`` body; return ``((image A, image B, text), top_k)``.

    Args:
        body: the raw JSON body, or the parsed object.
        served_model_name: the only accepted ``model``.
        max_logprobs: the largest ``top_logprobs`` served.
        max_image_pixels: width x height bound per image (``None``: Pillow's own guard only).
        decoded: a cache of decoded images (the server's), or ``None``.

    Raises:
        BadRequest: anything outside the served subset (status 404 for an unknown model).
    """
    try:
        req = (ChatCompletionRequest.model_validate(body) if isinstance(body, dict)
               else ChatCompletionRequest.model_validate_json(body))
    except ValidationError as exc:
        raise BadRequest(_validation_message(exc)) from None
    if req.model != served_model_name:
        raise BadRequest(f"The model `{req.model}` does not exist (served: `{served_model_name}`).", status=404)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens not in (None, 1):
        raise BadRequest(f"this server scores the first token only: max_tokens must be 1, got {max_tokens!r}")
    if req.n != 1:
        raise BadRequest("n must be 1")
    if req.stream:
        raise BadRequest("stream is not served")
    top_k = (req.top_logprobs or 0) if req.logprobs else 0
    if top_k > max_logprobs:
        raise BadRequest(f"top_logprobs must be an integer in [0, {max_logprobs}], got {top_k!r}")
    images, texts = [], []
    for part in req.messages[0].content:
        if isinstance(part, ImagePart):
            images.append(part.image_url.url)
        else:
            texts.append(part.text)
    if len(images) != 2 or len(texts) != 1 or not texts[0].strip():
        raise BadRequest(f"the content must be [image A, image B, text]; got {len(images)} image(s) and "
                         f"{len(texts)} text(s)")
    ims = [_decode_data_url(u, f"image {i + 1}", max_image_pixels, decoded) for i, u in enumerate(images)]
    return (ims[0], ims[1], texts[0]), top_k


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
        triple, top_k = parse_chat_request(body, self.served_model_name, max_logprobs=self.max_logprobs,
                                           max_image_pixels=self.limits.max_image_pixels, decoded=self.decoded)
        self.check_text(triple[2])
        if not self.encode:
            return triple, top_k, None
        inputs = encode_prompts(self.processor(), [triple])  # as judge.encode, features cached
        check_context(inputs["attention_mask"].sum(dim=1), self.max_model_len or 1 << 62)
        return triple, top_k, inputs


def _logprob_entry(batcher: BatchingJudge, token_id: int, logprob: float) -> dict[str, Any]:
    text = batcher.token_text(token_id)
    lp = logprob if math.isfinite(logprob) else -9999.0
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def completion_response(batcher: BatchingJudge, served_model_name: str, result: tuple[int, float, list],
                        request_id: int) -> dict[str, Any]:
    """The ``chat.completion`` object for a scored request (vLLM's field layout)."""
    token_id, logprob, top = result
    entry = _logprob_entry(batcher, token_id, logprob)
    entry["top_logprobs"] = [_logprob_entry(batcher, i, v) for i, v in top]
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_model_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": entry["token"]},
            "logprobs": {"content": [entry]},
            "finish_reason": "length",
        }],
        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
    }


# --------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "BadRequestError", 408: "RequestTimeout",
                499: "ClientClosedRequest",
                413: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": None,
                      "code": status}}


class _ReadTimeout(Exception):
    pass


class _ClientGone(Exception):
    pass


async def _await_unless_gone(request: Request, future: Future, timeout_s: float) -> Any:
    """The result of the worker's ``future``; raises ``asyncio.TimeoutError`` after
    ``timeout_s`` and :class:`_ClientGone` as soon as the client has disconnected (checked every
    0.25 s), so the caller can cancel a request nobody waits for."""
    waiter = asyncio.wrap_future(future)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            waiter.cancel()
            raise asyncio.TimeoutError
        done, _ = await asyncio.wait({waiter}, timeout=min(0.25, remaining))
        if done:
            return waiter.result()
        if await request.is_disconnected():
            waiter.cancel()
            raise _ClientGone


def make_app(judge: Any, served_model_name: str, *, max_batch_size: int = 16, max_wait_ms: float = 10.0,
             max_logprobs: int = MAX_TOP_LOGPROBS, batching: str = "auto", limits: ServerLimits | None = None):
    """The FastAPI app serving ``judge``; ``app.state.batcher`` holds the worker and its counters
    (call ``app.state.batcher.close()`` when done).

    Raises:
        ValueError: bad batching settings.
    """
    limits = limits or ServerLimits()
    batcher = BatchingJudge(judge, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, batching=batching,
                            track_arrivals=True)
    prepare = RequestPreparer(judge, served_model_name, limits, max_logprobs,
                              encode=batcher.batching != "dynamic")
    max_model_len = getattr(judge, "max_model_len", None)
    app = FastAPI(title="PaCo-Reward judge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher = batcher
    app.state.limits = limits
    # request preparation (decode, processor) on its own bounded pool: each of its threads holds
    # a copy of the tokenizer
    app.state.prepare_pool = ThreadPoolExecutor(max_workers=limits.prepare_threads, thread_name_prefix="prepare")
    stats = {"in_flight": 0, "rejected": 0, "abandoned": 0, "next_id": 1}

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(error_body(status, message), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail) if exc.status_code != 404 else f"no route {request.url.path}")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, f"invalid request: {exc.errors()[:3]}")

    @app.get("/health")
    async def health() -> JSONResponse:
        busy = batcher.busy_since
        busy_s = round(time.monotonic() - busy, 3) if busy is not None else 0.0
        status = "stopped" if not batcher.alive else "stalled" if busy_s > limits.stall_s else "ok"
        body = {"status": status, "model": served_model_name, "busy_s": busy_s, "requests": batcher.requests,
                "forward_passes": batcher.forward_passes, "max_batch": batcher.max_batch,
                "isolated_batches": batcher.isolated_batches, "refused": batcher.refused,
                "rejected": stats["rejected"], "abandoned": stats["abandoned"], "in_flight": stats["in_flight"], "queued": batcher.queue.qsize(),
                "batching": batcher.batching, "max_model_len": max_model_len}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                                         "owned_by": "paco", "max_model_len": max_model_len}]})

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise BadRequest(f"request body of {int(declared)} bytes exceeds the limit of "
                             f"{limits.max_body_bytes} bytes (--max-body-mb)")
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), timeout=limits.read_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise _ReadTimeout() from None
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise BadRequest(f"request body exceeds the limit of {limits.max_body_bytes} bytes (--max-body-mb)")
            chunks.append(chunk)
        return b"".join(chunks)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        if stats["in_flight"] >= limits.max_in_flight:
            stats["rejected"] += 1
            return error(503, f"overloaded: {stats['in_flight']} requests in flight (--max-in-flight "
                              f"{limits.max_in_flight}); retry later")
        stats["in_flight"] += 1
        batcher.arriving(+1)
        arriving = True
        try:
            try:
                body = await read_body(request)
                triple, top_k, inputs = await asyncio.get_running_loop().run_in_executor(
                    app.state.prepare_pool, prepare, body)
            except ClientDisconnect:  # the client left while sending: nothing to answer
                stats["abandoned"] += 1
                return error(499, "client closed the connection")
            except _ReadTimeout:
                stats["rejected"] += 1
                return error(408, f"request body not received within {limits.read_timeout_s:g} s")
            except BadRequest as exc:
                stats["rejected"] += 1
                return error(exc.status, str(exc))
            except ValueError as exc:  # JudgeContextError (vLLM's wording first) or the processor's refusal
                batcher.note_refused()
                prefix = "" if isinstance(exc, JudgeContextError) else "judge cannot score this input: "
                return error(400, f"{prefix}{exc}")
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
                log.exception("preparing a request failed")
                return error(500, f"judge failed to prepare the request: {type(exc).__name__}: {exc}")
            future = batcher.submit(triple, top_k, inputs)
            batcher.arriving(-1)
            arriving = False
            try:
                result = await _await_unless_gone(request, future, limits.request_timeout_s)
            except asyncio.TimeoutError:
                future.cancel()  # still queued: the worker skips it
                return error(503, f"judge did not answer within {limits.request_timeout_s:g} s")
            except _ClientGone:
                future.cancel()  # a client that gave up (its timeout, then a retry) costs no compute
                stats["abandoned"] += 1
                return error(499, "client closed the connection")
            except ValueError as exc:  # refused at the worker (dynamic batching encodes there)
                prefix = "" if isinstance(exc, JudgeContextError) else "judge cannot score this input: "
                return error(400, f"{prefix}{exc}")
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
                return error(500, f"judge failed: {type(exc).__name__}: {exc}")
            rid = stats["next_id"]
            stats["next_id"] += 1
            return JSONResponse(completion_response(batcher, served_model_name, result, rid))
        finally:
            stats["in_flight"] -= 1
            if arriving:
                batcher.arriving(-1)

    return app


class JudgeServer:
    """A judge app on uvicorn, bound at construction (``port=0``: a free port, see :attr:`port`).

    :meth:`start` serves on a background thread (tests, benchmarks); :meth:`run` serves on the
    calling thread until SIGTERM/SIGINT or :meth:`stop`. ``batcher`` holds the counters.

    Args:
        judge, served_model_name, max_batch_size, max_wait_ms, max_logprobs, batching, limits:
            see :func:`make_app`.
        host, port: where to listen.
        backlog: the listen backlog (connections waiting to be accepted).
        max_connections: uvicorn's ``limit_concurrency`` (a 503 above it).
    """

    def __init__(self, judge: Any, served_model_name: str, host: str = "127.0.0.1", port: int = 0, *,
                 max_batch_size: int = 16, max_wait_ms: float = 10.0, max_logprobs: int = MAX_TOP_LOGPROBS,
                 batching: str = "auto", limits: ServerLimits | None = None, backlog: int = 2048,
                 max_connections: int = 1024, log_level: str = "warning"):
        import uvicorn

        self.app = make_app(judge, served_model_name, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                            max_logprobs=max_logprobs, batching=batching, limits=limits)
        self.batcher: BatchingJudge = self.app.state.batcher
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when the listening
        # socket says TCP; without it every keep-alive response waits ~40 ms for a delayed ACK
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                  socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(backlog)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="off", backlog=backlog,
                                limit_concurrency=max_connections, timeout_keep_alive=30,
                                timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.batcher.close()
            self.app.state.prepare_pool.shutdown(wait=False, cancel_futures=True)
            self.sock.close()

    def start(self, timeout_s: float = 30.0) -> "JudgeServer":
        self._thread = threading.Thread(target=self.run, name="judge-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("judge server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> "JudgeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def watch_parent(parent_pid: int, on_exit, interval_s: float = 0.5) -> threading.Thread:
    """Call ``on_exit()`` once the process ``parent_pid`` is no longer this process's parent
    (it died and this one was re-parented), checked every ``interval_s``."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        log.warning("parent process %d is gone: shutting down", parent_pid)
        on_exit()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    # scores must not depend on the machine's load or CPU model (a server a stage starts gets
    # these from the stage). numpy, OpenBLAS and libgomp read theirs when loaded, and importing
    # this module loaded them: if any was missing, run again with the environment fixed.
    if loaded_too_late(fix_numerics_env()):
        argv = sys.argv[1:] if argv is None else list(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "paco.judge.serve", *argv])
    p = argparse.ArgumentParser(prog="paco-serve-judge", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="merged judge directory (reward_merge output) or any judge dir")
    p.add_argument("--served-model-name", required=True, help="the `model` name clients must send")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--batching", default="auto", choices=BATCHING_MODES,
                   help="single (= auto): one request per forward pass, log-probs independent of the others "
                        "on any device; same_shape: identical encodings share a pass (faster; invariant only "
                        "where the CPU's GEMM kernels allow); dynamic: padded mixed batches (fastest, not "
                        "batch-invariant)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context bound in tokens (prompt + 1 answer token); 0: the model's max_position_embeddings")
    p.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, help="largest top_logprobs served")
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request not answered within this is dropped from the queue (HTTP 503)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="request body bound (MiB)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="width x height bound per image")
    p.add_argument("--max-in-flight", type=int, default=256, help="accepted, unanswered requests (503 above)")
    p.add_argument("--read-timeout-s", type=float, default=30.0, help="longest pause inside a request body (408)")
    p.add_argument("--stall-s", type=float, default=120.0,
                   help="/health reports 'stalled' (503) when a forward pass runs longer than this")
    p.add_argument("--feature-cache-mb", type=float, default=128.0,
                   help="bound on the per-image processor features cached by content (a grid's panels recur in "
                        "several pairs; 0 disables); a quarter of it again bounds the decoded images")
    p.add_argument("--prepare-threads", type=int, default=4,
                   help="threads decoding and encoding requests beside the model's worker thread")
    p.add_argument("--backlog", type=int, default=2048, help="listen backlog")
    p.add_argument("--max-connections", type=int, default=1024, help="concurrent connections (503 above)")
    p.add_argument("--parent-pid", type=int, default=0, help="shut down when this process is gone (0: never)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from paco.judge.model import Judge

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    judge = Judge.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device=device,
                                  max_model_len=args.max_model_len or None)
    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_image_pixels=args.max_image_pixels,
                          max_in_flight=args.max_in_flight, read_timeout_s=args.read_timeout_s,
                          request_timeout_s=args.request_timeout_s, stall_s=args.stall_s,
                          prepare_threads=args.prepare_threads, feature_cache_bytes=int(args.feature_cache_mb * (1 << 20)))
    server = JudgeServer(judge, args.served_model_name, args.host, args.port, max_batch_size=args.max_batch_size,
                         max_wait_ms=args.max_wait_ms, max_logprobs=args.max_logprobs, batching=args.batching,
                         limits=limits, backlog=args.backlog, max_connections=args.max_connections,
                         log_level="warning")
    log.info("serving %s as %r on %s (batching %s, batch <= %d, wait <= %g ms, max_model_len %d, torch threads "
             "%d)", args.model, args.served_model_name, server.url, server.batcher.batching, args.max_batch_size,
             args.max_wait_ms, judge.max_model_len, torch.get_num_threads())
    if args.port_file:
        from paco.core.io import atomic_write_bytes

        atomic_write_bytes(args.port_file, str(server.port).encode())
    if args.parent_pid:
        def _orphaned() -> None:
            server.server.should_exit = True
            time.sleep(15)  # graceful shutdown did not finish: leave anyway
            os._exit(0)

        watch_parent(args.parent_pid, _orphaned)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
