"""VQAScore in its own Python environment: the worker :mod:`paco.benchmark.vqascore` runs.

t2v_metrics ships CLIP-FlanT5 (``clip-flant5-xxl``, T2IS-Bench's official prompt-alignment model,
chengyou-jia/T2IS ``T2IS_Eval/vqa_alignment.py:9``) only up to its legacy release 3.0 (from 2.1 on,
linzhiqiu/t2v_metrics commit 611d2d4, the CLIP-T5 models are commented out of
``t2v_metrics/models/vqascore_models/__init__.py``), and 3.0 pins ``torch==2.5.1``,
``numpy==1.26.4`` and ``transformers==4.49.0``, which cannot live in the project's environment.
So this file runs under another interpreter, that of a virtual environment holding
``t2v-metrics==3.0`` (``benchmark.<k>.t2is.vqascore_python``): it imports only the standard
library and ``t2v_metrics`` (the other environment has none of the project's packages) and is
run by its path, ``python /abs/path/vqascore_worker.py ...``, not as ``-m paco...`` (which would
import ``paco/__init__.py`` and need the project's packages there). Its own directory, which
Python puts first on ``sys.path``, is taken off before ``t2v_metrics`` is imported, so no module
of ``paco/benchmark`` (``tables.py``, ``evaluator.py``...) shadows a library's (PyTables is
``tables``).

Usage::

    python vqascore_worker.py preflight REQUEST.json
    python vqascore_worker.py score REQUEST.json RESULT.json

REQUEST.json: ``{"model": "clip-flant5-xxl", "cache_dir": "/abs/dir", "device": "cuda",
"repos": ["zhiqiulin/clip-flant5-xxl", ...], "panels": [{"image": "/abs/x_0000.png",
"texts": ["a red cat", ...]}, ...]}`` (``panels`` only for ``score``). ``cache_dir`` is passed
as t2v_metrics' ``cache_dir`` and set as ``HF_HUB_CACHE`` / ``TRANSFORMERS_CACHE`` before the
import (t2v_metrics 3.0 loads the model with ``cache_dir`` but the ``google/flan-t5-xxl``
tokenizer and the ``openai/clip-vit-large-patch14-336`` vision tower from the default cache,
``mm_utils.py`` ``load_pretrained_model`` and ``clip_encoder.py`` ``load_model``), so all three
are read from one directory.

``preflight``: t2v_metrics importable, ``model`` in ``t2v_metrics.list_all_vqascore_models()``,
``cache_dir`` a directory holding a snapshot of each of ``repos`` (the Hugging Face cache layout
``models--{org}--{name}/snapshots/``); nothing is loaded. ``score``: the same checks, then
``t2v_metrics.VQAScore(model=model, device=device, cache_dir=cache_dir)`` once and, per panel,
``scorer(images=[image], texts=texts)`` (vqa_alignment.py:26-31), its ``[1, n_texts]`` result's
row written to RESULT.json as ``{"model": model, "scores": [[P("Yes") of each text], ...]}``,
one list a panel, in order (values as t2v_metrics returns them; the caller checks ranges).

Exit status: 0 done; 2 (:data:`EXIT_UNAVAILABLE`) t2v_metrics not importable, the model not
listed, the cache dir or a snapshot missing, or ``VQAScore(...)`` raising (weights not in the
cache under ``HF_HUB_OFFLINE=1``, no GPU...); 3 (:data:`EXIT_SCORING`) a bad request, a call
raising or a result that is not ``[1, n_texts]``. The message is the last stderr line, starting
``vqascore_worker:``.
"""

import os
import sys

if __name__ == "__main__":  # run by path: Python put this file's directory first on sys.path
    _HERE = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

import json  # noqa: E402 - after the sys.path fix
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

EXIT_UNAVAILABLE = 2
EXIT_SCORING = 3
PREFIX = "vqascore_worker:"


