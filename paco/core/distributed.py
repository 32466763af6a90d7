"""The processes a stage runs as: rank, world size, ownership of work units, a barrier.

A stage with work to shard (``reasons``, ``reward_eval``; ``reward_train``, ``grpo`` and
``final_samples`` use their ``Accelerator``) is started by the registry's ``accelerate launch`` with the stage's
``resources.processes``. Each process takes the work units it owns (unit ``n`` belongs to rank
``n % world``: a fixed assignment, so the result of each unit does not depend on how many
processes there are), persists them, and the main process assembles the output in unit order
after a barrier. With one process (``python -m stages.<name>``, or ``--num_processes 1``) nothing
is initialised.

The training stages' helpers take an ``accelerate.Accelerator`` (or ``None``: one process) and
are the identity for one process: :func:`make_accelerator`, :func:`gather_objects`,
:func:`broadcast_from_main`, :func:`wait_for_everyone`, :func:`sum_gradients`, the seeding of
every generator (:func:`set_seed`), and this process's RNG states (:func:`get_rng_state`,
:func:`set_rng_state`) for resumable checkpoints. Every call of ``accelerate``'s collectives goes
through these helpers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Processes:
    """This process's place among the stage's processes.

    Attributes:
        rank: 0 .. world - 1 (0 is the main process, the one that writes outputs).
        world: number of processes (>= 1).
        state: the ``accelerate.PartialState`` when world > 1, else ``None``.
    """

    rank: int = 0
    world: int = 1
    state: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        """This process's torch device: its own GPU under a multi-process launch on GPUs
        (``PartialState.device``), else ``cuda`` when one is visible, else ``cpu``."""
        if self.state is not None:
            return str(self.state.device)
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def owns(self, unit: int) -> bool:
        """Whether work unit ``unit`` (0-based) is this process's: ``unit % world == rank``."""
        return unit % self.world == self.rank

    def barrier(self) -> None:
        """Wait until every process reaches this point (no-op for one process)."""
        if self.state is not None:
            self.state.wait_for_everyone()


def _set_cpu_threads(local_processes: int) -> None:
    """Torch threads on CPU: :func:`paco.core.numerics.cpu_threads_per_process` (``$PACO_NUM_THREADS``,
    else the cores over the node's processes), as the training stages do. CPU kernels may round
    differently with another thread count (CLIP image features by 2e-7 seen), so byte-identical
    results across process counts need the same threads per process: ``PACO_NUM_THREADS``."""
    if local_processes <= 1 and "PACO_NUM_THREADS" not in os.environ:
        return  # torch's own default: every core
    import torch

    from paco.core.numerics import set_torch_cpu_threads

    if not torch.cuda.is_available():
        set_torch_cpu_threads(local_processes)


