#!/bin/bash
# TLT GRPO on a SLURM GPU cluster, from the repository root, after `make setup-gpu` on a node (the .venv must be
# on a filesystem every node reads, as must MODEL, DATA and WORKDIR):
#
#   MODEL=/models/Qwen2.5-7B DATA=/data/dapo_math_17k.parquet sbatch configs/cluster/slurm_grpo.sh \
#       --config.rl.clip_high=0.28 --config.num_steps=200          # any tlt_jax.main flag, forwarded as given
#   DRY_RUN=1 MODEL=... DATA=... bash configs/cluster/slurm_grpo.sh ...   # print the srun line and the mesh
#
# Arguments after the script name are passed to `python -m tlt_jax.main` after the script's own (a later
# --config.x=v wins), so the recipe's settings need no edited script or config file. Two nodes:
# `sbatch --nodes=2 configs/cluster/slurm_grpo.sh ...` (sbatch's own options go before the script name).
#
# What each variable is (export before sbatch: sbatch passes the environment to the job):
#   CONFIG   the config file and its argument (configs/qwen2_5_7b.py: the paper's 7B GRPO, TP 4 x DP rest;
#            dataset=parquet reads VeRL-layout parquet files scored by each row's data_source, as VeRL)
#   MODEL    the HF model directory (config.json, *.safetensors, tokenizer files), e.g. Qwen2.5-7B; set but
#            empty (MODEL=): the config's own model (a config with a random model, e.g. configs/smoke.py)
#   DATA     the training parquet file(s): a path, a glob or a comma list; DATA=: the config's own task
#   WORKDIR  where checkpoints, metrics.jsonl and config.json go (default workdirs/<job name>). It does not
#            depend on the job id: a requeued job and a resubmitted one (same --job-name) resume the run
#            from its newest checkpoint. Name each run: `sbatch --job-name=dapo-7b-a ...`; a workdir whose
#            config.json differs from the new command is refused (tlt_jax.main says which keys differ).
#   LAYOUT   node (one process per node with all its GPUs, the default) or gpu (one process per GPU:
#            TLT_JAX_LOCAL_DEVICE_IDS=localid gives each task the GPU numbered SLURM_LOCALID). The
#            allocation below fits both: per node 8 tasks x 8 CPUs are reserved; LAYOUT=node runs 1 task
#            with all the node's CPUs, LAYOUT=gpu 8 tasks with 8 CPUs each (srun's --cpus-per-task is
#            computed from what SLURM allocated: SLURM_CPUS_ON_NODE / tasks per node).
#   DRY_RUN  1: print the srun line and the mesh it would build (the run's own config validation and
#            mesh code, on nodes x GPUs fake CPU devices: `python -m tlt_jax.main --dry_run`), start nothing;
#            outside an allocation the sizes are NODES, GPUS_PER_NODE, CPUS_PER_NODE (default 1, 8, 64)
#   PYTHON   the interpreter (default .venv/bin/python)
# SLURM sets SLURM_PROCID / SLURM_NTASKS / SLURM_STEP_NODELIST in every task: tlt_jax.utils.distributed reads
# them (process id, process count, coordinator = the step's first node, port from SLURM_JOB_ID); set
# TLT_JAX_COORDINATOR_PORT if that port is taken.
#
# The log: --output is opened by SLURM on the first node BEFORE this script runs, so its folder must exist
# at submission; slurm-<job name>-<job id>.out in the submission directory always does. --open-mode=append:
# a requeued job (same job id) appends to its log instead of truncating it.
#
# Preemption and the time limit. --requeue lets SLURM requeue the job when it is preempted or its node fails.
# --signal=B:TERM@300 sends SIGTERM to this batch shell (B: only the shell, not the tasks) 300 s before the
# time limit (SLURM's event resolution can make it up to 60 s earlier). The shell runs srun in the
# background and passes the TERM to the tasks with `scancel --signal=TERM <job id>` (every step's tasks on
# every node, not this shell): a TERM to srun itself would make srun kill the step at once. The learner then
# stops every process at the same point (the next rollout chunk, update part or phase boundary), saves what
# it can (tlt_jax.rl.stopping) and exits within config.stop_within seconds (default 150; past it a process
# exits by itself) with status 75. The shell decides from the tasks' status (srun's: the highest of them)
# and the job's state (`scontrol show job`):
#   0   the run finished: the job ends.
#   75  stopped on a TERM with its checkpoint saved: if the job still runs (the time limit's early TERM, or a
#       preemption that signals the tasks: `scancel --signal=TERM <job id>`), the shell requeues it
#       (`scontrol requeue`) and it resumes in WORKDIR when it starts again; if SLURM is requeueing it
#       already (a preemption with PreemptMode=REQUEUE, `scontrol requeue`: its restart count went up) it is
#       left to SLURM; if SLURM is ending it otherwise (a user's `scancel`, the time limit itself) it is not
#       requeued (resubmit with the same --job-name to resume).
#   70  the watchdog ended a stalled process: not requeued (it would stall again); the log says where.
#   other: a failure (a task killed by a signal is 128 + its number): not requeued; the last checkpoint in
#       WORKDIR is the resume point.
# srun runs with --kill-on-bad-exit=0: the processes of a stop exit 75 a moment apart, and =1 would kill the
# later ones while they finish (srun would then report 143 or 137 instead of 75). A task that dies (killed,
# or an error) leaves the others to notice: a failed collective, or JAX's heartbeat after
# TLT_JAX_HEARTBEAT_TIMEOUT seconds (default 100), or the watchdog; they then exit too and the job fails with
# the highest status (137 for a SIGKILL), its last committed checkpoint the resume point (tests/slurm).
# The lead must exceed stop_within (which must cover a chunk, an update part and the checkpoint write: a 7B
# run's parameters and AdamW state are ~93 GB (86.6 GiB) per node by the memory plan, written to the nodes'
# shared filesystem) with room for the exit: raise both for larger models or slower filesystems
# (`sbatch --signal=B:TERM@600 ... --config.stop_within=450`).
# At the time limit itself SLURM sends TERM to everything and KILL after KillWait (30 s by default): too late
# to save a 7B checkpoint.
#SBATCH --job-name=tlt-grpo
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:TERM@300
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail

