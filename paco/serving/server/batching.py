"""The judge server's worker: one thread that owns the model and scores queued requests in
rounds (:class:`BatchingJudge`), and the ``--batching`` modes that decide which requests share a
forward pass.

The worker takes the first waiting request, then keeps taking requests until
``max_batch_size`` are collected or ``max_wait_ms`` have passed since the first, or no other
request is being read or prepared (a lone request is not kept waiting). What it does with
them depends on the mode:

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
  Nothing is padded and the vision tower runs per image (:meth:`paco.judge.model.Judge.logits`),
  but the language model's GEMMs see ``n`` times the rows, and whether a row then rounds as it
  does alone is the CPU's GEMM kernels' choice, not this code's: on some CPUs the scores, and
  with them a GRPO run's LoRA bytes, differ from ``single``'s. Less judge CPU time, which shortens
  a GRPO run only where rewards do not overlap sampling (figures: ``benchmarks/bench_judge.py``,
  docs/embedded_default.md); not for runs that must give the same bytes.
* ``dynamic``: all collected requests encoded together, left-padded, in one forward pass (the
  fastest, but a request's logits then depend on the others through padding, by up to ~3e-6,
  so GRPO runs are not reproducible run to run).

When a batched forward pass fails, its requests are scored again one at a time, so only the
request that caused it fails. A request whose future was cancelled while queued (its client
gave up or timed out) is not computed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("paco.serving.server")

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


@dataclass
class _Item:
    triple: tuple[Any, Any, str]
    top_k: int
    inputs: Any = None  # the request's own encoding (None: the worker encodes; dynamic encodes batches)
    future: Future = field(default_factory=Future)


def _shape_key(inputs: Any) -> tuple | None:
    """What must be equal for two encodings to share an unpadded forward pass: every tensor's
    shape, and the image grids (which set the vision tower's attention windows). ``None`` when
    the request's images have different grids: when the tower ran per request, it computed a
    request's features differently inside a batch than alone (on CPU, in every such
    batch), so such a request gets a forward pass of its own."""
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
