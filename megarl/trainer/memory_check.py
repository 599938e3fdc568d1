"""Refuse at start-up a run the memory plan says cannot fit, with the numbers, instead of dying in step 1.

Where the driver sees the GPUs (one node: the in-process backend, or a local Ray cluster), :func:`check_memory_plan`
plans the run (:mod:`megarl.plan`) for this machine's GPU and host memory and raises :class:`ConfigError` with the
plan's own errors when a phase is over: which phase, by how much, its largest parts, the knobs. On a cluster the
driver may hold no GPU, embedded test models have no HF config to plan from, and ``trainer.check_memory_plan=false``
turns it off: then nothing is checked.
"""

from __future__ import annotations

import os
from typing import Optional

from megarl.config.errors import ConfigError
from megarl.config.schema import MegarlConfig

GIB = 1024**3


def plannable(cfg: MegarlConfig) -> bool:
    """Whether the planner finds the model's config.json: in the model path, an embedded model's directory, or
    (a recipe whose checkpoint is not here yet) the shipped reference config of the same model."""
    from megarl.plan.from_config import planning_config_dir

    path, _ = planning_config_dir(cfg.actor_rollout_ref.model.path)
    return (path / "config.json").is_file()


def plan_run(cfg: MegarlConfig, *, gpu_memory_gib: float, host_memory_gib: Optional[float] = None):
    """The memory plan (:class:`megarl.plan.memory.PlanReport`) of ``cfg`` on GPUs of ``gpu_memory_gib`` and
    nodes of ``host_memory_gib`` (None: host memory not checked)."""
    from megarl.plan.from_config import specs_from_run_config
    from megarl.plan.memory import plan_layout

    hf_config, layout, training = specs_from_run_config(cfg)
    return plan_layout(hf_config, layout, training, gpu_memory_gib, host_memory_gib=host_memory_gib,
                       gpus_per_node=cfg.trainer.n_gpus_per_node)


def memory_plan_errors(cfg: MegarlConfig, *, gpu_memory_gib: float, host_memory_gib: Optional[float]) -> list[str]:
    """The plan's errors for ``cfg`` on GPUs of ``gpu_memory_gib`` and hosts of ``host_memory_gib``."""
    return plan_run(cfg, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib).errors


def this_gpu_gib() -> Optional[float]:
    """Memory of this process's first visible GPU; None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


def check_memory_plan(cfg: MegarlConfig) -> None:
    t = cfg.trainer
    if not t.check_memory_plan or t.device == "cpu" or t.ray_address:  # no GPU, or the cluster's are not here
        return
    gpu_gib = this_gpu_gib()
    if gpu_gib is None or not plannable(cfg):
        return
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    errors = memory_plan_errors(cfg, gpu_memory_gib=gpu_gib, host_memory_gib=host_gib)
    if errors:
        raise ConfigError(
            f"the memory plan says this run does not fit a {gpu_gib:.1f} GiB GPU with {host_gib:.0f} GiB of host "
            "memory:\n  - " + "\n  - ".join(errors) + "\n(python -m megarl.plan --config ... prints the whole plan; "
            "trainer.check_memory_plan=false starts anyway)")
