# The PaCo pipeline for Snakemake: the same DAG and the identical commands as dvc.yaml, both
# generated from workflow/registry.py (one registry, two engines). Params come from params.yaml.
# A rule's inputs hold its code files themselves; DVC's stages depend on digests of them instead,
# written by a `code` stage of DVC's own (workflow/code_digests.py).
#
#   snakemake --cores 2                                   # local
#   snakemake --profile workflow/profiles/slurm           # SLURM (executor plugin)
#   snakemake --profile workflow/profiles/sbatch          # plain sbatch (cluster-generic)
#
# A foreach stage (grpo, final_samples) gives one rule per subtask: grpo_t2is is DVC's grpo@t2is.

import sys
from pathlib import Path

from workflow.registry import STAGES, job_resources, local_rules

configfile: "params.yaml"

# The environment reaches every job: the stage commands say `python` (accelerate runs as its
# module), resolved from the bin directory of the Python that runs Snakemake (a virtual
# environment need not be activated in the submitting shell, nor exist in the job's login
# environment; the path must be visible from the compute nodes, as a shared filesystem gives).
shell.prefix(f'export PATH="{Path(sys.executable).parent}:$PATH"; ')

MEMBERS = [m for s in STAGES for m in s.members(config)]

# The stages that download (`models`: hub snapshots) run on the host that runs Snakemake, also
# under a SLURM profile: a login node has internet, compute nodes may have none. Every other
# stage runs offline (HF_HUB_OFFLINE=1, stages/__init__.py) and is submitted. (The `localrules:`
# keyword takes literal names only; this is the call it compiles to.)
workflow.localrules(*local_rules(config))


def member_outputs(m):
    s = m.stage
    return [m.resolve(p, config) for p in list(s.active_out_dirs(config)) + list(s.outs) + list(s.metrics)
            + list(s.reports) + list(s.plot_outs)]


rule all:
    input:
        [out for m in MEMBERS for out in member_outputs(m)],


for _m in MEMBERS:
    _s = _m.stage
    _res = _m.resources(config)
    _job = job_resources(_res)

    rule:
        name:
            _m.rule_name
        input:
            _m.deps(config) + list(_s.code),
        output:
            [directory(_m.resolve(d, config)) for d in _s.active_out_dirs(config)]
            + [_m.resolve(p, config) for p in list(_s.outs) + list(_s.metrics) + list(_s.reports) + list(_s.plot_outs)],
        params:
            # the command, bound now: a `shell:` expression is evaluated when the job runs,
            # after this loop has moved on to the last stage
            cmd=_m.resolve(_s.cmd, config),
            # rerun trigger: a change of the stage's params sections reruns it, as in DVC
            sections=_m.params_sections(config),
        # the stage's output, also on the terminal (locally) and in the SLURM job log
        log:
            f"logs/{_m.rule_name}.log",
        # the task's CPUs (cpus_per_task per GPU on GPU stages), GPUs per node, and several nodes
        # (resources.nodes: one launcher per node, started by paco.core.launch with srun):
        # workflow/registry.py job_resources
        threads: _job["cpus_per_task"]
        resources:
            **_job,
        shell:
            "{params.cmd} 2>&1 | tee {log}"
