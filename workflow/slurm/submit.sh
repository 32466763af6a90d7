#!/usr/bin/env bash
# Submit one Snakemake job with sbatch (the `sbatch` profile's cluster-generic-submit-cmd).
#   submit.sh GPUS [sbatch options...] JOBSCRIPT
# Creates logs/slurm/ first (sbatch does not create --output's directory: a job whose log
# directory is missing dies at launch), asks for GPUS GPUs when GPUS > 0, and prints the job id
# (--parsable) for the status command. The job inherits the submitting shell's environment
# (sbatch's default --export=ALL): submit from the activated virtual environment.
set -euo pipefail
gpus="${1:?usage: submit.sh GPUS [sbatch options...] JOBSCRIPT}"
shift
case "$gpus" in
  ''|*[!0-9]*) echo "submit.sh: GPUS must be a non-negative integer, got '$gpus'" >&2; exit 2 ;;
esac
mkdir -p logs/slurm
extra=()
if [ "$gpus" -gt 0 ]; then
  extra+=("--gpus=$gpus")
fi
exec sbatch --parsable "${extra[@]}" "$@"
