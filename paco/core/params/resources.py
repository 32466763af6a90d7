"""The ``resources`` params section: launcher and SLURM resources of the plain stages (a foreach
member's own are :class:`paco.core.params.grpo.SubtaskResources`)."""

from __future__ import annotations

from pydantic import Field

from paco.core.params.base import _Section


# --------------------------------------------------------------------------------------------
# resources
# --------------------------------------------------------------------------------------------


class StageResources(_Section):
    """Per-stage resources for launchers and SLURM (Snakemake ``resources:``)."""

    processes: int = Field(1, ge=1, description="accelerate processes (one per GPU on GPUs)")
    gpus: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1, description="CPU threads per task (cpus_per_gpu on GPUs)")
    mem_mb: int = Field(4000, ge=100)
    runtime: int = Field(30, ge=1, description="minutes")
    accelerate_config: str = Field(
        "cpu", description="workflow/accelerate/<name>.yaml for `accelerate launch` (cpu, ddp, zero2, fsdp)"
    )


class ResourcesParams(_Section):
    default: StageResources = Field(default_factory=StageResources)
    stages: dict[str, StageResources] = Field(default_factory=dict)

    def for_stage(self, name: str) -> StageResources:
        return self.stages.get(name, self.default)
