"""The accelerator helpers of the training stages (paco.core.distributed): the identity for one
process, and RNG states that restore every global stream."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from paco.core.distributed import (Processes, broadcast_from_main, gather_objects, get_rng_state, set_rng_state, set_seed,
                                   sum_gradients, wait_for_everyone)

ROOT = Path(__file__).resolve().parents[1]


def test_one_process_helpers_are_the_identity():
    objs = [(0, {"r": 1.0})]
    assert gather_objects(None, objs) is objs
    assert broadcast_from_main(None, objs) is objs and broadcast_from_main(Processes().state, objs) is objs
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    sum_gradients(None, [p])
    wait_for_everyone(None)
    assert torch.equal(p.grad, torch.full((2,), 3.0))


def test_rng_state_restores_torch_numpy_and_python():
    state = get_rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_set_seed_seeds_torch_numpy_and_python():
    set_seed(7)
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    set_seed(7)
    assert torch.equal(first[0], torch.rand(3)) and np.array_equal(first[1], np.random.rand(3))
    assert first[2] == random.random()


def test_accelerates_collectives_are_called_through_these_helpers_only():
    """``accelerate.utils`` is imported by paco.core.distributed alone: the one-process shortcuts
    and the picklable boxes live in one place."""
    found = [f"{path.relative_to(ROOT)}:{n}" for top in ("paco", "stages", "workflow")
             for path in sorted((ROOT / top).rglob("*.py")) if path != ROOT / "paco/core/distributed.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if "accelerate.utils" in line]
    assert found == []


def test_torch_threads_per_process_follow_the_env_else_the_cores_over_the_processes(monkeypatch):
    import torch

    from paco.core.numerics import cpu_threads_per_process, set_torch_cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("PACO_NUM_THREADS", "3")
        assert cpu_threads_per_process(8) == 3
        assert set_torch_cpu_threads(8) == 3 and torch.get_num_threads() == 3
        monkeypatch.delenv("PACO_NUM_THREADS")
        cores = len(os.sched_getaffinity(0))
        assert cpu_threads_per_process(1) == cores
        assert cpu_threads_per_process(cores + 1) == 1  # at least one thread
        assert cpu_threads_per_process(2) == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)
