"""Entry point of the main job: ``python -m megarl.trainer.main --config configs/grpo_tiny.yaml [a.b.c=value ...]``.

Builds everything the loop needs from a :class:`MegarlConfig` — tokenizer, datasets, reward manager, a
Ray cluster (local, or attached with ``trainer.ray_address``), the resource pool and worker groups,
loggers and the checkpoint manager — then runs :class:`megarl.trainer.loop.RLTrainer`. ``run(cfg)`` is
the programmatic form (used by ``launch/multinode.py`` and the end-to-end tests).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch

from megarl.config import MegarlConfig, load_config, save_config
from megarl.config.paths import with_absolute_paths
from megarl.trainer.loop import RLTrainer, needs_reference
from megarl.trainer.run_lock import RunLock
from megarl.trainer.stop_signals import StopSignals


def resolve_device(cfg: MegarlConfig, cluster_gpus: Optional[float] = None) -> str:
    """The workers' device. ``cluster_gpus``: GPUs of an attached Ray cluster, whose driver (a head or login
    node) may have none itself; otherwise the workers run on this machine and its CUDA decides."""
    available = cluster_gpus > 0 if cluster_gpus is not None else torch.cuda.is_available()
    if cfg.trainer.device == "auto":
        return "cuda" if available else "cpu"
    if cfg.trainer.device == "cuda" and not available:
        where = "the Ray cluster has no GPU" if cluster_gpus is not None else "this machine sees no CUDA device"
        raise RuntimeError(f"trainer.device=cuda but {where} (use trainer.device=cpu)")
    return cfg.trainer.device


def build_data(cfg: MegarlConfig, tokenizer):
    from megarl.data.dataset import RLDataset
    from megarl.data.sampler import PromptLoader
    from megarl.data.synthetic import resolve_data_files

    d = cfg.data

    def dataset(files, split):
        return RLDataset(resolve_data_files(files, split=split), tokenizer, prompt_key=d.prompt_key,
                         max_prompt_length=d.max_prompt_length, filter_overlong_prompts=d.filter_overlong_prompts,
                         truncation=d.truncation, apply_chat_template=d.apply_chat_template)

    train = dataset(d.train_files, "train")
    loader = PromptLoader(train, d.train_batch_size, seed=d.seed, pad_token_id=tokenizer.pad_token_id,
                          shuffle=d.shuffle)
    val = dataset(d.val_files, "val") if d.val_files else None
    return loader, val


def split_nodes(cfg: MegarlConfig) -> tuple[list[int], list[int]]:
    """Processes per node of the training pool and of the rollout pool (empty when colocated).

    Separate placement on one node splits its processes; on several nodes the rollout takes whole nodes.
    """
    t = cfg.trainer
    if t.placement != "separate":
        return [t.n_gpus_per_node] * t.nnodes, []
    if t.nnodes == 1:
        return [t.n_gpus_per_node - t.rollout_gpus], [t.rollout_gpus]
    rollout_nodes = t.rollout_gpus // t.n_gpus_per_node
    return [t.n_gpus_per_node] * (t.nnodes - rollout_nodes), [t.n_gpus_per_node] * rollout_nodes


def build_reward_manager(cfg: MegarlConfig):
    from megarl.rewards import RewardManager, load_custom_reward_fn

    custom = cfg.reward_model.custom_function
    custom_fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    return RewardManager(custom_fn=custom_fn, on_error=cfg.reward_model.on_error,
                         max_error_fraction=cfg.reward_model.max_error_fraction)


def run(cfg: MegarlConfig) -> list[dict]:
    """Train to the end of ``cfg``; returns the per-step metric history."""
    from transformers import AutoTokenizer

    from megarl.controller.workers import ActorRolloutRefWorker, CriticWorker, RolloutWorker, worker_env_for
    from megarl.models.embedded import resolve_model_path
    from megarl.trainer.checkpoint import CheckpointManager
    from megarl.trainer.metrics import MetricsLogger

    cfg = with_absolute_paths(cfg, Path.cwd())  # the workers' working directories differ from the driver's
    t = cfg.trainer
    model_path = resolve_model_path(cfg.actor_rollout_ref.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.actor_rollout_ref.model.tokenizer_path or model_path))
    train_loader, val_dataset = build_data(cfg, tokenizer)
    total_steps = t.total_training_steps or len(train_loader) * t.total_epochs
    reward_manager = build_reward_manager(cfg)
    out_dir = Path(t.default_local_dir)
    lock = RunLock(out_dir)  # before anything is written there
    stop = StopSignals()
    groups: list = []
    logger = None
    started_ray = False
    try:
        save_config(cfg, out_dir / "config.yaml")
        logger = MetricsLogger(t.logger, out_dir)
        with_critic = bool(cfg.critic.enable)
        rollout_group = None
        actor_kwargs = dict(cfg=cfg, total_steps=total_steps, with_reference=needs_reference(cfg))
        critic_kwargs = dict(cfg=cfg, total_steps=total_steps)
        if t.backend == "inprocess":
            from megarl.controller.inprocess_group import InProcessWorkerGroup

            device = resolve_device(cfg)
            if with_critic:
                raise ValueError("trainer.backend=inprocess holds one worker; PPO with a critic needs the ray backend")
            actor = InProcessWorkerGroup(ActorRolloutRefWorker, device=device, init_kwargs=actor_kwargs,
                                         env=worker_env_for(device), name_prefix="actor_rollout_ref")
            groups.append(actor)
            critic = None
        else:
            import ray

            from megarl.controller.ray_cluster import init_ray
            from megarl.controller.resource_pool import ResourcePool
            from megarl.controller.worker_group import WorkerGroup

            if not ray.is_initialized():
                if t.ray_address:  # attach first: the cluster's nodes, not this driver, hold the GPUs
                    init_ray(t.ray_address, extra_env=worker_env_for(t.device))
                else:
                    init_ray(None, num_cpus=max(4, t.n_gpus_per_node * 2),
                             extra_env=worker_env_for(resolve_device(cfg)))
                started_ray = True
            device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0.0))
            separate = t.placement == "separate"
            per_process_cpus = 1.0 if device == "cuda" else 0.5
            train_nodes, rollout_nodes = split_nodes(cfg)
            pool = ResourcePool("train" if separate else "colocated", train_nodes, device=device,
                                cpus_per_process=per_process_cpus)
            share = 0.5 if with_critic else 1.0
            timeout = t.worker_timeout_s
            actor = WorkerGroup(pool, ActorRolloutRefWorker, name_prefix="actor_rollout_ref", bundle_share=share,
                                init_kwargs={**actor_kwargs, "separate_rollout": separate}, env=worker_env_for(device),
                                call_timeout_s=timeout, init_timeout_s=timeout)
            groups.append(actor)
            if separate:
                rollout_pool = ResourcePool("rollout", rollout_nodes, device=device, cpus_per_process=per_process_cpus)
                rollout_group = WorkerGroup(rollout_pool, RolloutWorker, name_prefix="rollout", init_kwargs=dict(cfg=cfg),
                                            env=worker_env_for(device), call_timeout_s=timeout, init_timeout_s=timeout)
                groups.append(rollout_group)
                actor.call("attach_rollout_peers", rollout_group.actors)
                actor.call("sync_weights")  # the rollout replicas start from exactly the trainer's weights
            critic = None
            if with_critic:
                critic = WorkerGroup(pool, CriticWorker, name_prefix="critic", bundle_share=share,
                                     init_kwargs=critic_kwargs, env=worker_env_for(device), call_timeout_s=timeout,
                                     init_timeout_s=timeout)
                groups.append(critic)
        trainer = RLTrainer(cfg, tokenizer=tokenizer, train_loader=train_loader, val_dataset=val_dataset,
                            reward_manager=reward_manager, actor_group=actor, critic_group=critic, logger=logger,
                            rollout_group=rollout_group,
                            checkpoints=CheckpointManager(out_dir / "checkpoints", max_to_keep=t.max_ckpt_to_keep),
                            total_steps=total_steps, stop_requested=lambda: stop.requested)
        with stop:
            return trainer.fit()
    finally:
        if logger is not None:
            logger.close()
        for group in groups:
            group.shutdown()
        if started_ray:
            from megarl.controller.ray_cluster import shutdown_ray

            shutdown_ray()
        lock.release()


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[Optional[str], list[str]]:
    parser = argparse.ArgumentParser(prog="python -m megarl.trainer.main", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML recipe (see configs/); defaults apply without one")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied after the file")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def cli(argv: Optional[Sequence[str]] = None) -> int:
    from megarl.config import ConfigError

    config_path, overrides = parse_args(argv)
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except Exception as exc:  # bad data, a failing reward, a full disk, a dead worker: one line, traceback filed
        log = Path(cfg.trainer.default_local_dir) / "error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(f"error: {type(exc).__name__}: {first_line[:2000]}\n(full traceback: {log})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
