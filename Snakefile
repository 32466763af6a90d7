# The PaCo pipeline for Snakemake: the same DAG and the identical commands as dvc.yaml, both
# generated from workflow/registry.py (one registry, two engines). Params come from params.yaml.
#
#   snakemake --cores 2                                   # local
#   snakemake --profile workflow/profiles/slurm           # SLURM (executor plugin)
#   snakemake --profile workflow/profiles/sbatch          # plain sbatch (cluster-generic)

from workflow.registry import STAGES, interpolate

configfile: "params.yaml"

_resources = config.get("resources", {})


def stage_resources(name):
    """Per-stage resources from params.yaml `resources` (stage entry over `default`)."""
    res = dict(_resources.get("default", {}))
    res.update(_resources.get("stages", {}).get(name, {}))
    return res


rule all:
    input:
        [out for s in STAGES for out in list(s.out_dirs) + list(s.outs) + list(s.metrics)],


for _stage in STAGES:
    _res = stage_resources(_stage.name)
    _gpu = {"gpu": _res["gpus"], "cpus_per_gpu": _res.get("cpus_per_task", 1), "tasks_per_gpu": 0} if _res.get("gpus", 0) else {}

    rule:
        name:
            _stage.name
        input:
            [interpolate(d, config) for d in _stage.all_deps],
        output:
            [directory(d) for d in _stage.out_dirs] + list(_stage.outs) + list(_stage.metrics),
        params:
            # the command, bound now: a `shell:` expression is evaluated when the job runs,
            # after this loop has moved on to the last stage
            cmd=interpolate(_stage.cmd, config),
            # rerun trigger: a change of the stage's params sections reruns it, as in DVC
            sections={k: config.get(k) for k in _stage.params},
        threads: _res.get("cpus_per_task", 1)
        resources:
            mem_mb=_res.get("mem_mb", 4000),
            runtime=_res.get("runtime", 30),
            cpus_per_task=_res.get("cpus_per_task", 1),
            **_gpu,
        shell:
            "{params.cmd}"
