#!/bin/bash
# Qwen2.5-7B-Instruct GRPO on GSM8K, one node of 8 GPUs.
#   mkdir -p logs && sbatch slurm/grpo_7b.sh [a.b.c=value ...]
# The overrides go to the trainer config; MEGARL_SLURM_CONFIG=<yaml> replaces the recipe. See slurm/ray_cluster.sh
# for the environment knobs (device, GPUs per node, ports, timeouts) and how the cluster is started and stopped.
# Slurm does not create the --output directory, hence the mkdir.
#SBATCH --job-name=megarl-grpo-7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --signal=B:TERM@300

# sbatch runs a spooled copy of this file: find the checkout from the path it was submitted as (scontrol's
# Command, relative to WorkDir), else from this file's own path (run with bash directly).
if [[ -z "${MEGARL_ROOT:-}" ]]; then
    job_field() { scontrol show job -o "${SLURM_JOB_ID:-none}" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p"; }
    MEGARL_ROOT="$(cd "$(job_field WorkDir)" 2>/dev/null && cd "$(dirname "$(job_field Command)")/.." && pwd)"
    [[ -f "$MEGARL_ROOT/slurm/ray_cluster.sh" ]] || MEGARL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fi
[[ -f "$MEGARL_ROOT/slurm/ray_cluster.sh" ]] || { echo "megarl checkout not found: set MEGARL_ROOT" >&2; exit 2; }
export MEGARL_ROOT
source "$MEGARL_ROOT/slurm/ray_cluster.sh"
megarl_run_on_slurm "$MEGARL_ROOT/configs/qwen2_5_7b_gsm8k_grpo.yaml" "$@"
