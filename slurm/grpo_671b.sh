#!/bin/bash
# DeepSeek-V3 671B GRPO, 128 nodes x 8 GPUs (TP2 PP16 EP64 training; see configs/deepseek_v3_671b_grpo.yaml).
#   mkdir -p logs && sbatch slurm/grpo_671b.sh [a.b.c=value ...]
# The overrides go to the trainer config; MEGARL_SLURM_CONFIG=<yaml> replaces the recipe. See slurm/ray_cluster.sh
# for the environment knobs (device, GPUs per node, ports, timeouts) and how the cluster is started and stopped.
# Slurm does not create the --output directory, hence the mkdir.
#SBATCH --job-name=megarl-grpo-671b
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --signal=B:TERM@300

# sbatch runs a copy of this file from the spool dir: find the checkout from the submit dir.
MEGARL_ROOT="${MEGARL_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}"
export MEGARL_ROOT
source "$MEGARL_ROOT/slurm/ray_cluster.sh"
megarl_run_on_slurm "$MEGARL_ROOT/configs/deepseek_v3_671b_grpo.yaml" "$@"
