"""What one request may cost the judge server before the model sees it (:class:`ServerLimits`).

Each limit is checked before the model sees the request; a 400 names the limit unless noted:

* ``--max-body-mb``: a declared ``Content-Length`` above it is refused before the body is read;
  a chunked body is counted as it arrives. A body that stops arriving for ``--read-timeout-s``
  is a 408. A malformed ``Content-Length`` (negative, not a number) is refused by the HTTP
  parser (uvicorn's 400).
* ``--max-json-values`` and ``--max-content-parts``: the body's JSON is scanned before it is
  parsed (strings skipped whole, nothing built): more objects, arrays and separators than
  ``--max-json-values`` anywhere in it (fields the schema ignores included), more content parts
  than ``--max-content-parts``, or nesting deeper than 32 levels is refused before pydantic
  builds anything (a body of hundreds of thousands of text parts otherwise costs seconds and
  hundreds of MB before it is refused).
* ``--max-image-pixels``: width x height of each image, read from its header; decompression
  bombs are refused without decoding. Only PNG, JPEG, WebP and GIF are decoded, each only as
  the format its data URL declares.
* ``--max-request-pixels``: the pixels of all the request's images together, read from their
  headers before any is decoded (a few small, highly compressed PNGs can otherwise decode to
  hundreds of MB).
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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one request may cost before the model sees it (see the module docstring).

    Attributes:
        max_body_bytes: request body bound (bytes).
        max_image_pixels: width x height bound per image.
        max_request_pixels: bound on the pixels of all the request's images together.
        max_content_parts: content parts a request may have (a judge request has 3).
        max_json_values: objects, arrays and separators (outside strings) a body may have.
        max_in_flight: accepted, unanswered requests; more are a 503.
        read_timeout_s: longest wait for the next piece of a request body (s).
        request_timeout_s: longest wait for a request's score once queued (s), then a 503.
        stall_s: a forward pass running longer than this makes ``/health`` report ``stalled``.
        feature_cache_bytes: bound on the per-image feature cache
            (:class:`paco.serving.server.preparation.ImageFeatureCache`); a quarter of it again
            bounds the decoded-image cache. 0 disables both.
        prepare_threads: threads reading, decoding and encoding requests (each holds a copy of
            the tokenizer).
    """

    max_body_bytes: int = 32 << 20
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 4096 * 4096
    max_content_parts: int = 8
    max_json_values: int = 256
    max_in_flight: int = 256
    read_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    stall_s: float = 120.0
    feature_cache_bytes: int = 128 << 20
    prepare_threads: int = 4
