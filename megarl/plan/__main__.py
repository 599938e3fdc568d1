"""``python -m megarl.plan``: print the memory/layout plan of a run and exit 1 when it does not fit.

Two ways in:
  python -m megarl.plan --config configs/qwen2_5_7b_gsm8k_grpo.yaml [a.b.c=value ...] [--gpu-memory-gib 141]
      reads the run config (actor_rollout_ref.model.path must be a directory with config.json);
  python -m megarl.plan --hf-config megarl/models/reference_configs/deepseek_v3/config.json \\
      --world-size 1024 --tp 2 --pp 16 --ep 64 --etp 1 --first-stage-layers 3 --last-stage-layers 2 ...
      plans straight from an HF config with layout flags.
Layout flags given together with --config override the config's values.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from megarl.plan.from_config import read_hf_config, specs_from_run_config
from megarl.plan.layout import LayoutSpec, TrainingSpec
from megarl.plan.memory import plan_layout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megarl.plan", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="run config YAML (megarl.config schema)")
    source.add_argument("--hf-config", help="HF config.json, or a model directory holding one")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides of --config")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--framework-overhead-gib", type=float, default=3.0)
    parser.add_argument("--host-memory-gib", type=float, help="check the host memory of one node too")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs sharing one host (default: trainer.n_gpus_per_node, "
                                                         "else 8)")
    layout = parser.add_argument_group("layout (overrides --config)")
    for flag, field_type in (
        ("world-size", int), ("tp", int), ("pp", int), ("vpp", int), ("cp", int), ("ep", int), ("etp", int),
        ("first-stage-layers", int), ("last-stage-layers", int), ("rollout-tp", int), ("rollout-gpus", int),
    ):
        layout.add_argument(f"--{flag}", type=field_type)
    layout.add_argument("--recompute", choices=("none", "selective", "full"))
    layout.add_argument("--recompute-method", choices=("uniform", "block"),
                        help="full recompute's grouping (megatron's recompute_method)")
    layout.add_argument("--recompute-num-layers", type=int, help="layers per uniform group / recomputed per block")
    layout.add_argument("--placement", choices=("colocated", "separate"))
    layout.add_argument("--no-sequence-parallel", action="store_true")
    layout.add_argument("--no-distributed-optimizer", action="store_true")
    layout.add_argument("--optimizer-cpu-offload", action="store_true")
    layout.add_argument("--optimizer-offload-fraction", type=float)
    layout.add_argument("--train-mtp", action="store_true")
    training = parser.add_argument_group("training shape (overrides --config)")
    for flag, field_type in (
        ("global-batch-size", int), ("micro-batch-size", int), ("max-seq-len", int),
        ("rollout-max-num-seqs", int), ("rollout-gpu-memory-utilization", float), ("rollout-weight-bytes", int),
    ):
        training.add_argument(f"--{flag}", type=field_type)
    training.add_argument("--critic", action="store_true")
    training.add_argument("--no-reference", action="store_true")
    return parser


# layout flags that set the model's ParallelLayout, and the field each sets
_PARALLEL_FLAGS = {
    "tp": "tensor_parallel", "pp": "pipeline_parallel", "vpp": "virtual_pipeline_parallel", "cp": "context_parallel",
    "ep": "expert_parallel", "etp": "expert_tensor_parallel", "first_stage_layers": "first_stage_layers",
    "last_stage_layers": "last_stage_layers",
}


def _apply_flags(args, layout: LayoutSpec, training: TrainingSpec) -> tuple[LayoutSpec, TrainingSpec]:
    layout_fields = {"world_size", "rollout_tp", "rollout_gpus", "recompute", "recompute_method",
                     "recompute_num_layers", "placement"}
    training_fields = {
        "global_batch_size", "micro_batch_size", "max_seq_len", "rollout_max_num_seqs",
        "rollout_gpu_memory_utilization", "rollout_weight_bytes",
    }
    values = vars(args)
    parallel = replace(layout.parallel, **{field: values[flag] for flag, field in _PARALLEL_FLAGS.items()
                                           if values[flag] is not None})
    layout = replace(layout, parallel=parallel, **{k: values[k] for k in layout_fields if values[k] is not None})
    training = replace(training, **{k: values[k] for k in training_fields if values[k] is not None})
    if args.no_sequence_parallel:
        layout = replace(layout, sequence_parallel=False)
    if args.no_distributed_optimizer:
        layout = replace(layout, distributed_optimizer=False)
    if args.optimizer_cpu_offload:
        layout = replace(layout, optimizer_cpu_offload=True)
    if args.optimizer_offload_fraction is not None:
        layout = replace(layout, optimizer_offload_fraction=args.optimizer_offload_fraction)
    if args.train_mtp:
        layout = replace(layout, train_mtp=True)
    if args.critic:
        training = replace(training, use_critic=True)
    if args.no_reference:
        training = replace(training, use_reference=False)
    return layout, training


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config:
        from megarl.config import ConfigError
        from megarl.run_config import load_config

        try:
            run_config = load_config(args.config, args.overrides)
        except (ConfigError, OSError) as exc:
            raise SystemExit(f"megarl.plan: {args.config}: {exc}") from exc
        hf_config, layout, training = specs_from_run_config(run_config)
    else:
        if args.overrides:
            raise SystemExit(f"megarl.plan: overrides {args.overrides} need --config")
        missing = [f"--{name.replace('_', '-')}" for name in ("world_size", "global_batch_size") if getattr(args, name) is None]
        if missing:
            raise SystemExit(f"megarl.plan: --hf-config needs {' and '.join(missing)}")
        hf_config = read_hf_config(args.hf_config)
        layout = LayoutSpec(world_size=args.world_size)
        training = TrainingSpec(global_batch_size=args.global_batch_size)
    layout, training = _apply_flags(args, layout, training)
    gpus_per_node = args.gpus_per_node or (run_config.trainer.n_gpus_per_node if args.config else 8)
    report = plan_layout(
        hf_config, layout, training, args.gpu_memory_gib, framework_overhead_gib=args.framework_overhead_gib,
        host_memory_gib=args.host_memory_gib, gpus_per_node=gpus_per_node,
    )
    print(report.table())
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