def launched_processes() -> Processes:
    """The processes of this launch: from ``accelerate launch`` (``WORLD_SIZE`` > 1: the process
    group is initialised through ``accelerate.PartialState``, gloo on CPU, NCCL on GPUs), else one
    process.

    Raises:
        RuntimeError: the launcher's world size and the initialised process group disagree.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if world <= 1:
        return Processes()
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes != world:
        raise RuntimeError(f"WORLD_SIZE is {world} but the process group has {state.num_processes} processes")
    return Processes(rank=state.process_index, world=state.num_processes, state=state)


def shard_batches(fn: Callable[[Sequence[T]], list[R]], procs: Processes, batch_size: int) -> Callable[[Sequence[T]], list[R]]:
    """``fn`` (items -> one result per item, computed in batches of ``batch_size``) made to
    compute only this process's batches of each call and return every result, in order, on every
    process.

    A call's items are cut into batches of ``batch_size`` (the last may be shorter); batch ``n``
    belongs to rank ``n % world``, which runs ``fn`` on its batches concatenated: since ``fn``
    cuts them at the same boundaries, every batch is the one a single process would run, so the
    results are bit-identical for any process count (a batched forward's floats may depend on
    what shares the batch). Results are exchanged with ``accelerate.utils.gather_object``. Every
    process must make the same calls with the same item counts (collective). One process:
    ``fn`` itself.

    Raises:
        RuntimeError: ``fn`` returned another number of results than items, or the gathered
            batches do not cover the call exactly once.
    """
    if procs.world == 1:
        return fn
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    def sharded(items: Sequence[T]) -> list[R]:
        from accelerate.utils import gather_object

        starts = list(range(0, len(items), batch_size))
        mine = [n for n in range(len(starts)) if procs.owns(n)]
        flat = [x for n in mine for x in items[starts[n]:starts[n] + batch_size]]
        results = list(fn(flat)) if flat else []
        if len(results) != len(flat):
            raise RuntimeError(f"{len(results)} results for {len(flat)} items")
        pieces, k = [], 0
        for n in mine:
            size = len(items[starts[n]:starts[n] + batch_size])
            pieces.append((n, results[k:k + size]))
            k += size
        by_batch = dict(gather_object(pieces))
        if sorted(by_batch) != list(range(len(starts))):
            raise RuntimeError(f"gathered batches {sorted(by_batch)[:5]}... do not cover the {len(starts)} batches")
        return [r for n in range(len(starts)) for r in by_batch[n]]

    return sharded


# --------------------------------------------------------------------------------------------
# accelerator helpers of the training stages (identity for one process)
# --------------------------------------------------------------------------------------------


def make_accelerator(*, mixed_precision: str | None = None, gradient_accumulation_steps: int = 1) -> Any:
    """The ``accelerate.Accelerator`` of a training stage: on the CPU (gloo between several
    processes) when no CUDA device is visible, else this process's GPU.

    Args:
        mixed_precision: ``no``, ``bf16``, ...; ``None`` (``Accelerator``'s default): the launch's
            (``accelerate launch`` config, ``ACCELERATE_MIXED_PRECISION``), else ``no``.
        gradient_accumulation_steps: micro-batches per optimizer step (``Accelerator.accumulate``).
    """
    import torch
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision,
                       gradient_accumulation_steps=gradient_accumulation_steps)


def gather_objects(accelerator: Any, objs: list) -> list:
    """Every process's ``objs`` (a list of picklable objects) concatenated in rank order, on every
    process (``accelerate.utils.gather_object``); ``objs`` itself for one process."""
    if accelerator is None or accelerator.num_processes == 1:
        return objs
    from accelerate.utils import gather_object

    return gather_object(objs)


def broadcast_from_main(accelerator: Any, obj: Any) -> Any:
    """``obj`` of the main process, on every process (``accelerate.utils.broadcast_object_list``;
    ``obj`` must be picklable). ``accelerator``: an ``accelerate.Accelerator`` or ``PartialState``
    (:attr:`Processes.state`); with ``None`` or one process, ``obj`` itself. Collective: every
    process must call it."""
    if accelerator is None or accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch's (CPU and every CUDA device)
    with ``seed`` (``accelerate.utils.set_seed``, without its per-process offset), the same on
    every process."""
    from accelerate.utils import set_seed as accelerate_set_seed

    accelerate_set_seed(seed)


def wait_for_everyone(accelerator: Any) -> None:
    """A barrier over the accelerator's processes (no-op without an accelerator)."""
    if accelerator is not None:
        accelerator.wait_for_everyone()


def sum_gradients(accelerator: Any, params: Sequence[Any]) -> None:
    """Replace each parameter's ``.grad`` by its sum over processes (``torch.distributed.all_reduce``,
    ``SUM``; a missing gradient counts as zeros); nothing for one process."""
    if accelerator is None or accelerator.num_processes == 1:
        return
    import torch
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def get_rng_state() -> dict[str, Any]:
    """This process's global RNG states: ``{"torch": CPU generator state, "numpy": legacy
    ``np.random`` state, "python": ``random`` state}`` (for :func:`set_rng_state`)."""
    import random

    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the global RNG states saved by :func:`get_rng_state`."""
    import random

    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
