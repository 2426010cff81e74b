#!/bin/bash
# TLT GRPO on a SLURM GPU cluster: `sbatch configs/cluster/slurm_grpo.sh` from the repository root, after
# `make setup-gpu` on a node (the .venv must be on a filesystem every node reads, as must MODEL, DATA and
# WORKDIR). One process per node with all its GPUs (the default); for one process per GPU see LAYOUT below.
#
# What each variable is (edit or export before sbatch):
#   CONFIG   the config file and its argument (configs/qwen2_5_7b.py: the paper's 7B GRPO, TP 4 x DP rest;
#            dataset=parquet reads VeRL-layout parquet files scored by math-verify)
#   MODEL    the HF model directory (config.json, *.safetensors, tokenizer files), e.g. Qwen2.5-7B
#   DATA     the training parquet file(s): a path, a glob or a comma list
#   WORKDIR  where checkpoints, metrics.jsonl and config.json go; rerunning the job resumes it
#   LAYOUT   node (one process per node, all its GPUs) or gpu (one process per GPU)
# SLURM sets SLURM_PROCID / SLURM_NTASKS / SLURM_STEP_NODELIST in every task: tlt_jax.utils.distributed reads
# them (process id, process count, coordinator = the step's first node, port from SLURM_JOB_ID); set
# TLT_JAX_COORDINATOR_PORT if that port is taken. TLT_JAX_LOCAL_DEVICE_IDS=localid gives each task the one GPU
# numbered SLURM_LOCALID (LAYOUT=gpu; not needed when SLURM already gives each task one GPU).
#SBATCH --job-name=tlt-grpo
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

CONFIG=${CONFIG:-configs/qwen2_5_7b.py:dataset=parquet}
MODEL=${MODEL:?set MODEL to the HF model directory, e.g. MODEL=/models/Qwen2.5-7B}
DATA=${DATA:?set DATA to the training parquet file(s), e.g. DATA=/data/dapo_math_17k.parquet}
WORKDIR=${WORKDIR:-workdirs/grpo_${SLURM_JOB_ID:-local}}
LAYOUT=${LAYOUT:-node}

export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}  # leave the CUDA context room
export WANDB_MODE=${WANDB_MODE:-offline}  # `wandb sync` the run afterwards; online needs WANDB_API_KEY
if [ "$LAYOUT" = gpu ]; then
  TASKS=(--ntasks-per-node="${SLURM_GPUS_ON_NODE:-8}")
  export TLT_JAX_LOCAL_DEVICE_IDS=localid
else
  TASKS=(--ntasks-per-node=1)
fi
mkdir -p logs
srun "${TASKS[@]}" .venv/bin/python -m tlt_jax.main --config "$CONFIG" \
  --config.multiprocess=True --config.model.path="$MODEL" --config.task.path="$DATA" --workdir "$WORKDIR"