CONFIG=${CONFIG:-configs/qwen2_5_7b.py:dataset=parquet}
MODEL=${MODEL?set MODEL to the HF model directory, e.g. MODEL=/models/Qwen2.5-7B (MODEL= for the config's own)}
DATA=${DATA?set DATA to the training parquet file(s), e.g. DATA=/data/dapo_math_17k.parquet (DATA= for the config's own)}
JOB_NAME=${SLURM_JOB_NAME:-tlt-grpo}
WORKDIR=${WORKDIR:-workdirs/${JOB_NAME}}
LAYOUT=${LAYOUT:-node}
PYTHON=${PYTHON:-.venv/bin/python}
# the allocation's sizes; outside one (DRY_RUN on a login node) NODES / GPUS_PER_NODE / CPUS_PER_NODE or 1 x 8 x 64
NODES=${SLURM_JOB_NUM_NODES:-${NODES:-1}}
GPUS=${SLURM_GPUS_ON_NODE:-${GPUS_PER_NODE:-8}}
CPUS=${SLURM_CPUS_ON_NODE:-${CPUS_PER_NODE:-64}}

case "$LAYOUT" in
  node) TASKS_PER_NODE=1 ;;
  gpu) TASKS_PER_NODE=$GPUS ;;
  *) echo "error: LAYOUT=$LAYOUT: use node (one process per node) or gpu (one process per GPU)" >&2; exit 2 ;;
esac
if (( CPUS < TASKS_PER_NODE )); then
  echo "error: $CPUS CPUs per node for $TASKS_PER_NODE tasks per node: ask for more (sbatch --cpus-per-task)" >&2
  exit 2
fi
CPUS_PER_TASK=$(( CPUS / TASKS_PER_NODE ))
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}  # leave the CUDA context room
export WANDB_MODE=${WANDB_MODE:-offline}  # `wandb sync` the run afterwards; online needs WANDB_API_KEY
if [ "$LAYOUT" = gpu ]; then
  export TLT_JAX_LOCAL_DEVICE_IDS=localid
fi

MAIN=("$PYTHON" -m tlt_jax.main --config "$CONFIG" --config.multiprocess=True)
if [ -n "$MODEL" ]; then MAIN+=(--config.model.path="$MODEL"); fi
if [ -n "$DATA" ]; then MAIN+=(--config.task.path="$DATA"); fi
MAIN+=(--workdir "$WORKDIR" "$@")
# --ntasks explicitly: srun inherits the batch job's SLURM_NTASKS (8 per node here) and, before SLURM 23.11,
# keeps it over --ntasks-per-node, asking for 8 tasks x all the CPUs ("More processors requested than
# permitted"). --kill-on-bad-exit=0: see "Preemption and the time limit" above.
SRUN=(srun --nodes="$NODES" --ntasks="$(( NODES * TASKS_PER_NODE ))" --ntasks-per-node="$TASKS_PER_NODE"
  --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=0)

