"""The driver's typed view of the worker groups: one facade per role, one method per thing a role does.

The loop calls ``actor.update(batch)``; the facade calls the worker's method itself through the group,
``group.call(ActorRolloutRefWorker.update_actor, batch)``: each driver -> worker edge is a method a reader (and
an IDE, and a call graph) can follow to the code it runs, with the types that cross it, and a misspelt name
fails at import. The worker method's declaration (:func:`megarl.controller.dispatch.register`) is the contract:
how the call fans out over the ranks, how the results come back, and which batch fields travel (the rest
stays with the driver). The facades sit over either backend (:class:`~megarl.controller.worker_group.WorkerGroup`,
a Ray actor per rank, or :class:`~megarl.controller.inprocess_group.InProcessWorkerGroup`, the worker in this
process). Splitting prompts over the rollout ranks and mapping the answers back to the caller's prompt order
happens here, once (:meth:`Rollout.generate`).

:func:`start_workers` brings the roles up for a config (Ray cluster, resource pools, groups; or the
in-process worker) and :meth:`Workers.shutdown` takes them down.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from megarl.batch import TrainBatch, select_rows
from megarl.config.schema import GlobalProfilerConfig, MegarlConfig
from megarl.controller.dispatch import RankGroup
from megarl.controller.profiling import ProfiledWorker
from megarl.controller.reward_model_worker import RewardModelWorker
from megarl.controller.rollout_worker import RolloutWorker
from megarl.controller.teacher_worker import TeacherWorker
from megarl.controller.workers import ActorRolloutRefWorker, CriticWorker, LogProbs
from megarl.engines.rollout.base import RolloutOutput, SamplingConfig


def needs_reference(cfg: MegarlConfig) -> bool:
    return (cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
            or cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "dpo")


def padded_to_multiple(rows: list[int], parts: int) -> list[int]:
    """``rows`` with copies of its last row appended until it splits evenly into ``parts`` (data-parallel ranks);
    the caller keeps the first ``len(rows)`` results."""
    return rows + [rows[-1]] * (-len(rows) % parts)


def split_evenly(items: list, parts: int) -> list[list]:
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for index in range(parts):
        stop = start + size + (1 if index < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


class PendingGeneration:
    """A generation running on the rollout ranks; :meth:`result` waits for it (once) and maps the answers back
    to the caller's prompt order."""

    def __init__(self, chunks: list[list[int]], call):
        self._chunks, self._call = chunks, call
        self._outputs: Optional[list[RolloutOutput]] = None

    def result(self) -> list[RolloutOutput]:
        if self._outputs is None:
            per_rank = self._call.get()
            self._outputs = [replace(out, prompt_index=chunk[out.prompt_index])
                             for chunk, outputs in zip(self._chunks, per_rank) for out in outputs]
            self._call = None
        return self._outputs


class Rollout:
    """Generation: the hybrid actor group (colocated) or the rollout workers (separate placement); ``generate``
    is the worker class's method (:meth:`ActorRolloutRefWorker.generate` or :meth:`RolloutWorker.generate`)."""

    def __init__(self, group: RankGroup, generate: Callable):
        self._group, self._generate = group, generate

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 multi_modal_inputs: Optional[list[Optional[dict]]] = None) -> list[RolloutOutput]:
        """Every prompt's ``sampling.n`` responses; ``prompt_index`` indexes ``prompts``. The prompts are split
        evenly over the ranks, in order; ``multi_modal_inputs`` (a vision-language model's: per prompt its
        pixels or None) go with their prompts."""
        return self.generate_async(prompts, sampling, multi_modal_inputs).result()

    def generate_async(self, prompts: list[list[int]], sampling: SamplingConfig,
                       multi_modal_inputs: Optional[list[Optional[dict]]] = None) -> PendingGeneration:
        """:meth:`generate` started on the ranks without waiting (the Ray backend; the in-process group
        generates at once)."""
        world = self._group.world_size
        chunks = split_evenly(list(range(len(prompts))), world)
        per_rank = [sampling] * world
        if sampling.prompt_seeds:  # each prompt's seed goes with it
            per_rank = [replace(sampling, prompt_seeds=tuple(sampling.prompt_seeds[i] for i in chunk))
                        for chunk in chunks]
        if multi_modal_inputs and len(multi_modal_inputs) != len(prompts):
            raise ValueError(f"{len(multi_modal_inputs)} multi_modal_inputs for {len(prompts)} prompts")
        images = [[multi_modal_inputs[i] for i in chunk] if multi_modal_inputs else None for chunk in chunks]
        call = self._group.call_async(self._generate, [[prompts[i] for i in chunk] for chunk in chunks], per_rank,
                                      images)
        return PendingGeneration(chunks, call)


