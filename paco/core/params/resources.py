"""The ``resources`` params section: launcher and SLURM resources of the plain stages (a foreach
member's own are :class:`paco.core.params.grpo.SubtaskResources`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from paco.core.params.base import _Section


def check_nodes(nodes: int, gpus: int, accelerate_config: str) -> None:
    """``nodes`` > 1 spans several SLURM nodes, one launcher each (``paco.core.launch``): only for
    GPU stages, with an accelerate config for GPUs (``workflow/accelerate/cpu.yaml`` has
    ``use_cpu: true``: every node's processes would run on CPU beside their GPUs).

    Raises:
        ValueError: ``nodes`` > 1 with ``gpus`` 0, or with ``accelerate_config`` ``cpu``.
    """
    if nodes > 1 and gpus == 0:
        raise ValueError(f"nodes {nodes} with gpus 0: several nodes are for GPU stages (gpus per node > 0)")
    if nodes > 1 and accelerate_config == "cpu":
        raise ValueError(f"nodes {nodes} with accelerate_config cpu: its processes would run on CPU; several "
                         "nodes need a GPU config (ddp, zero2, fsdp)")


# --------------------------------------------------------------------------------------------
# resources
# --------------------------------------------------------------------------------------------


class StageResources(_Section):
    """Per-stage resources for launchers and SLURM (Snakemake ``resources:``)."""

    processes: int = Field(1, ge=1, description="accelerate processes per node (one per GPU on GPUs)")
    gpus: int = Field(0, ge=0, description="GPUs per node")
    nodes: int = Field(1, ge=1, description="SLURM nodes; > 1: paco.core.launch starts one launcher per node")
    cpus_per_task: int = Field(1, ge=1, description="CPU threads of the task; on GPUs per GPU (the job's task "
                               "on each node gets cpus_per_task * gpus)")
    mem_mb: int = Field(4000, ge=100)
    runtime: int = Field(30, ge=1, description="minutes")
    accelerate_config: str = Field(
        "cpu", description="workflow/accelerate/<name>.yaml for `accelerate launch` (cpu, ddp, zero2, fsdp)"
    )

    @model_validator(mode="after")
    def _nodes_need_gpus(self) -> StageResources:
        check_nodes(self.nodes, self.gpus, self.accelerate_config)
        return self


class ResourcesParams(_Section):
    default: StageResources = Field(default_factory=StageResources)
    stages: dict[str, StageResources] = Field(default_factory=dict)

    def for_stage(self, name: str) -> StageResources:
        return self.stages.get(name, self.default)
