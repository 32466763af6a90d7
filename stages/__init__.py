"""Thin stage CLIs: ``python -m stages.<name> --params params.yaml ...``.

Importing the package, the first thing ``python -m stages.<name>`` does (in the stage's own
process, under :mod:`paco.core.launch` in place, and in every process ``accelerate launch``
starts), before any stage imports numpy, scipy, torch or huggingface_hub:

* fixes the OpenMP / MKL team sizes and the CPU code paths of the stage process
  (:func:`paco.core.numerics.require_fixed_numerics`): a cached stage's bytes must depend neither
  on the machine's load nor on its CPU model;
* turns the Hugging Face hub off (:func:`hub_offline_by_default`): only ``models`` downloads
  (``workflow.stage.Stage.downloads``), every later stage reads the directories it wrote, so a
  compute node without internet runs them, and one that has internet never reaches the hub
  behind the pipeline's back. ``stages.models`` undoes exactly what this set
  (:data:`OFFLINE_SET_HERE`); ``report.json``'s ``run.hub_offline`` records the mode a stage ran in.
"""

import os

from paco.core.numerics import require_fixed_numerics

#: The variables that put huggingface_hub (and transformers < 5, which reads the second) in
#: offline mode; huggingface_hub reads them once, when it is imported.
HUB_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

#: The variables :func:`hub_offline_by_default` set in this process (empty: the caller had set one).
OFFLINE_SET_HERE: tuple[str, ...] = ()


def hub_offline_by_default(env: "os._Environ[str] | dict[str, str]" = os.environ) -> tuple[str, ...]:
    """Set ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` in ``env`` unless the caller set
    either (its value, ``0`` included, is the caller's choice and is kept; huggingface_hub reads
    ``HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE``, ``huggingface_hub/constants.py``).

    Returns:
        The names set (both, or none).
    """
    if any(name in env for name in HUB_OFFLINE_ENV):
        return ()
    for name in HUB_OFFLINE_ENV:
        env[name] = "1"
    return HUB_OFFLINE_ENV


def undo_hub_offline(env: "os._Environ[str] | dict[str, str]" = os.environ) -> tuple[str, ...]:
    """Remove from ``env`` what :func:`hub_offline_by_default` set in this process (the downloading
    stage, ``stages.models``, calls it before huggingface_hub is imported); a caller's own
    ``HF_HUB_OFFLINE=1`` stays, so ``models`` then reads the local HF cache only.

    Returns:
        The names removed.
    """
    global OFFLINE_SET_HERE
    removed, OFFLINE_SET_HERE = OFFLINE_SET_HERE, ()
    for name in removed:
        env.pop(name, None)
    return removed


OFFLINE_SET_HERE = hub_offline_by_default()
require_fixed_numerics()
