"""Chain-of-thought label teachers: justify a KNOWN pair label with 1-3 numbered reasons.

The ``reasons`` stage turns each pair ``(image A, image B, label)`` into an SFT example whose
target is ``"Yes. <reason>1. ... 2. ...</reason>"`` (:func:`paco.judge.response.format_response`).
The paper (§3.1) has GPT-5 write those reasons for human labels; here the reason writer is a
backend behind one interface::

    teacher = make_teacher(params["reasons"]["teacher"])
    results = teacher.explain([PairItem(pair_id, image_a, image_b, label, theme), ...])

Backends:

* ``template`` (offline, deterministic; the embedded default): reasons derived from measured
  differences between the two panels (CIELAB colour statistics, saturation, greyscale-ness,
  palette overlap, SSIM, brightness-layout correlation, edge orientations, edge density,
  high-frequency energy, posterisation), phrased per consistency dimension (identity, style,
  logic). A Yes cites the most similar measurements, a No the most different ones.
* ``openai``: any OpenAI-compatible ``/chat/completions`` endpoint, images as PNG data URLs, the
  label stated in the instruction (:data:`paco.core.templates.TEACHER_COT`).
* ``local``: a transformers Qwen2.5-VL loaded from a directory, generating in-process.

``fast=True`` (any backend): the bare ``"Yes."``/``"No."`` target of PaCo-Reward-7B-Fast
(paper §7); nothing is called.

A label is never changed: a teacher response that does not start with the expected answer is
retried and then recorded as failed (``ok=False`` with the reason in ``error``); every input item
gets exactly one :class:`~paco.judge.teachers.base.TeacherResult`, in input order.

Params (the ``reasons.teacher`` section, :class:`paco.core.params.TeacherParams`; :func:`make_teacher`)::

    backend: template          # template | openai | local
    fast: false                # bare "Yes."/"No." targets, no teacher call
    max_reasons: 3             # 1..max_reasons reasons per pair
    retries: 2                 # re-asks after a wrong answer; openai: also the client's max_retries
    timeout_s: 60              # per HTTP request (openai)
    template: {size: 128}      # side (px) both panels are resized to before measuring
    openai:
      base_url: null           # e.g. http://127.0.0.1:8000/v1
      model: null              # served model name
      api_key_env: null        # NAME of the environment variable holding the key (never the key)
      max_tokens: 256
      temperature: 0.0
      retry_temperature: 0.7   # temperature of re-asks after a wrong/unparsable answer
      concurrency: 4           # parallel requests
    local:
      model_dir: null          # HF directory (a `models` stage output, e.g. data/models/teacher)
      batch_size: 4
      max_new_tokens: 256
      temperature: 0.7         # sampling temperature of retries (the first try is greedy)
      seed: 0
      device: cpu

Modules: :mod:`~paco.judge.teachers.base` (the interface: ``PairItem``, ``TeacherResult``,
``Teacher``), :mod:`~paco.judge.teachers.image_features` (the template teacher's image
measurements), :mod:`~paco.judge.teachers.template`, :mod:`~paco.judge.teachers.openai_api` and
:mod:`~paco.judge.teachers.local` (the backends); :func:`make_teacher` (here) builds one from params.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paco.judge.teachers.base import Teacher, TeacherConfigError
from paco.judge.teachers.local import LocalTeacher
from paco.judge.teachers.openai_api import OpenAITeacher
from paco.judge.teachers.template import TemplateTeacher

__all__ = ["make_teacher"]


def make_teacher(cfg: Any = None, **overrides: Any) -> Teacher:
    """Build a teacher from the ``reasons.teacher`` params section.

    Args:
        cfg: a :class:`paco.core.params.TeacherParams`, or a mapping validated by it (missing keys take
            its defaults, the one schema of the section). ``None`` gives the default template
            teacher.
        **overrides: top-level keys overriding ``cfg`` (e.g. ``fast=True``).

    Returns:
        :class:`~paco.judge.teachers.template.TemplateTeacher`,
        :class:`~paco.judge.teachers.openai_api.OpenAITeacher` or
        :class:`~paco.judge.teachers.local.LocalTeacher`.

    Raises:
        TeacherConfigError: unknown key (named with its dotted path), unknown backend, or a
            backend-specific error (missing base_url/model/model_dir, unset api_key_env).
    """
    from pydantic import ValidationError

    from paco.core.params import TeacherParams, format_validation_errors

    raw = cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg or {})
    if not isinstance(raw, Mapping):
        raise TeacherConfigError(f"teacher must be a mapping, got {type(cfg).__name__}")
    merged = {**raw, **overrides}
    try:
        c = TeacherParams.model_validate(merged).model_dump()
    except ValidationError as exc:
        raise TeacherConfigError(format_validation_errors(exc, "teacher", merged)) from exc
    common = {"fast": bool(c["fast"]), "max_reasons": int(c["max_reasons"]), "retries": int(c["retries"])}
    backend = c["backend"]
    if backend == "template":
        return TemplateTeacher(size=int(c["template"]["size"]), **common)
    if backend == "openai":
        o = c["openai"]
        return OpenAITeacher(base_url=o["base_url"], model=o["model"], api_key_env=o["api_key_env"],
                             max_tokens=o["max_tokens"], temperature=o["temperature"],
                             retry_temperature=o["retry_temperature"], concurrency=o["concurrency"],
                             timeout_s=c["timeout_s"], **common)
    if backend == "local":
        lo = c["local"]
        return LocalTeacher(model_dir=lo["model_dir"], batch_size=lo["batch_size"],
                            max_new_tokens=lo["max_new_tokens"], temperature=lo["temperature"], seed=lo["seed"],
                            device=lo["device"], **common)
    raise TeacherConfigError(f"teacher.backend: unknown backend {backend!r} (template | openai | local)")
