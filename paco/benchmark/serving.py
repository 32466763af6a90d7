"""The benchmark stage's evaluators: each an
:class:`~paco.benchmark.evaluator.Evaluator` on a given URL, or on a server of its model that the
stage starts itself, exactly as grpo serves its judge (:class:`paco.serving.local.LocalServer`
with ``judge_endpoint.server``'s engine, dtype, restarts and vLLM flags: one that dies is
restarted), and only when a question is not in the answer cache: a rerun whose answers are all
cached starts no server and asks nothing.

* :class:`BenchEvaluator`: one evaluator (a column of the benchmark's table) with its cache;
  ``backend="transformers"``: the model answers in this process
  (:class:`~paco.benchmark.local_evaluator.LocalEvaluator`, ``judge_endpoint.server``'s device,
  dtype and ``max_model_len``), no server is started, and it is loaded only when a batch is not
  all cached.
* :func:`ask_evaluators`: run a function for every evaluator: all at once when every server is
  the project's own (``engine: paco``, a process of one CPU thread each), one after the other
  when a vLLM server takes the GPUs (each stopped before the next starts).
* :func:`prepare_answers`: the persisted answer-cache directory, kept only under the same run
  identity (:mod:`paco.core.run_identity`: the samples, the items, every served evaluator's
  weights, the code and the params), so changed evaluator weights never reuse an old answer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from paco.benchmark.answer_cache import AnswerCache
from paco.benchmark.evaluator import Evaluator, EvaluatorError
from paco.core.io import ArtifactError

#: the evaluator backends: ``openai`` (a URL, or a server the stage starts), ``transformers``
#: (the model in this process, :mod:`paco.benchmark.local_evaluator`)
BACKENDS = ("openai", "transformers")

log = logging.getLogger("paco.benchmark.serving")

#: never contacted: the base URL of the cache-only client of a served evaluator (it answers a
#: batch only when every answer is cached, :meth:`Evaluator.pending`)
UNSERVED_URL = "http://127.0.0.1:9/v1"


def prepare_answers(directory: str | os.PathLike[str], identity: str) -> int:
    """Make ``directory`` hold only answers written under run identity ``identity`` (a digest);
    returns how many answer files it keeps (:func:`paco.core.checkpoints.keep_under_identity`: a
    directory of another identity, or with an unreadable marker, is cleared, since its answers may
    come from other weights or inputs; the ``.*.tmp`` files an interrupted
    :func:`~paco.benchmark.answer_cache.compact_answers` left are removed).

    Raises:
        OSError: the directory cannot be cleared or written.
    """
    from paco.core.checkpoints import keep_under_identity

    path = keep_under_identity(directory, identity, what="answer cache", log=log)
    return len(list(path.glob("*.jsonl")))


class BenchEvaluator:
    """One benchmark evaluator with its answer cache (``answers-<name>.jsonl`` in ``cache_dir``).

    Args:
        name: the evaluator's name (its column; the cache part).
        served_model_name: the model name asked for.
        url: its endpoint, or ``None``: the stage serves ``model_dir`` itself with
            ``server_kwargs`` (:class:`~paco.serving.local.LocalServer`'s keywords),
            started by :meth:`start` or by the first batch that is not all cached.
        client_kwargs: :class:`Evaluator`'s keywords (concurrency, timeout_s, retries,
            top_logprobs, api_key).
        cache_dir: the answer directory (``None``: in memory).
        backend: one of :data:`BACKENDS`; ``transformers`` needs ``url`` ``None`` and takes
            ``device``, ``dtype`` and ``max_model_len`` of ``server_kwargs`` and ``top_logprobs``
            (and ``answer_variants``) of ``client_kwargs`` (the rest concern HTTP and are unused).

    Attributes:
        started: whether a server was started, or a ``transformers`` model loaded (never, on a
            run whose answers were all cached).
        doubles_single_images: the stage serves it with the project's server (``engine: paco``),
            which takes exactly two images and a text (the judge's pair question): a one-image
            question (GEdit-Bench's PQ, T2IS-Bench's PA) is sent with its image twice, a
            stand-in the table notes.

    Raises:
        ArtifactError: a served or ``transformers`` evaluator's ``model_dir`` holds no model (no
            ``config.json``), or no complete weights (``transformers``).
        ValueError: an unknown ``backend``; ``transformers`` with a ``url``; a bad device or dtype.
    """

    def __init__(self, name: str, served_model_name: str, *, url: str | None, model_dir: str | Path | None,
                 server_kwargs: Mapping[str, Any] | None, client_kwargs: Mapping[str, Any],
                 cache_dir: str | Path | None, backend: str = "openai"):
        if backend not in BACKENDS:
            raise ValueError(f"evaluator {name!r}: backend {backend!r} is not one of {BACKENDS}")
        if backend == "transformers" and url is not None:
            raise ValueError(f"evaluator {name!r}: backend 'transformers' runs model_dir in this process; "
                             f"it takes no url (got {url!r})")
        self.name, self.served_model_name, self.url, self.backend = name, served_model_name, url, backend
        self.model_dir = None if model_dir is None else Path(model_dir)
        if url is None and (self.model_dir is None or not (self.model_dir / "config.json").is_file()):
            raise ArtifactError(f"evaluator {name!r}: {self.model_dir} holds no model (no config.json): run the "
                                "stage that writes it (models, reward_merge), or give the evaluator a url")
        self.cache = AnswerCache(cache_dir, part=name)
        self._client_kwargs = dict(client_kwargs)
        self._server_kwargs = dict(server_kwargs or {})
        self.doubles_single_images = (url is None and backend == "openai"
                                      and self._server_kwargs.get("engine", "paco") == "paco")
        self._server = None
        self.started = False
        self._cancelled = threading.Event()
        self._online: Evaluator | None = None
        self._lock = threading.Lock()
        self._offline = self._local(name) if backend == "transformers" else \
            Evaluator(name, url or UNSERVED_URL, served_model_name, cache=self.cache, **self._client_kwargs)

    def _local(self, name: str) -> Evaluator:
        """The in-process evaluator of ``backend="transformers"`` (loaded on its first uncached batch)."""
        from paco.benchmark.local_evaluator import LocalEvaluator
        from paco.models.loading import ModelDirectoryError

        s, c = self._server_kwargs, self._client_kwargs
        try:
            return LocalEvaluator(name, self.model_dir, self.served_model_name, device=s.get("device", "auto"),
                                  dtype=s.get("dtype", "float32"), max_model_len=s.get("max_model_len"),
                                  top_logprobs=c.get("top_logprobs", 20),
                                  answer_variants=c.get("answer_variants", False), cache=self.cache)
        except ModelDirectoryError as exc:
            raise ArtifactError(f"evaluator {name!r}: {exc}: run the stage that writes it (models, "
                                "reward_merge)") from None

    def __repr__(self) -> str:
        return f"BenchEvaluator({self.name!r}, {self.url or self.model_dir})"

    @property
    def asked(self) -> int:
        """Answers fetched from the server."""
        return self._offline.asked + (self._online.asked if self._online is not None else 0)

    @property
    def hits(self) -> int:
        """Answers the cache gave."""
        return self._offline.hits + (self._online.hits if self._online is not None else 0)

    def describe(self) -> dict[str, Any]:
        """``{served_model_name, url or model, served_by_stage, started}`` for the report."""
        return {"served_model_name": self.served_model_name, "url": self.url, "backend": self.backend,
                "model": None if self.model_dir is None else str(self.model_dir),
                "served_by_stage": self.url is None, "server_started": self.started,
                "doubles_single_images": self.doubles_single_images}

    def _adapt(self, requests: Sequence[Any]) -> list[Any]:
        """The requests as sent: a one-image request with its image twice when
        :attr:`doubles_single_images`."""
        if not self.doubles_single_images:
            return list(requests)
        return [([*images, *images] if len(images) == 1 else images, text) for images, text in requests]

    def start(self) -> None:
        """Start this evaluator's server now (it loads while the caller goes on); nothing for a URL
        evaluator, a started one or a ``transformers`` one (its model loads at its first uncached
        batch: the stage asks in-process evaluators one after the other, never together)."""
        from paco.serving.local import LocalServer

        with self._lock:
            if self.url is not None or self._server is not None or self.backend == "transformers":
                return
            self._server = LocalServer(self.model_dir, self.served_model_name, error=EvaluatorError,
                                       **self._server_kwargs)
            self._server.start()
            self.started = True

    def cancel(self) -> None:
        """Refuse every later batch (:class:`EvaluatorError`): another evaluator failed, so this
        one's work is stopped at its next batch instead of asking all its questions."""
        self._cancelled.set()

    def _evaluator(self, kind: str, requests: Sequence[Any], **kw: Any) -> Evaluator:
        """The client for this batch: the cache-only one if the cache answers all of it, else one
        on the (started if need be) server.

        Raises:
            EvaluatorError: :meth:`cancel` was called, or the server did not come up.
        """
        if self._cancelled.is_set():
            raise EvaluatorError(f"evaluator {self.name!r}: cancelled (another evaluator failed)")
        if self.url is not None or self._offline.pending(kind, requests, **kw) == 0:
            return self._offline
        if self.backend == "transformers":
            self.started = True
            try:
                self._offline.load()
            except Exception as exc:  # ModelDirectoryError, WeightsMismatchError, OSError, CUDA errors
                raise EvaluatorError(f"evaluator {self.name!r}: cannot load {self.model_dir}: "
                                     f"{type(exc).__name__}: {exc}") from None
            return self._offline
        self.start()
        with self._lock:
            if self._online is None:
                try:
                    url = self._server.wait_ready()
                except Exception as exc:  # JudgeError: the server did not come up
                    raise EvaluatorError(f"evaluator {self.name!r}: {exc}") from None
                self._online = Evaluator(self.name, url, self.served_model_name, cache=self.cache,
                                         supervisor=self._server, **self._client_kwargs)
            return self._online

    def yes_probabilities(self, requests: Sequence[Any], *, text_first: bool = False) -> list[float]:
        """:meth:`Evaluator.yes_probabilities`."""
        requests = self._adapt(requests)
        return self._evaluator("yes_no", requests, text_first=text_first).yes_probabilities(
            requests, text_first=text_first)

    def score_token_logprobs_many(self, requests: Sequence[Any], *, text_first: bool = False
                                  ) -> list[dict[str, float]]:
        """:meth:`Evaluator.score_token_logprobs_many`."""
        requests = self._adapt(requests)
        return self._evaluator("score_tokens", requests, text_first=text_first).score_token_logprobs_many(
            requests, text_first=text_first)

    def replies(self, requests: Sequence[Any], max_tokens: int, *, text_first: bool = False,
                attempt: int = 0) -> list[str]:
        """:meth:`Evaluator.replies`."""
        requests = self._adapt(requests)
        ev = self._evaluator("reply", requests, max_tokens=max_tokens, text_first=text_first, attempt=attempt)
        return ev.replies(requests, max_tokens, text_first=text_first, attempt=attempt)

    def pending(self, kind: str, requests: Sequence[Any], **kw: Any) -> int:
        """:meth:`Evaluator.pending` against this evaluator's cache."""
        return self._offline.pending(kind, self._adapt(requests), **kw)

    def close(self) -> None:
        """Stop the server (if one runs), drop a ``transformers`` model and close the clients
        (again: nothing)."""
        server, self._server = self._server, None
        if server is not None:
            server.__exit__(None, None, None)
        for ev in (self._offline, self._online):
            if ev is not None:
                ev.close()


