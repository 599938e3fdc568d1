#!/bin/bash
# Llama-3.1-70B GRPO, 4 nodes x 8 GPUs (TP8 PP4 training, TP8 rollout, colocated).
#   mkdir -p logs && sbatch slurm/grpo_70b.sh [a.b.c=value ...]
# The overrides go to the trainer config; MEGARL_SLURM_CONFIG=<yaml> replaces the recipe. See slurm/ray_cluster.sh
# for the environment knobs (device, GPUs per node, ports, timeouts) and how the cluster is started and stopped.
# Slurm does not create the --output directory, hence the mkdir.
#SBATCH --job-name=megarl-grpo-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --signal=B:TERM@300

# sbatch runs a copy of this file from the spool dir: find the checkout from the submit dir.
MEGARL_ROOT="${MEGARL_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}"
export MEGARL_ROOT
source "$MEGARL_ROOT/slurm/ray_cluster.sh"
megarl_run_on_slurm "$MEGARL_ROOT/configs/llama3_1_70b_grpo.yaml" "$@"
