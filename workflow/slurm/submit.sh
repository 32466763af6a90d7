#!/usr/bin/env bash
# Submit one Snakemake job with sbatch (the `sbatch` profile's cluster-generic-submit-cmd).
#   submit.sh GPUS NODES [sbatch options...] JOBSCRIPT
# Creates logs/slurm/ first (sbatch does not create --output's directory: a job whose log
# directory is missing dies at launch), asks for GPUS GPUs per node when GPUS > 0 (one node:
# --gpus=GPUS; NODES > 1: --nodes=NODES --ntasks-per-node=1 --gres=gpu:GPUS, and the stage's
# launcher, paco.core.launch, starts itself on every node with srun), and prints the job id
# (--parsable) for the status command. The job inherits the submitting shell's environment
# (sbatch's default --export=ALL): submit from the activated virtual environment.
set -euo pipefail
usage="usage: submit.sh GPUS NODES [sbatch options...] JOBSCRIPT"
gpus="${1:?$usage}"
nodes="${2:?$usage}"
shift 2
case "$gpus" in
  ''|*[!0-9]*) echo "submit.sh: GPUS must be a non-negative integer, got '$gpus'" >&2; exit 2 ;;
esac
case "$nodes" in
  ''|*[!0-9]*|0) echo "submit.sh: NODES must be a positive integer, got '$nodes'" >&2; exit 2 ;;
esac
if [ "$nodes" -gt 1 ] && [ "$gpus" -eq 0 ]; then
  echo "submit.sh: NODES $nodes needs GPUS > 0 (several nodes are for GPU stages)" >&2; exit 2
fi
mkdir -p logs/slurm
extra=()
if [ "$nodes" -gt 1 ]; then
  extra+=("--nodes=$nodes" "--ntasks-per-node=1" "--gres=gpu:$gpus")
elif [ "$gpus" -gt 0 ]; then
  extra+=("--gpus=$gpus")
fi
exec sbatch --parsable "${extra[@]}" "$@"