def ask_evaluators(evaluators: Sequence[BenchEvaluator], work: Callable[[BenchEvaluator], Any], *,
                   together: bool, first: Callable[[BenchEvaluator], bool] | None = None) -> list[Any]:
    """``work(ev)`` of each evaluator, in order; each evaluator is closed (its server stopped)
    after its work.

    Args:
        together: run them at once, one thread each, every server started first (the project's
            CPU servers); else one after the other (vLLM servers sharing the job's GPUs).
        first: ``first(ev)`` true: start ``ev``'s server before any work (it loads meanwhile);
            only with ``together``; a server not started so is started by its first uncached batch.

    Raises:
        the first error (one after the other: of the evaluator that failed; together: of the
        first evaluator to fail, raised as soon as it fails: the others are cancelled
        (:meth:`BenchEvaluator.cancel`, their work stops at its next batch), their pending work
        is dropped and every evaluator is closed, without waiting for their questions in flight).
    """
    if not together:
        out = []
        for ev in evaluators:
            try:
                out.append(work(ev))
            finally:
                ev.close()
        return out
    try:
        for ev in evaluators:
            if first is not None and first(ev):
                ev.start()
        pool = ThreadPoolExecutor(max_workers=max(1, len(evaluators)))
        futures = [pool.submit(work, ev) for ev in evaluators]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for ev in evaluators:
                ev.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            raise failed[0].exception()
        pool.shutdown(wait=True)
        return [f.result() for f in futures]
    finally:
        for ev in evaluators:
            ev.close()
