"""VQAScore through linzhiqiu/t2v_metrics: T2IS-Bench's official prompt-alignment scorer (paper Table 3).

chengyou-jia/T2IS ``T2IS_Eval/vqa_alignment.py`` (commit a40b858) builds
``t2v_metrics.VQAScore(model='clip-flant5-xxl')`` once (line 9) and, for each panel file
``{task_id}_{k:04d}.png`` (line 15), calls it with that one path and the panel's criteria texts,
Entity then Attribute then Relation, concatenated (lines 26-31: ``scores =
clip_flant5_score(images=[image_path], texts=texts)``), reading ``scores[0][i]``. The texts are
the raw criteria: t2v_metrics wraps each in its own question template
(:data:`paco.benchmark.t2is_bench.PA_QUESTION`; linzhiqiu/t2v_metrics commit 8e106a5,
``t2v_metrics/models/vqascore_models/clip_t5_model.py`` lines 9-10, the same lines in the 3.0
release) and returns P("Yes"), a ``[n_images, n_texts]`` tensor (``t2v_metrics/score.py``
``Score.forward``).

t2v_metrics ships CLIP-FlanT5 only up to its legacy release 3.0, which pins ``torch==2.5.1``,
``numpy==1.26.4`` and ``transformers==4.49.0``: it cannot be installed into the project's
environment. So VQAScore runs in its own virtual environment (``benchmark.<k>.t2is.vqascore_python``,
its interpreter) as a subprocess, :mod:`paco.benchmark.vqascore_worker` run by its path, with the
weights read from ``vqascore_cache_dir`` (downloaded beforehand: every stage but ``models`` runs
with ``HF_HUB_OFFLINE=1``, kept for the worker). :func:`vqascore_panels` writes each panel as an
RGB PNG under its official name in a temporary directory (t2v_metrics reads paths), the request
JSON next to them, runs the worker once (one model load for all panels, one call per panel),
and checks its result: one ``[P("Yes") of each text]`` list a panel, each in [0, 1].
:func:`preflight` checks the environment cheaply (t2v_metrics importable, the model listed, the
cache dir holding :data:`WEIGHT_REPOS`) before any evaluator is asked.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from paco.benchmark.vqascore_worker import EXIT_UNAVAILABLE
from paco.core.io import ArtifactError

__all__ = ["OFFICIAL_MODEL", "WEIGHT_REPOS", "WORKER", "INSTALL_COMMAND", "PREFLIGHT_TIMEOUT_S", "SCORE_TIMEOUT_S",
           "VQAScoreError", "VQAScoreUnavailableError", "preflight", "vqascore_panels"]

#: vqa_alignment.py:9
OFFICIAL_MODEL = "clip-flant5-xxl"
#: the Hugging Face repositories t2v_metrics 3.0 loads for each model, all read from the cache dir:
#: clip_t5_model.py ``CLIP_T5_MODELS['clip-flant5-xxl']`` (model ``zhiqiulin/clip-flant5-xxl``,
#: tokenizer ``google/flan-t5-xxl``) and the vision tower its config names
#: (``clip_t5/model/language_model/clip_t5.py`` ``ModelArguments.vision_tower``)
WEIGHT_REPOS = {OFFICIAL_MODEL: ("zhiqiulin/clip-flant5-xxl", "google/flan-t5-xxl",
                                 "openai/clip-vit-large-patch14-336")}
#: the worker, run by its path under ``vqascore_python``
WORKER = Path(__file__).with_name("vqascore_worker.py")
#: how to build the separate environment (docs/running.md, 'Benchmarks')
INSTALL_COMMAND = ("python3 -m venv /opt/t2v && /opt/t2v/bin/pip install t2v-metrics==3.0 (ffmpeg on PATH, a CUDA "
                   "GPU; docs/running.md, 'Benchmarks')")
#: seconds the preflight may take (importing t2v_metrics imports torch and transformers)
PREFLIGHT_TIMEOUT_S = 600.0
#: seconds one scoring run may take (the paper preset's benchmark member runs 240 minutes)
SCORE_TIMEOUT_S = 4 * 3600.0
#: characters of the worker's output quoted in an error
TAIL_CHARS = 3000


class VQAScoreError(ArtifactError):
    """VQAScore gave no usable score (base of this module's errors)."""


class VQAScoreUnavailableError(VQAScoreError):
    """The VQAScore environment cannot score: no interpreter, t2v_metrics missing there, the model
    not listed, the weights not in the cache dir, or the model not constructed."""


def _interpreter(python: str | os.PathLike[str] | None) -> str:
    """``python`` as an executable path (a name is looked up on ``PATH``)."""
    if python is None or not str(python).strip():
        raise VQAScoreUnavailableError("prompt_alignment t2v_metrics: t2is.vqascore_python is not set (the interpreter "
                                       f"of a separate environment: {INSTALL_COMMAND})")
    found = shutil.which(str(python))
    if found is None:
        raise VQAScoreUnavailableError(f"prompt_alignment t2v_metrics: vqascore_python {python} is not an executable "
                                       f"file (build the environment: {INSTALL_COMMAND})")
    return found


def _request(model: str, cache_dir: str | os.PathLike[str] | None, device: str) -> dict[str, Any]:
    if cache_dir is None or not str(cache_dir).strip():
        raise VQAScoreUnavailableError("prompt_alignment t2v_metrics: t2is.vqascore_cache_dir is not set (the "
                                       f"directory holding {list(WEIGHT_REPOS.get(model, ()))}, docs/running.md)")
    return {"model": model, "cache_dir": str(Path(cache_dir).resolve()), "device": device,
            "repos": list(WEIGHT_REPOS.get(model, ()))}


def _tail(log: Path) -> str:
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    return text[-TAIL_CHARS:].strip() or "(no output)"


def _run_worker(python: str, args: list[str], work: Path, timeout_s: float, what: str) -> None:
    """Run the worker with its output in ``work/worker.log``; a named error on failure.

    ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are passed on as the stage has them (set to 1
    when unset: nothing is downloaded in a stage)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    log = work / "worker.log"
    try:
        with open(log, "wb") as out:
            proc = subprocess.run([python, str(WORKER), *args], stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise VQAScoreError(f"{what}: the VQAScore worker ran past {timeout_s:.0f} s; its output ends:\n"
                            f"{_tail(log)}") from None
    except OSError as exc:
        raise VQAScoreUnavailableError(f"{what}: cannot run {python} ({exc})") from None
    if proc.returncode != 0:
        cls = VQAScoreUnavailableError if proc.returncode == EXIT_UNAVAILABLE else VQAScoreError
        raise cls(f"{what}: the VQAScore worker ({python} {WORKER.name}) exited with status {proc.returncode}; "
                  f"its output ends:\n{_tail(log)}")


def preflight(python: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None, *,
              model: str = OFFICIAL_MODEL, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Check the VQAScore environment without loading the model (the worker's ``preflight``).

    Args:
        python: the separate environment's interpreter (``t2is.vqascore_python``).
        cache_dir: the directory holding :data:`WEIGHT_REPOS` of ``model`` in the Hugging Face
            cache layout (``t2is.vqascore_cache_dir``).

    Raises:
        VQAScoreUnavailableError: a parameter unset, no such interpreter, t2v_metrics not
            importable there, ``model`` not in ``t2v_metrics.list_all_vqascore_models()``, the
            cache dir or a repository's snapshot missing (the worker's message quoted).
        VQAScoreError: the worker failed otherwise or ran past ``timeout_s``.
    """
    exe = _interpreter(python)
    request = _request(model, cache_dir, "cpu")
    with tempfile.TemporaryDirectory(prefix="vqascore-preflight-") as tmp:
        (Path(tmp) / "request.json").write_text(json.dumps(request), encoding="utf-8")
        _run_worker(exe, ["preflight", str(Path(tmp) / "request.json")], Path(tmp), timeout_s,
                    "prompt_alignment t2v_metrics preflight")


def _rows(result: Any, texts: list[list[str]], names: list[str]) -> list[list[float]]:
    """The worker's ``scores``: one list a panel, as many values as texts, each in [0, 1]."""
    rows = result.get("scores") if isinstance(result, dict) else None
    if not isinstance(rows, list) or len(rows) != len(texts):
        raise VQAScoreError(f"the VQAScore worker returned {rows!r:.200}, not {len(texts)} score lists")
    out = []
    for name, row, want in zip(names, rows, texts, strict=True):
        if not isinstance(row, list) or len(row) != len(want):
            raise VQAScoreError(f"panel {name}: VQAScore returned {row!r}, not {len(want)} scores")
        for v in row:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
                raise VQAScoreError(f"panel {name}: VQAScore {v!r} is not a probability in [0, 1]")
        out.append([float(v) for v in row])
    return out


def vqascore_panels(panels: Iterable[tuple[str, Image.Image, Sequence[str]]], *,
                    python: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None,
                    model: str = OFFICIAL_MODEL, device: str = "cuda", tmp_dir: str | Path | None = None,
                    timeout_s: float = SCORE_TIMEOUT_S) -> list[list[float]]:
    """VQAScore of each panel against its criteria, one call per panel as vqa_alignment.py:26-31,
    in the separate environment (module docstring).

    Args:
        panels: ``(file name, panel image, criteria texts)``; the file name is the official
            ``{case_id}_{k:04d}.png`` (:func:`paco.benchmark.t2is_panels.official_file_name`),
            possibly under a folder (``base/...``), unique, the texts the raw criteria
            (t2v_metrics adds the question), at least one.
        python, cache_dir: ``t2is.vqascore_python`` and ``t2is.vqascore_cache_dir``.
        model: the t2v_metrics model name (:data:`OFFICIAL_MODEL`).
        device: the worker's torch device (t2v_metrics' default is ``cuda``).
        tmp_dir: where the temporary directory of PNG files goes (the system's by default); it
            holds every panel at once (one PNG each) and is removed afterwards.
        timeout_s: seconds the worker may run.

    Returns:
        one list a panel: P("Yes") of each text, in order, as the worker wrote them (float64).

    Raises:
        VQAScoreUnavailableError: as :func:`preflight`, or ``VQAScore(...)`` raising in the worker
            (weights missing under ``HF_HUB_OFFLINE=1``, no GPU...).
        VQAScoreError: a panel without texts or a repeated file name; a call raising, a result
            that is not ``[1, n_texts]`` or holds a value outside [0, 1] (a failed model, never
            scored 0); the worker past ``timeout_s``.
    """
    exe = _interpreter(python)
    request = _request(model, cache_dir, device)
    with tempfile.TemporaryDirectory(prefix="vqascore-", dir=tmp_dir) as tmp:
        work = Path(tmp)
        (work / "panels").mkdir()
        names, texts, seen = [], [], set()
        for name, image, criteria in panels:
            criteria = [str(t) for t in criteria]
            if not criteria:
                raise VQAScoreError(f"panel {name}: no criteria texts to score")
            rel = Path(name)
            if name in seen or rel.is_absolute() or ".." in rel.parts or not rel.name:
                raise VQAScoreError(f"panel {name}: the file name must be a relative path, unique within the run")
            (work / "panels" / rel).parent.mkdir(parents=True, exist_ok=True)
            image.convert("RGB").save(work / "panels" / rel, format="PNG")
            seen.add(name)
            names.append(name)
            texts.append(criteria)
        if not names:
            return []
        request["panels"] = [{"image": str(work / "panels" / n), "texts": t} for n, t in zip(names, texts, strict=True)]
        (work / "request.json").write_text(json.dumps(request), encoding="utf-8")
        _run_worker(exe, ["score", str(work / "request.json"), str(work / "result.json")], work, timeout_s,
                    "prompt_alignment t2v_metrics")
        try:
            result = json.loads((work / "result.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise VQAScoreError(f"the VQAScore worker wrote no readable result ({exc}); its output ends:\n"
                                f"{_tail(work / 'worker.log')}") from None
        return _rows(result, texts, names)
