"""Serve a PaCo-Reward judge over the OpenAI-compatible subset that vLLM exposes (CPU backend).

At paper scale the judge is served by vLLM on GPUs::

    vllm serve data/reward_merge/model --served-model-name paco-reward --port 8000

and the GRPO stage is pointed at it with ``judge_endpoint.url: http://<host>:8000/v1``. This module is
the same protocol on a small transformers backend, for CPUs and tests::

    python -m paco.judge.serve --model data/reward_merge/model --served-model-name paco-reward --port 8000

Endpoints:

* ``POST /v1/chat/completions`` -- one user message whose content is two ``image_url`` items
  (``data:image/png;base64,...`` or JPEG) and one ``text`` item, ``max_tokens`` (or
  ``max_completion_tokens``) 1, ``logprobs: true``, ``top_logprobs`` from 0 to ``--max-logprobs``
  (default 20, as vLLM's flag of the same name). The answer is the
  greedy first token; ``choices[0].logprobs.content[0]`` carries its log-prob and the
  ``top_logprobs`` most likely first tokens with their log-probs (``log_softmax`` of the
  first-position logits, float32), as vLLM returns them. Only first-token scoring is served:
  ``max_tokens > 1`` is a 400.
* ``GET /v1/models`` -- the served model name and its ``max_model_len``.
* ``GET /health`` -- 200 with ``{"status": "ok"}``, the resolved ``batching`` mode,
  ``max_model_len`` and counters (``requests``, ``forward_passes``, ``max_batch``,
  ``isolated_batches``, ``refused``) once the model is loaded.

Batching (``--batching``): request threads put their item in a queue; one worker thread takes
the first waiting item, then keeps taking items until ``max_batch_size`` are collected or
``max_wait_ms`` have passed since the first. What it does with them depends on the mode:

* ``same_shape``: each request is encoded alone (:meth:`paco.judge.model.Judge.encode`, no padding);
  requests whose encodings have identical shapes (token count, image grids, pixel rows) are
  concatenated along the batch and scored in one forward pass, each other shape in its own.
  Nothing is padded, and every row goes through the same per-row computation whatever the batch,
  so a request's log-probs are bit-identical whether it is scored alone or with any others (on
  CPU: checked for batches of 1 to 32 with 1 and 2 torch threads, and tests/test_serve.py;
  GRPO's concurrent requests, the pairs of one grid with one theme, mostly share a shape). On
  CPU the log-probs of one request also did not change with the torch thread count (1 to 8).
* ``single``: every request is its own forward pass, without waiting ``max_wait_ms``
  (bit-invariant on any backend, including CUDA, where cuBLAS may choose a different kernel per
  batch size; slower).
* ``auto`` (default): ``same_shape`` on CPU, ``single`` on any other device.
* ``dynamic``: all collected requests in one left-padded forward pass (the fastest, but a
  request's logits then depend on the others through padding, by up to ~3e-6, so GRPO runs
  are not reproducible run to run).

Concurrent requests therefore share forward passes; ``/health``'s counters show how many.

Context length: a request whose prompt (image tokens included) plus its one answer token
exceeds ``--max-model-len`` (default: the model's ``max_position_embeddings``) is a 400 whose
message starts as vLLM's (``This model's maximum context length is 4096 tokens. However, you
requested 9688 tokens (9687 in the messages, 1 in the completion).``); nothing is truncated
(see :class:`paco.judge.model.JudgeContextError`). ``/v1/models`` reports ``max_model_len``.

Errors: a malformed request is a 400 with the reason, an unknown model name a 404 (vLLM's
behaviour). An input the judge's processor refuses (``ValueError``, e.g. an extreme aspect
ratio) or that is too long is a 400 for that request only. When a batched forward pass fails,
its requests are scored again one at a time, so only the request that caused it fails (a 500).
A request not answered within ``--request-timeout-s`` is a 503 and is dropped from the queue
(not computed later). The server keeps running.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from paco.core.io import ImageDecodeError, decode_image
from paco.judge.model import JudgeContextError

log = logging.getLogger("paco.judge.serve")

#: The largest ``top_logprobs`` accepted by default (vLLM's default ``--max-logprobs``).
MAX_TOP_LOGPROBS = 20


class BadRequest(ValueError):
    """The request does not follow the served protocol (HTTP 400, or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


#: ``--batching`` modes (see the module docstring).
BATCHING_MODES = ("auto", "same_shape", "single", "dynamic")


def resolve_batching(mode: str, device: Any) -> str:
    """``auto`` -> ``same_shape`` on CPU, ``single`` elsewhere; other modes unchanged.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {BATCHING_MODES}, got {mode!r}")
    if mode == "auto":
        return "same_shape" if torch.device(device).type == "cpu" else "single"
    return mode


@dataclass
class _Item:
    triple: tuple[Any, Any, str]
    top_k: int
    future: Future = field(default_factory=Future)
    inputs: Any = None  # the request's own encoding (same_shape / single)


def _shape_key(inputs: Any) -> tuple:
    """What must be equal for two encodings to share an unpadded forward pass: every tensor's
    shape, and the image grids (which set the vision tower's attention windows)."""
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


def _decode_data_url(url: Any, what: str):
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise BadRequest(f"{what}: only data:image/...;base64 URLs are served")
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{what}: invalid base64 ({exc})") from None
    try:
        return decode_image(data, what=what)
    except ImageDecodeError as exc:
        raise BadRequest(str(exc)) from None


def parse_chat_request(body: dict[str, Any], served_model_name: str, max_logprobs: int = MAX_TOP_LOGPROBS
                       ) -> tuple[tuple[Any, Any, str], int]:
    """Validate a ``/v1/chat/completions`` body; return ``((image A, image B, text), top_k)``.

    Raises:
        BadRequest: anything outside the served subset (status 404 for an unknown model).
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model != served_model_name:
        raise BadRequest(f"The model `{model}` does not exist (served: `{served_model_name}`).", status=404)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 1))
    if max_tokens != 1:
        raise BadRequest(f"this server scores the first token only: max_tokens must be 1, got {max_tokens!r}")
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1")
    top_k = body.get("top_logprobs", 0) if body.get("logprobs") else 0
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= max_logprobs:
        raise BadRequest(f"top_logprobs must be an integer in [0, {max_logprobs}], got {top_k!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict):
        raise BadRequest("messages must hold exactly one user message")
    msg = messages[0]
    if msg.get("role") != "user" or not isinstance(msg.get("content"), list):
        raise BadRequest("the message must be a user turn with a content list")
    images, texts = [], []
    for part in msg["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
            images.append(_decode_data_url(url, f"image {len(images) + 1}"))
        elif kind == "text":
            texts.append(part.get("text"))
        else:
            raise BadRequest(f"unsupported content part {kind!r}")
    if len(images) != 2 or len(texts) != 1 or not isinstance(texts[0], str) or not texts[0].strip():
        raise BadRequest(f"the content must be [image A, image B, text]; got {len(images)} image(s) and "
                         f"{len(texts)} text(s)")
    return (images[0], images[1], texts[0]), top_k


class BatchingJudge:
    """Scores queued requests in batches on one worker thread (see the module docstring).

    Args:
        judge: a :class:`paco.judge.model.Judge` (its ``batch_size`` is not used here); the worker
            calls its ``encode`` and ``logits``.
        max_batch_size: at most this many requests collected per round.
        max_wait_ms: after the first request of a round arrives, wait at most this long for more.
        batching: one of :data:`BATCHING_MODES`; ``auto`` is resolved on the judge's device.

    Raises:
        ValueError: ``max_batch_size`` < 1, ``max_wait_ms`` < 0, or an unknown ``batching``.
    """

    def __init__(self, judge: Any, *, max_batch_size: int = 16, max_wait_ms: float = 10.0,
                 batching: str = "auto"):
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
        self._lock = threading.Lock()
        self._token_text: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="judge-batcher", daemon=True)
        self._thread.start()

    def submit(self, triple: tuple[Any, Any, str], top_k: int) -> Future:
        """Queue one request; the future resolves to ``(token_id, logprob, [(id, logprob), ...])``
        or raises (:class:`paco.judge.model.JudgeContextError` / ``ValueError`` for a refused input)."""
        item = _Item(triple, top_k)
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

    def _collect(self, first: _Item) -> tuple[list[_Item], bool]:
        batch, stop = [first], False
        # single: nothing is gained by waiting for company, take only what is already queued
        deadline = time.monotonic() + (0.0 if self.batching == "single" else self.max_wait_s)
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                item = self.queue.get(timeout=max(remaining, 0.0)) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
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
        if batch[0].inputs is not None:
            logits = self.judge.logits(_concat([it.inputs for it in batch]))
        else:
            logits = self.judge.logits(self.judge.encode([it.triple for it in batch]))
        with self._lock:
            self.forward_passes += 1
            self.max_batch = max(self.max_batch, len(batch))
        for row, it in zip(logits, batch, strict=True):
            # row by row: log_softmax and top-k of a 1-D row do not see the batch
            lp = torch.log_softmax(row.float(), dim=-1)
            k = min(max(it.top_k, 1), lp.shape[-1])
            values, ids = torch.topk(lp, k)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
            it.future.set_result((top[0][0], top[0][1], top[: it.top_k]))

    def _refuse(self, it: _Item, exc: Exception) -> None:
        with self._lock:
            self.refused += 1
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
                it.inputs = self.judge.encode([it.triple])
                key = _shape_key(it.inputs) if self.batching == "same_shape" else (id(it),)
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
        "created": 0,
        "model": served_model_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": entry["token"]},
            "logprobs": {"content": [entry]},
            "finish_reason": "length",
        }],
        "usage": {"completion_tokens": 1},
    }


def make_server(judge: Any, served_model_name: str, host: str = "127.0.0.1", port: int = 0, *,
                max_batch_size: int = 16, max_wait_ms: float = 10.0, max_logprobs: int = MAX_TOP_LOGPROBS,
                request_timeout_s: float = 300.0, batching: str = "auto") -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for ``judge``; ``server.batcher`` holds the counters.

    ``port=0`` binds a free port (``server.server_address[1]``). Call ``serve_forever()``
    (e.g. on a thread) and ``shutdown()`` + ``batcher.close()`` to stop. ``batching``: see
    :data:`BATCHING_MODES`.
    """
    batcher = BatchingJudge(judge, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, batching=batching)
    max_model_len = getattr(judge, "max_model_len", None)
    counter = iter(range(1, 1 << 62))
    counter_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet access log
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"object": "error", "message": message, "code": status,
                                "type": "BadRequestError" if status < 500 else "InternalServerError"})

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "model": served_model_name, "requests": batcher.requests,
                                 "forward_passes": batcher.forward_passes, "max_batch": batcher.max_batch,
                                 "isolated_batches": batcher.isolated_batches, "refused": batcher.refused,
                                 "batching": batcher.batching, "max_model_len": max_model_len})
            elif self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [
                    {"id": served_model_name, "object": "model", "owned_by": "paco", "max_model_len": max_model_len}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._error(404, f"no route {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                triple, top_k = parse_chat_request(body, served_model_name, max_logprobs)
            except BadRequest as exc:
                self._error(exc.status, str(exc))
                return
            except (ValueError, UnicodeDecodeError) as exc:
                self._error(400, f"invalid JSON body ({exc})")
                return
            future = batcher.submit(triple, top_k)
            try:
                result = future.result(timeout=request_timeout_s)
            except FutureTimeout:
                future.cancel()  # still queued: the batcher skips it
                self._error(503, f"judge did not answer within {request_timeout_s:g} s")
                return
            except JudgeContextError as exc:  # too long: vLLM's message first, not retryable
                self._error(400, str(exc))
                return
            except ValueError as exc:  # the judge's processor refused this input: not retryable
                self._error(400, f"judge cannot score this input: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
                self._error(500, f"judge failed: {type(exc).__name__}: {exc}")
                return
            with counter_lock:
                rid = next(counter)
            self._send(200, completion_response(batcher, served_model_name, result, rid))

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.batcher = batcher  # type: ignore[attr-defined]
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paco.judge.serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="merged judge directory (reward_merge output) or any judge dir")
    p.add_argument("--served-model-name", required=True, help="the `model` name clients must send")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--batching", default="auto", choices=BATCHING_MODES,
                   help="same_shape/single: a request's log-probs do not depend on the others in its batch; "
                        "auto: same_shape on CPU, single elsewhere; dynamic: padded mixed batches (fastest, "
                        "not batch-invariant)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context bound in tokens (prompt + 1 answer token); 0: the model's max_position_embeddings")
    p.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, help="largest top_logprobs served")
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request not answered within this is dropped from the queue (HTTP 503)")
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
    server = make_server(judge, args.served_model_name, args.host, args.port,
                         max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                         max_logprobs=args.max_logprobs, request_timeout_s=args.request_timeout_s,
                         batching=args.batching)
    host, port = server.server_address[:2]
    log.info("serving %s as %r on http://%s:%d/v1 (batching %s, batch <= %d, wait <= %g ms, "
             "max_model_len %d, torch threads %d)", args.model, args.served_model_name, host, port,
             server.batcher.batching, args.max_batch_size, args.max_wait_ms, judge.max_model_len,
             torch.get_num_threads())
    if args.port_file:
        from paco.core.io import atomic_write_bytes

        atomic_write_bytes(args.port_file, str(port).encode())

    def _stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.batcher.close()  # type: ignore[attr-defined]
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
