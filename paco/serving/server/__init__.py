"""Serve a PaCo-Reward judge over the OpenAI-compatible subset that vLLM exposes (FastAPI + uvicorn).

At paper scale the judge is served by vLLM on GPUs::

    vllm serve data/reward_merge/model --served-model-name paco-reward --port 8000

and the GRPO stage is pointed at it with ``judge_endpoint.url: http://<host>:8000/v1``. This package is
the same protocol on a transformers backend, for CPUs, single GPUs and tests::

    paco-serve-judge --model data/reward_merge/model --served-model-name paco-reward --port 8000

(``python -m paco.serving.server`` takes the same flags). Endpoints: ``POST /v1/chat/completions``
(first-token scoring of one ``[image A, image B, text]`` message, with ``top_logprobs``),
``GET /v1/models`` and ``GET /health``. With the default ``--batching auto`` (= ``single``) every
request gets a forward pass of its own, so its log-probs are bit-identical however requests
arrive (batch-invariant); the other modes trade that for speed.

Who may use it: a loopback ``--host`` (the default) answers only requests addressed to a
loopback name; ``--api-key`` (or ``PACO_JUDGE_API_KEY``) requires ``Authorization: Bearer``
on ``/v1``, and any other ``--host`` needs one (or ``--allow-unauthenticated``); a ``POST``
must be ``application/json``. The model is served only if its weights are exactly the model's
(:mod:`paco.models.loading`).

Modules, in the order a request meets them:

* :mod:`paco.serving.server.guard` -- the ``Host``, API-key and ``Content-Type`` checks before any
  route, and the listening socket.
* :mod:`paco.serving.server.protocol` -- the wire format: the OpenAI request schema (pydantic) and
  its parsing, the images of ``data:`` URLs, the ``chat.completion`` reply and the OpenAI error
  object.
* :mod:`paco.serving.server.limits` -- :class:`~paco.serving.server.limits.ServerLimits`, what one
  request may cost before the model sees it.
* :mod:`paco.serving.server.preparation` -- the request path on the server's thread pool: parse,
  decode (cached), bound the context and encode (per-image feature cache).
* :mod:`paco.serving.server.batching` -- the one worker thread that owns the model and the
  ``--batching`` modes.
* :mod:`paco.serving.server.app` -- the FastAPI app (endpoints, errors, in-flight bound) and
  :class:`~paco.serving.server.app.JudgeServer`, the app on uvicorn.
* :mod:`paco.serving.server.cli` -- the command line (``main``) and the process lifetime
  (``--parent-pid``, SIGTERM / SIGINT / SIGHUP); ``python -m paco.serving.server`` runs it.
"""
