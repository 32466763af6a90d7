"""Shared pytest fixtures: the tiny models of the embedded default, built once per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paco.core.numerics import require_fixed_numerics

# this process computes what stage processes compute (and compares bytes): the same CPU code
# paths and thread settings as theirs (idle OpenMP threads sleeping, as the 2 test workers share
# the cores), set before any test imports numpy, scipy or torch (and inherited by every
# subprocess a test starts)
require_fixed_numerics()

#: role -> tiny spec, as in params.yaml's embedded default (``models:``).
TINY_ROLES = {"judge_base": "tiny:qwen2_5_vl", "policy_t2is": "tiny:flux", "policy_kontext": "tiny:flux_kontext",
              "policy_qwen_edit": "tiny:qwen_image_edit", "clip": "tiny:clip"}
TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Build the tiny models (seed 0) once per session; role -> model directory.

    Keys: ``judge_base`` (Qwen2.5-VL + processor), ``policy_t2is`` (FLUX.1 pipeline),
    ``policy_kontext`` (FLUX.1 Kontext pipeline), ``policy_qwen_edit`` (Qwen-Image-Edit pipeline),
    ``clip`` (CLIP + processor). Treat the directories as read-only.
    """
    from paco.models.fetch import materialise

    root = tmp_path_factory.mktemp("tiny_models")
    return {
        role: materialise(role, spec, root / role, seed=TINY_SEED)
        for role, spec in TINY_ROLES.items()
    }


@pytest.fixture(scope="session")
def data_stages_clone(tmp_path_factory) -> Path:
    """A fresh clone of the committed tree with ``dvc repro reasons models`` run (tiny models,
    prompts, edits, composites, panels, ranking instances, pairs, SFT table): the reference the
    multi-process and SLURM tests compare with. Read-only for its users (write elsewhere)."""
    root = Path(__file__).resolve().parents[1]
    repo = tmp_path_factory.mktemp("data_stages") / "repo"
    subprocess.run(["git", "clone", "-q", str(root), str(repo)], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "reasons", "models"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo


@pytest.fixture()
def dead_url() -> str:
    """An OpenAI-style base URL on a localhost port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


#: test files that run longest, started first (in this order): with ``-n 2`` (the README's test
#: command; ``--dist loadfile --no-loadscope-reorder`` in pyproject.toml) one worker takes the
#: fresh-clone ``dvc repro`` of test_pipeline.py while the other runs the SLURM tests, the vLLM
#: tests (a fresh clone's judge half and grpo@kontext_editing served by vLLM) and then every
#: other file
FIRST = ("test_pipeline.py", "test_slurm.py", "test_vllm.py")


def pytest_collection_modifyitems(config, items):
    """Files of :data:`FIRST` first, each file's tests in their own order (module fixtures and
    the pipeline tests' order depend on it). ``gpu``-marked tests need CUDA (and, for vLLM, the
    ``[gpu]`` extra): skipped with the reason where there is none, so the CPU suite (CI) stays
    green; on a GPU machine they run."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable torch means no GPU
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine: python -m pytest -m gpu)")
        for item in gpu_items:
            item.add_marker(skip)