class ActorRolloutRef:
    """The Megatron actor, its frozen reference and (colocated) the rollout replicas on the same ranks."""

    def __init__(self, group: RankGroup):
        self._group = group

    def compute_log_probs(self, batch: TrainBatch) -> LogProbs:
        """The actor's per-token log-probs and entropy of the responses."""
        return self._group.call(ActorRolloutRefWorker.compute_log_probs, batch)

    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self._group.call(ActorRolloutRefWorker.compute_ref_log_probs, batch)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One PPO update over the batch (its mini-batches and epochs); the actor's metrics."""
        return self._group.call(ActorRolloutRefWorker.update_actor, batch)

    def update_reference(self) -> None:
        """The reference becomes the actor's current weights (SPIN: the next iteration's opponent)."""
        self._group.call(ActorRolloutRefWorker.update_reference)

    def sync_weights(self) -> dict[str, float]:
        """The actor's weights into the rollout engines; the metrics of the sync."""
        return self._group.call(ActorRolloutRefWorker.sync_weights)

    def attach_rollout_peers(self, rollout_group) -> None:
        """Separate placement: stream weights to this group's rollout workers from now on."""
        self._group.call(ActorRolloutRefWorker.attach_rollout_peers, rollout_group.as_peers())

    def save(self, path: str, step: int) -> None:
        """Megatron-LM's layout in ``path``: ``iter_<step>/`` and its tracker file."""
        self._group.call(ActorRolloutRefWorker.save_checkpoint, path, step)

    def save_hf(self, path: str) -> None:
        self._group.call(ActorRolloutRefWorker.save_hf, path)

    def save_hf_adapter(self, path: str) -> None:
        """The LoRA adapter as a PEFT adapter directory."""
        self._group.call(ActorRolloutRefWorker.save_hf_adapter, path)

    def load(self, path: str) -> int:
        return self._group.call(ActorRolloutRefWorker.load_checkpoint, path)


class Critic:
    """The value model."""

    def __init__(self, group: RankGroup):
        self._group = group

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self._group.call(CriticWorker.compute_values, batch)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        return self._group.call(CriticWorker.update_critic, batch)

    def save(self, path: str, step: int) -> None:
        """Megatron-LM's layout in ``path``: ``iter_<step>/`` and its tracker file."""
        self._group.call(CriticWorker.save_checkpoint, path, step)

    def load(self, path: str) -> int:
        return self._group.call(CriticWorker.load_checkpoint, path)


class RewardModel:
    """The model-based reward: one score per sample from the reward model group."""

    def __init__(self, group: RankGroup):
        self._group = group

    def score(self, batch: TrainBatch) -> torch.Tensor:
        """Scores ``[B]`` of a batch in the reward model's tokens
        (:class:`~megarl.rewards.model_inputs.RewardModelInputs`). Any ``B``: a batch that does not split over
        the group's data-parallel ranks (a short validation batch) is padded with copies of its last row."""
        rows, dp = len(batch), self._group.dp_layout.dp_size
        if rows % dp:
            batch = select_rows(batch, padded_to_multiple(list(range(rows)), dp))
        return self._group.call(RewardModelWorker.compute_rm_scores, batch)[:rows]


def teacher_rows(batch: TrainBatch, cfg: MegarlConfig) -> dict[str, list[int]]:
    """Which rows each teacher scores: those whose ``distillation.teacher_key`` field (``data_source``, or a key of
    the row's ``extra_info``) equals the teacher's ``key``; a single teacher without a key scores every row."""
    d = cfg.distillation
    teachers = d.teacher_models
    if len(teachers) == 1 and next(iter(teachers.values())).key is None:
        return {next(iter(teachers)): list(range(len(batch)))}
    by_key = {t.key: name for name, t in teachers.items()}
    rows: dict[str, list[int]] = {name: [] for name in teachers}
    for row in range(len(batch)):
        if d.teacher_key == "data_source":
            value = batch.data_sources[row] if batch.data_sources else None
        else:
            info = batch.extra_infos[row] if batch.extra_infos else None
            value = info.get(d.teacher_key) if isinstance(info, dict) else None
        if value not in by_key:
            raise ValueError(f"distillation: row {row} has {d.teacher_key}={value!r}, which no teacher's key names "
                             f"(distillation.teacher_models.*.key: {sorted(map(str, by_key))})")
        rows[by_key[value]].append(row)
    return rows


