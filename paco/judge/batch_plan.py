"""The deterministic batch plan of judge training and its distribution over processes.

The order of epoch ``e`` is ``torch.randperm(n, generator=seed + e)`` over the training rows
sorted by ``pair_id``. It is cut into *global micro-batches* of ``batch_size * processes``
rows; process ``p`` takes rows ``[p * batch_size, (p + 1) * batch_size)`` of each, so the
union of the per-process batches is exactly the single-process batch at the same global batch.
An optimizer step is ``gradient_accumulation_steps`` micro-batches; an epoch is
``floor(n / global_step_rows)`` steps and the remainder (fewer than ``batch_size * processes *
gradient_accumulation_steps`` rows, a different subset each epoch) is dropped, so every step
has the same shape.

Loss scaling makes the gradient independent of how a global micro-batch is split:

* ``paper``: each process backpropagates the mean over its rows; DDP averages over processes
  and ``accelerator.backward`` divides by the accumulation steps, so a step's gradient is that
  of the mean loss over all its rows.
* ``reference``: the released trainer divides the micro-batch's weighted token losses by its
  response-token count; here the count is that of the *global* micro-batch (an all-reduce), so
  1 process with batch 8 and 2 processes with batch 4 give the same gradient (at 1 process this
  is exactly the released behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def epoch_plan(n: int, *, seed: int, epoch: int, batch_size: int, num_processes: int,
               grad_accum: int) -> list[list[list[int]]]:
    """The optimizer steps of one epoch: ``steps[s][m]`` is the ``m``-th global micro-batch of
    step ``s``, a list of ``batch_size * num_processes`` row indices; process ``p`` uses
    ``shard(micro_batch, p, batch_size)``. Depends on ``batch_size * num_processes`` only
    through the global batch, and on nothing else but ``(n, seed, epoch, grad_accum)``."""
    g = torch.Generator().manual_seed(int(seed) + int(epoch))
    order = torch.randperm(n, generator=g).tolist()
    mb = batch_size * num_processes
    n_steps = n // (mb * grad_accum)
    return [[order[(s * grad_accum + m) * mb:(s * grad_accum + m + 1) * mb] for m in range(grad_accum)]
            for s in range(n_steps)]


def shard(micro_batch: Sequence[int], process_index: int, batch_size: int) -> list[int]:
    """Process ``process_index``'s part of a global micro-batch."""
    return list(micro_batch[process_index * batch_size:(process_index + 1) * batch_size])


def distributed_loss_scale(variant: str, n_local: float, n_global: float, num_processes: int) -> float:
    """Factor on a process's micro-batch loss so that the mean over processes (what DDP's
    gradient averaging computes) equals the loss of the whole global micro-batch.

    ``paper`` (mean over rows, equal rows per process): 1. ``reference`` (weighted token losses
    over the response-token count ``n``): ``n_local * num_processes / n_global``.
    """
    if variant == "reference":
        return float(n_local) * num_processes / float(n_global)
    return 1.0
