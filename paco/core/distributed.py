"""The processes a stage runs as: rank, world size, ownership of work units, a barrier.

A stage with work to shard (``labels`` today; ``reward_train``, ``grpo`` and ``final_samples``
use their ``Accelerator``) is started by the registry's ``accelerate launch`` with the stage's
``resources.processes``. Each process takes the work units it owns (unit ``n`` belongs to rank
``n % world``: a fixed assignment, so the result of each unit does not depend on how many
processes there are), persists them, and the main process assembles the output in unit order
after a barrier. With one process (``python -m stages.<name>``, or ``--num_processes 1``) nothing
is initialised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


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

    def owns(self, unit: int) -> bool:
        """Whether work unit ``unit`` (0-based) is this process's: ``unit % world == rank``."""
        return unit % self.world == self.rank

    def barrier(self) -> None:
        """Wait until every process reaches this point (no-op for one process)."""
        if self.state is not None:
            self.state.wait_for_everyone()


def launched_processes() -> Processes:
    """The processes of this launch: from ``accelerate launch`` (``WORLD_SIZE`` > 1: the process
    group is initialised through ``accelerate.PartialState``, gloo on CPU, NCCL on GPUs), else one
    process.

    Raises:
        RuntimeError: the launcher's world size and the initialised process group disagree.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Processes()
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes != world:
        raise RuntimeError(f"WORLD_SIZE is {world} but the process group has {state.num_processes} processes")
    return Processes(rank=state.process_index, world=state.num_processes, state=state)