class Teachers:
    """On-policy distillation's teachers: each scores its rows of a batch (:func:`teacher_rows`)."""

    def __init__(self, groups: dict, cfg: MegarlConfig):
        self._groups, self._cfg = groups, cfg  # teacher name -> its RankGroup

    def log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, R]``: every row's log-probs of its response tokens under its teacher. The teachers score at
        once (each on its own ranks); a teacher's rows that do not split over its data-parallel ranks are
        padded with copies of the last."""
        pending = {}
        for name, rows in teacher_rows(batch, self._cfg).items():
            if not rows:
                continue
            group = self._groups[name]
            padded = padded_to_multiple(rows, group.dp_layout.dp_size)
            pending[name] = (rows, group.call_async(TeacherWorker.compute_teacher_log_probs,
                                                    select_rows(batch, padded)))
        out = torch.zeros(tuple(batch.response_ids.shape), dtype=torch.float32)
        for rows, call in pending.values():
            out[rows] = call.get()[:len(rows)]
        return out


@dataclass
class Workers:
    """The roles of a run and what :meth:`shutdown` must release."""

    actor: ActorRolloutRef
    rollout: Rollout
    critic: Optional[Critic] = None
    reward_model: Optional[RewardModel] = None
    teachers: Optional[Teachers] = None
    groups: list = field(default_factory=list)
    pools: list = field(default_factory=list)  # their placement groups outlive the run on an attached cluster
    started_ray: bool = False
    profiler: Optional[GlobalProfilerConfig] = None  # global_profiler, its save_path resolved

    @contextlib.contextmanager
    def profiled_step(self, step: int):
        """``global_profiler``: ``step`` captured by every worker of every group (megarl.controller.profiling);
        other steps run as they are. Yields the trace files written (filled when the step ends)."""
        profiler = self.profiler
        traces: list[str] = []
        if profiler is None or profiler.tool is None or step not in profiler.steps:
            yield traces
            return
        for group in self.groups:
            group.call(ProfiledWorker.start_profile, profiler.save_path, step, profiler.tool)
        try:
            yield traces
        finally:
            for group in self.groups:
                traces += [path for path in group.call(ProfiledWorker.stop_profile) if path]

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.groups = []
        for pool in self.pools:
            pool.release()
        self.pools = []
        if self.started_ray:
            from megarl.controller.ray_cluster import shutdown_ray

            shutdown_ray()
            self.started_ray = False


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


def start_workers(cfg: MegarlConfig, *, total_steps: int) -> Workers:
    """Bring up every role of ``cfg``: ``trainer.backend=inprocess`` holds the actor in this process; ``ray``
    starts (or attaches to) a Ray cluster, reserves the pools and starts one worker per rank. On failure what
    was started is shut down again."""
    from megarl.controller.worker_env import worker_env_for

    t, rm = cfg.trainer, cfg.reward_model
    with_critic = bool(cfg.critic.enable)
    rm_shares_pool = rm.enable and not rm.enable_resource_pool
    d = cfg.distillation
    teachers = list(d.teacher_models) if d.enabled else []
    teachers_share_pool = bool(teachers) and d.n_gpus_per_node == 0
    actor_kwargs: dict[str, Any] = dict(cfg=cfg, total_steps=total_steps, with_reference=needs_reference(cfg))
    critic_kwargs = dict(cfg=cfg, total_steps=total_steps)
    if t.backend == "inprocess":
        from megarl.controller.inprocess_group import InProcessWorkerGroup

        if with_critic:
            raise ValueError("trainer.backend=inprocess holds one worker; PPO with a critic needs the ray backend")
        if cfg.distillation.enabled:
            raise ValueError("trainer.backend=inprocess holds one worker; distillation's teachers need the ray "
                             "backend")
        device = resolve_device(cfg)
        group = InProcessWorkerGroup(ActorRolloutRefWorker, device=device, init_kwargs=actor_kwargs,
                                     env=worker_env_for(device), name_prefix="actor_rollout_ref")
        return Workers(actor=ActorRolloutRef(group), rollout=Rollout(group, ActorRolloutRefWorker.generate),
                       groups=[group])

    import ray

    from megarl.controller.ray_cluster import init_ray, running_cluster_address
    from megarl.controller.resource_pool import ResourcePool
    from megarl.controller.worker_group import WorkerGroup

    workers = Workers(actor=None, rollout=None)  # filled below; shut down if anything fails on the way
    try:
        if not ray.is_initialized():
            address = t.ray_address or running_cluster_address()
            if address and not t.ray_address:
                print(f"[megarl] trainer.ray_address is unset and a Ray cluster runs here ({address}, from `ray start` "
                      f"or RAY_ADDRESS): attaching to it (RAY_ADDRESS=local starts a private one)", flush=True)
            if address:  # attach first: the cluster's nodes, not this driver, hold the GPUs
                init_ray(address, extra_env=worker_env_for(t.device))
            else:
                init_ray(None, num_cpus=max(4, t.n_gpus_per_node * 2), extra_env=worker_env_for(resolve_device(cfg)))
            workers.started_ray = True
        device = resolve_device(cfg, ray.cluster_resources().get("GPU", 0.0))
        separate = t.placement == "separate"
        per_process_cpus = 1.0 if device == "cuda" else 0.5
        train_nodes, rollout_nodes = split_nodes(cfg)
        pool = ResourcePool("train" if separate else "colocated", train_nodes, device=device,
                            cpus_per_process=per_process_cpus)
        workers.pools.append(pool)
        # of each GPU bundle, per role placed on it
        share = 1.0 / (1 + with_critic + rm_shares_pool + (len(teachers) if teachers_share_pool else 0))
        timeout = t.worker_timeout_s
        env = worker_env_for(device)
        actor_group = WorkerGroup(pool, ActorRolloutRefWorker, name_prefix="actor_rollout_ref", bundle_share=share,
                                  init_kwargs={**actor_kwargs, "separate_rollout": separate}, env=env,
                                  call_timeout_s=timeout, init_timeout_s=timeout)
        workers.groups.append(actor_group)
        workers.actor = ActorRolloutRef(actor_group)
        workers.rollout = Rollout(actor_group, ActorRolloutRefWorker.generate)
        if separate:
            rollout_pool = ResourcePool("rollout", rollout_nodes, device=device, cpus_per_process=per_process_cpus)
            workers.pools.append(rollout_pool)
            rollout_group = WorkerGroup(rollout_pool, RolloutWorker, name_prefix="rollout", init_kwargs=dict(cfg=cfg),
                                        env=env, call_timeout_s=timeout, init_timeout_s=timeout)
            workers.groups.append(rollout_group)
            workers.rollout = Rollout(rollout_group, RolloutWorker.generate)
            workers.actor.attach_rollout_peers(rollout_group)
            workers.actor.sync_weights()  # the rollout replicas start from exactly the trainer's weights
        if with_critic:
            critic_group = WorkerGroup(pool, CriticWorker, name_prefix="critic", bundle_share=share,
                                       init_kwargs=critic_kwargs, env=env, call_timeout_s=timeout,
                                       init_timeout_s=timeout)
            workers.groups.append(critic_group)
            workers.critic = Critic(critic_group)
        if rm.enable:
            rm_pool = pool
            if rm.enable_resource_pool:
                rm_pool = ResourcePool("reward_model", [rm.n_gpus_per_node] * rm.nnodes, device=device,
                                       cpus_per_process=per_process_cpus)
                workers.pools.append(rm_pool)
            rm_group = WorkerGroup(rm_pool, RewardModelWorker, name_prefix="reward_model",
                                   bundle_share=share if rm_shares_pool else 1.0, init_kwargs=dict(cfg=cfg), env=env,
                                   call_timeout_s=timeout, init_timeout_s=timeout)
            workers.groups.append(rm_group)
            workers.reward_model = RewardModel(rm_group)
        if teachers:
            teacher_pool, teacher_share = pool, share
            if not teachers_share_pool:  # the teachers' own GPUs, split among them
                teacher_pool = ResourcePool("teachers", [d.n_gpus_per_node] * max(d.nnodes, 1), device=device,
                                            cpus_per_process=per_process_cpus)
                workers.pools.append(teacher_pool)
                teacher_share = 1.0 / len(teachers)
            groups = {}
            for name in teachers:
                groups[name] = WorkerGroup(teacher_pool, TeacherWorker, name_prefix=f"teacher_{name}",
                                           bundle_share=teacher_share, init_kwargs=dict(cfg=cfg, teacher=name),
                                           env=env, call_timeout_s=timeout, init_timeout_s=timeout)
                workers.groups.append(groups[name])
            workers.teachers = Teachers(groups, cfg)
        return workers
    except BaseException:
        workers.shutdown()
        raise
