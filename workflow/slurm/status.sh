#!/usr/bin/env bash
# Status of one SLURM job for Snakemake's cluster-generic executor (cluster-generic-status-cmd):
#   status.sh JOBID   ->  prints running | success | failed
# Asks sacct (accounting), then scontrol (the controller remembers finished jobs for MinJobAge,
# 300 s by default), then squeue. A job that none of them knows is reported failed with the
# reason on stderr: a job killed by SLURM (time limit, memory, scancel, preemption) must end the
# workflow, never leave Snakemake waiting.
set -uo pipefail
jobid="${1:?usage: status.sh JOBID}"
jobid="${jobid%%;*}"  # --parsable may print "id;cluster"

classify() {  # a SLURM job state -> running | success | failed
  case "$1" in
    COMPLETED) echo success ;;
    PENDING|RUNNING|REQUEUED|REQUEUE_FED|REQUEUE_HOLD|RESIZING|CONFIGURING|COMPLETING|SUSPENDED|STAGE_OUT|SIGNALING|STOPPED|SPECIAL_EXIT|RESV_DEL_HOLD|REVOKED)
      echo running ;;
    "") return 1 ;;
    *) echo failed ;;  # FAILED TIMEOUT CANCELLED OUT_OF_MEMORY NODE_FAIL PREEMPTED BOOT_FAIL DEADLINE ...
  esac
}

state=""
if command -v sacct >/dev/null 2>&1; then
  # the allocation's own line (-X); "CANCELLED by 123" -> CANCELLED
  state="$(sacct -j "$jobid" -X -n -P -o State 2>/dev/null | head -n 1 | awk '{print $1}')"
fi
if [ -z "$state" ] && command -v scontrol >/dev/null 2>&1; then
  state="$(scontrol show job "$jobid" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p' | head -n 1)"
fi
if [ -z "$state" ] && command -v squeue >/dev/null 2>&1; then
  state="$(squeue -h -j "$jobid" -o %T 2>/dev/null | head -n 1)"
fi
if ! classify "$state"; then
  echo "status.sh: no SLURM record of job $jobid (sacct, scontrol and squeue know nothing): reported failed" >&2
  echo failed
fi
