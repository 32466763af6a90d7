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
exitcode=""
if command -v sacct >/dev/null 2>&1; then
  # the allocation's own line (-X): "CANCELLED by 123|0:0" -> CANCELLED, 0:0
  line="$(sacct -j "$jobid" -X -n -P -o State,ExitCode 2>/dev/null | head -n 1)"
  state="$(awk -F'|' '{print $1}' <<<"$line" | awk '{print $1}')"
  case "$line" in *"|"*) exitcode="${line#*|}" ;; esac
fi
record=""
if command -v scontrol >/dev/null 2>&1; then
  record="$(scontrol show job "$jobid" 2>/dev/null | tr ' ' '\n')"
fi
if [ -z "$state" ]; then
  state="$(sed -n 's/^JobState=//p' <<<"$record" | head -n 1)"
fi
if [ -z "$state" ] && command -v squeue >/dev/null 2>&1; then
  state="$(squeue -h -j "$jobid" -o %T 2>/dev/null | head -n 1)"
fi
if ! verdict="$(classify "$state")"; then
  echo "status.sh: no SLURM record of job $jobid (sacct, scontrol and squeue know nothing): reported failed" >&2
  echo failed
  exit 0
fi
if [ "$verdict" = failed ]; then
  # the reason and the job's own log on Snakemake's terminal (its error names only the rule's log)
  [ -n "$exitcode" ] || exitcode="$(sed -n 's/^ExitCode=//p' <<<"$record" | head -n 1)"
  stdout="$(sed -n 's/^StdOut=//p' <<<"$record" | head -n 1)"
  echo "status.sh: SLURM job $jobid ended $state (exit code ${exitcode:-unknown}); job log: ${stdout:-see sbatch --output}" >&2
fi
echo "$verdict"