class WorkerError(Exception):
    """A clear message and the exit status it ends the worker with."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


def read_request(path, scoring):
    """The request, checked: ``model``, ``cache_dir`` strings, ``repos`` a list, and for
    scoring ``panels`` a non-empty list of ``{"image": str, "texts": [str, ...]}``."""
    try:
        request = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkerError(f"cannot read the request {path}: {exc}", EXIT_SCORING) from None
    for key in ("model", "cache_dir", "device"):
        if not isinstance(request.get(key), str) or not request[key]:
            raise WorkerError(f"request {path}: {key!r} must be a non-empty string", EXIT_SCORING)
    if not isinstance(request.get("repos", []), list):
        raise WorkerError(f"request {path}: 'repos' must be a list of repository ids", EXIT_SCORING)
    if scoring:
        panels = request.get("panels")
        if not isinstance(panels, list) or not panels:
            raise WorkerError(f"request {path}: 'panels' must be a non-empty list", EXIT_SCORING)
        for i, panel in enumerate(panels):
            texts = panel.get("texts") if isinstance(panel, dict) else None
            if (not isinstance(panel, dict) or not isinstance(panel.get("image"), str) or not isinstance(texts, list)
                    or not texts or not all(isinstance(t, str) for t in texts)):
                raise WorkerError(f"request {path}: panel {i} must be {{'image': path, 'texts': [text, ...]}} "
                                  "with at least one text", EXIT_SCORING)
    return request


def check_cache(cache_dir, repos):
    """``cache_dir`` exists and holds a snapshot of each repository (Hugging Face cache layout)."""
    root = Path(cache_dir)
    if not root.is_dir():
        raise WorkerError(f"cache dir {cache_dir} (vqascore_cache_dir) is not a directory: download the weights "
                          "into it first (docs/running.md, 'Benchmarks')", EXIT_UNAVAILABLE)
    missing = []
    for repo in repos:
        snapshots = root / ("models--" + str(repo).replace("/", "--")) / "snapshots"
        if not snapshots.is_dir() or not any(snapshots.iterdir()):
            missing.append(str(repo))
    if missing:
        raise WorkerError(f"cache dir {cache_dir} holds no snapshot of {missing} (HF_HUB_OFFLINE=1: nothing is "
                          "downloaded in the stage): download them into it first (docs/running.md, 'Benchmarks')",
                          EXIT_UNAVAILABLE)


def import_t2v_metrics(request):
    """``t2v_metrics`` imported with the cache variables set, and the model listed in it."""
    os.environ["HF_HUB_CACHE"] = request["cache_dir"]
    os.environ["TRANSFORMERS_CACHE"] = request["cache_dir"]
    try:
        import t2v_metrics
    except Exception as exc:  # noqa: BLE001 - an ImportError, or 3.0's RuntimeError when ffmpeg is missing
        raise WorkerError(f"cannot import t2v_metrics with {sys.executable} ({type(exc).__name__}: {exc}); install "
                          "t2v-metrics==3.0 in that environment (docs/running.md, 'Benchmarks')",
                          EXIT_UNAVAILABLE) from None
    listed = list(t2v_metrics.list_all_vqascore_models())
    if request["model"] not in listed:
        version = getattr(t2v_metrics, "__version__", "unknown")
        raise WorkerError(f"model {request['model']!r} is not in t2v_metrics.list_all_vqascore_models() (t2v_metrics "
                          f"{version} at {getattr(t2v_metrics, '__file__', '?')}; CLIP-FlanT5 is only in the legacy "
                          f"release: pip install t2v-metrics==3.0); listed: {listed}", EXIT_UNAVAILABLE)
    return t2v_metrics


def _row(out, n_texts, where):
    """``out[0]`` of the ``[1, n_texts]`` result as a list (no range check: the caller's)."""
    if hasattr(out, "detach"):
        out = out.detach().cpu()
    if hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, list) or len(out) != 1 or not isinstance(out[0], list) or len(out[0]) != n_texts:
        raise WorkerError(f"{where}: VQAScore returned {out!r}, not a [1, {n_texts}] score matrix", EXIT_SCORING)
    return out[0]


def score(request):
    """One VQAScore model, one call per panel (module docstring); ``[[score, ...], ...]``."""
    t2v_metrics = import_t2v_metrics(request)
    check_cache(request["cache_dir"], request.get("repos", []))
    try:
        scorer = t2v_metrics.VQAScore(model=request["model"], device=request["device"], cache_dir=request["cache_dir"])
    except Exception as exc:  # noqa: BLE001 - transformers / torch raise many types
        raise WorkerError(f"t2v_metrics.VQAScore(model={request['model']!r}, device={request['device']!r}, "
                          f"cache_dir={request['cache_dir']!r}) failed ({type(exc).__name__}: {exc}); are the weights "
                          "of every repository in that cache dir (HF_HUB_OFFLINE=1) and the device there?",
                          EXIT_UNAVAILABLE) from None
    rows = []
    for panel in request["panels"]:
        where = f"panel {panel['image']}"
        try:
            out = scorer(images=[panel["image"]], texts=list(panel["texts"]))
        except Exception as exc:  # noqa: BLE001
            raise WorkerError(f"{where}: VQAScore raised {type(exc).__name__}: {exc}", EXIT_SCORING) from None
        rows.append(_row(out, len(panel["texts"]), where))
    return rows


def main(argv):
    """Run ``preflight`` or ``score`` (module docstring); the exit status."""
    if len(argv) < 2 or argv[0] not in ("preflight", "score") or len(argv) != (2 if argv[0] == "preflight" else 3):
        print(f"{PREFIX} usage: vqascore_worker.py preflight REQUEST | score REQUEST RESULT", file=sys.stderr)
        return EXIT_SCORING
    try:
        request = read_request(argv[1], scoring=argv[0] == "score")
        if argv[0] == "preflight":
            import_t2v_metrics(request)
            check_cache(request["cache_dir"], request.get("repos", []))
            print(f"{PREFIX} ok: t2v_metrics lists {request['model']!r}, cache dir {request['cache_dir']}")
            return 0
        rows = score(request)
        Path(argv[2]).write_text(json.dumps({"model": request["model"], "scores": rows}), encoding="utf-8")
        return 0
    except WorkerError as exc:
        print(f"{PREFIX} {exc}", file=sys.stderr)
        return exc.status
    except Exception:  # noqa: BLE001 - anything else: the traceback, then one clear line
        traceback.print_exc()
        print(f"{PREFIX} unexpected error (traceback above)", file=sys.stderr)
        return EXIT_SCORING


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
