"""The accelerator helpers of the training stages (paco.core.distributed): the identity for one
process, and RNG states that restore every global stream."""

from __future__ import annotations

import random

import numpy as np
import torch

from paco.core.distributed import gather_objects, get_rng_state, set_rng_state, sum_gradients, wait_for_everyone


def test_one_process_helpers_are_the_identity():
    objs = [(0, {"r": 1.0})]
    assert gather_objects(None, objs) is objs
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