if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "srun line ($LAYOUT layout, $NODES node(s) x $GPUS GPUs, $CPUS CPUs per node):"
  printf '%q ' "${SRUN[@]}" "${MAIN[@]}"
  echo
  # the run's own validation and mesh on nodes x GPUs fake CPU devices; nothing is written
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$(( NODES * GPUS ))" \
    "${MAIN[@]}" --dry_run
  exit 0
fi

# tlt_jax.main's exit statuses (tlt_jax/utils/watchdog.py)
EXIT_STOPPED=75
EXIT_STALLED=70
echo "job ${SLURM_JOB_ID:-?} (${JOB_NAME}, restart ${SLURM_RESTART_COUNT:-0}): $LAYOUT layout, $NODES node(s), workdir $WORKDIR"
TERMED=0
SRUN_PID=
# A TERM to this shell (the time limit's B:TERM, a preemption, a cancel) goes to the tasks of the job's steps,
# never to srun. It may come at any moment, also after srun has exited: nothing here may fail (set -e).
term_to_tasks() {
  TERMED=1
  if [ -n "$SRUN_PID" ]; then
    echo "SIGTERM (time limit, preemption or cancel): sending it to the tasks (scancel --signal=TERM ${SLURM_JOB_ID:-?})"
    scancel --signal=TERM "${SLURM_JOB_ID:-}" || echo "scancel --signal=TERM failed (exit $?)"
  fi
}
trap term_to_tasks TERM
rc=$EXIT_STOPPED
if [ "$TERMED" = 0 ]; then  # a TERM before the launch: nothing ran, nothing is lost
  "${SRUN[@]}" "${MAIN[@]}" &
  SRUN_PID=$!
  if [ "$TERMED" = 1 ]; then term_to_tasks; fi  # a TERM between the launch and the line above
  # `wait` returns early when a trapped signal arrives: wait again until srun itself has exited
  rc=0
  wait "$SRUN_PID" || rc=$?
  while kill -0 "$SRUN_PID" 2>/dev/null; do
    rc=0
    wait "$SRUN_PID" || rc=$?
  done
fi

job_field() {  # a field of `scontrol show job` (JobState, Restarts), empty if it cannot be read
  scontrol show job "${SLURM_JOB_ID:?}" 2>/dev/null | grep -oE "(^|[[:space:]])$1=[^[:space:]]+" | head -n 1 | cut -d= -f2 || true
}
case "$rc" in
  0) echo "the run finished (exit 0)" ;;
  "$EXIT_STOPPED")
    state=$(job_field JobState)
    restarts=$(job_field Restarts)
    if [ "$state" = RUNNING ]; then
      echo "the run stopped with its checkpoint saved (exit $rc): requeueing job ${SLURM_JOB_ID:-?} to resume in $WORKDIR"
      scontrol requeue "${SLURM_JOB_ID:?}" || echo "scontrol requeue failed (exit $?): resubmit with --job-name=$JOB_NAME to resume"
    elif [ "${restarts:-0}" -gt "${SLURM_RESTART_COUNT:-0}" ]; then
      echo "the run stopped (exit $rc); SLURM requeues job ${SLURM_JOB_ID:-?} itself (state $state, restart $restarts): it resumes in $WORKDIR"
    else
      echo "the run stopped (exit $rc) and SLURM is ending job ${SLURM_JOB_ID:-?} (state ${state:-unknown}: cancelled or at its time limit): not requeued; resubmit with --job-name=$JOB_NAME to resume from the last checkpoint in $WORKDIR"
    fi ;;
  "$EXIT_STALLED")
    echo "error: the watchdog ended a stalled process (exit $rc; its log above names the phase): not requeued, it would stall again; fix the cause, then resubmit with --job-name=$JOB_NAME to resume in $WORKDIR" ;;
  *)
    why="exit $rc"
    if [ "$rc" -gt 128 ]; then why="exit $rc: a task was killed by signal $(( rc - 128 ))"; fi
    echo "error: the run failed ($why): not requeued; the last checkpoint in $WORKDIR is the resume point (resubmit with --job-name=$JOB_NAME)" ;;
esac
exit "$rc"
