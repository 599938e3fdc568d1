"""The worker classes the trainer drives: thin per-rank wrappers around the engines.

``ActorRolloutRefWorker`` is the hybrid engine of one rank: the Megatron actor (and, when the algorithm
needs it, a frozen reference copy) plus a rollout engine replica, sharing the rank's device. Weight sync
is in-process (:class:`megarl.weight_sync.ColocatedTransport`). ``CriticWorker`` holds the value model.
Both are plain classes (no Ray import) whose methods declare how the driver's arguments are split and
results gathered (:mod:`megarl.controller.dispatch`). Generation is data parallel over every rank (each
rank holds a whole rollout replica, or with vLLM TP > 1 a replica spans consecutive ranks); training is
split by Megatron's data-parallel rank.
With ``trainer.placement=separate`` the rollout replicas are ``RolloutWorker``s on their own pool and
training rank 0 streams the gathered buckets to them: by default broadcast over a process group of rank 0
and the rollout workers (NCCL on GPUs, gloo on CPU; :class:`BroadcastTransport`), or through Ray's object
store (host memory; :class:`ObjectStoreTransport`), per ``actor_rollout_ref.rollout.weight_sync_transport``.
Leaves out: separate rollout replicas spanning several workers (rollout TP > 1 needs colocation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.batch import TrainBatch
from megarl.config.schema import ActorConfig, MegarlConfig, MegatronConfig, OptimConfig
from megarl.controller.dispatch import Collect, Dispatch, DPInfo, register
from megarl.controller.fault_injection import kill_point
from megarl.controller.phase_memory import PhaseMemory
from megarl.controller.rollout_replicas import RolloutReplica, form_rollout_replicas, generate_in_replica
from megarl.controller.worker_env import init_torch_distributed
from megarl.engines.megatron.engine import MicroBatching
from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
from megarl.models.bridge import unwrap_model
from megarl.weight_sync.transport import WeightTransport

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LogProbs:
    """Per-token results of a DP shard; a dataclass so DP_COLLECT concatenates field by field."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


def parallel_layout(m: MegatronConfig) -> ParallelLayout:
    return ParallelLayout(
        tensor_parallel=m.tensor_model_parallel_size, pipeline_parallel=m.pipeline_model_parallel_size,
        virtual_pipeline_parallel=m.virtual_pipeline_model_parallel_size, context_parallel=m.context_parallel_size,
        expert_parallel=m.expert_model_parallel_size, expert_tensor_parallel=m.expert_tensor_parallel_size,
    )


def megatron_optimizer_config(optim: OptimConfig, m: MegatronConfig):
    from megatron.core.optimizer import OptimizerConfig

    dtype = _DTYPES[m.params_dtype]
    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=m.use_distributed_optimizer,
    )


def lr_schedule(optim: OptimConfig, total_steps: int):
    from megarl.engines.megatron.engine import LRScheduleConfig

    decay = optim.lr_decay_steps or max(total_steps, optim.lr_warmup_steps + 1)
    return LRScheduleConfig(warmup_steps=optim.lr_warmup_steps, decay_steps=decay,
                            decay_style=optim.lr_decay_style, min_lr=optim.min_lr)


def ddp_config(m: MegatronConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         use_distributed_optimizer=m.use_distributed_optimizer)


def transformer_overrides(m: MegatronConfig) -> dict:
    overrides = {"sequence_parallel": m.sequence_parallel}
    for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(m, key) is not None:
            overrides[key] = getattr(m, key)
    if m.recompute_granularity:
        overrides.update(recompute_granularity=m.recompute_granularity)
        if m.recompute_granularity == "full":
            overrides.update(recompute_method=m.recompute_method or "uniform",
                             recompute_num_layers=m.recompute_num_layers or 1)
    return overrides


class _MegatronRole:
    """Distributed + megatron bring-up shared by the worker classes."""

    def _bring_up(self, cfg: MegarlConfig, megatron: MegatronConfig, model_path: str) -> None:
        from megarl.models.bridge import ModelBridge
        from megarl.models.embedded import resolve_model_path

        self.cfg = cfg
        self.context = init_torch_distributed(timeout_s=cfg.trainer.worker_timeout_s)
        self.layout = parallel_layout(megatron)
        self.rank_info = initialize_megatron_parallel(layout=self.layout, seed=megatron.seed)
        self.model_path = str(resolve_model_path(model_path))
        spec = cfg.actor_rollout_ref.model.layer_spec
        if megatron.context_parallel_size > 1 and spec == "auto":
            spec = "local"  # context parallelism is megarl's SDPA attention, not Transformer Engine's
        self.bridge = ModelBridge.from_hf_config(self.model_path, spec=spec)
        self.params_dtype = _DTYPES[megatron.params_dtype]
        self.megatron = megatron

    def _new_transformer_config(self):
        return self.bridge.transformer_config(layout=self.layout, params_dtype=self.params_dtype,
                                              **transformer_overrides(self.megatron))

    def _provider(self, config, *, tie_embeddings: Optional[bool] = None):
        def build(pre_process: bool, post_process: bool, vp_stage: Optional[int] = None):
            return self.bridge.build_model(config=config, pre_process=pre_process, post_process=post_process,
                                           vp_stage=vp_stage, tie_embeddings=tie_embeddings)
        return build

    def _load_hf(self, engine) -> None:
        from megarl.models.hf_checkpoint import load_hf_weights

        load_hf_weights([unwrap_model(chunk) for chunk in engine.model], self.model_path, self.bridge)
        if getattr(engine, "optimizer", None) is not None:  # fp32 main params must see the loaded weights
            engine.optimizer.reload_model_params()

    def close(self) -> None:
        """Tear down megatron's groups and the process group (a Ray worker just exits instead)."""
        from megarl.engines.megatron.parallel import destroy_megatron_parallel

        rollout = getattr(self, "rollout", None)
        if rollout is not None:
            rollout.shutdown()
        destroy_megatron_parallel()

    def get_dp_info(self) -> DPInfo:
        return DPInfo(self.rank_info.dp_rank, self.rank_info.dp_size, self.rank_info.is_collect_rank)


class ActorRolloutRefWorker(_MegatronRole):
    def __init__(self, cfg: MegarlConfig, *, total_steps: int, with_reference: bool, separate_rollout: bool = False):
        from megarl.engines.megatron.actor import ActorEngine, ReferenceEngine

        arr = cfg.actor_rollout_ref
        self._bring_up(cfg, arr.actor.megatron, arr.model.path)
        actor_config = self._new_transformer_config()
        self.actor = ActorEngine(
            model_provider=self._provider(actor_config), config=actor_config,
            optimizer_config=megatron_optimizer_config(arr.actor.optim, arr.actor.megatron),
            lr_schedule=lr_schedule(arr.actor.optim, total_steps), ddp_config=ddp_config(arr.actor.megatron),
            micro_batch_size=arr.actor.ppo_micro_batch_size_per_gpu, temperature=arr.rollout.temperature or 1.0,
            vocab_size=self.bridge.dims.vocab_size,
            micro_batching=MicroBatching(arr.model.use_sequence_packing, arr.actor.ppo_max_token_len_per_gpu),
        )
        self._load_hf(self.actor)
        self.reference = None
        if with_reference:
            ref_config = self._new_transformer_config()
            self.reference = ReferenceEngine(
                model_provider=self._provider(ref_config), config=ref_config,
                micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                temperature=arr.rollout.temperature or 1.0, vocab_size=self.bridge.dims.vocab_size,
                micro_batching=MicroBatching(arr.model.use_sequence_packing, arr.ref.log_prob_max_token_len_per_gpu),
            )
            self._load_hf(self.reference)
        self.rollout_dtype = _DTYPES[arr.rollout.dtype]
        self.bucket_bytes = arr.rollout.weight_sync_bucket_mb * 2**20
        self.rollout_peers: list = []  # separate placement: the rollout workers' actor handles
        self.weight_group = None  # separate placement, broadcast transport, rank 0: the group with them
        self.rollout = None
        self._actor_offloaded = None  # OffloadState while generation owns the device
        self._reference_offloaded = None
        self._rollout_asleep = False
        self.memory_peaks = PhaseMemory(self.context.device)
        if not separate_rollout:
            check_rollout_tensor_parallel(cfg, colocated=True)
            self.rollout_replica = form_rollout_replicas(arr.rollout.tensor_model_parallel_size)
            self.rollout = build_rollout_engine_for(
                cfg, self.model_path, seed_offset=self.rollout_replica.index, colocated=True,
                device=self.context.device, local_device_index=self.context.local_device_index)
            self.sync_weights()  # the rollout replica starts from exactly the trainer's weights

    # ---------------------------------------------------------------- rollout
    @register(dispatch=Dispatch.ALL_TO_ALL, collect=Collect.ALL)
    def generate(self, prompt_token_ids: list[list[int]], sampling):
        if self.rollout is None:
            raise RuntimeError("trainer.placement=separate: generation runs on the RolloutWorker group")
        self._enter_rollout_mode()
        with self.memory_peaks.track("gen"):
            return generate_in_replica(self.rollout, prompt_token_ids, sampling, self.rollout_replica)

    # ---------------------------------------------------------------- sharing the device (hybrid engine)
    def _enter_rollout_mode(self) -> None:
        """Generation next: move what the config offloads off the device and wake the rollout engine."""
        from megarl.engines.megatron.offload import offload_engine

        m = self.megatron
        if self._actor_offloaded is None and (m.param_offload or m.grad_offload or m.optimizer_offload):
            self._actor_offloaded = offload_engine(self.actor, params=m.param_offload, grads=m.grad_offload,
                                                   optimizer=m.optimizer_offload)
        if (self.reference is not None and self._reference_offloaded is None
                and self.cfg.actor_rollout_ref.ref.param_offload):
            self._reference_offloaded = offload_engine(self.reference, params=True, grads=False, optimizer=False)
        if self._rollout_asleep:
            self.rollout.wake_up()
            self._rollout_asleep = False

    def _enter_train_mode(self, *, weight_sync_follows: bool) -> None:
        """Megatron next: put the rollout engine to sleep (where that frees memory) and reload the engines.
        ``weight_sync_follows``: the rollout weights will be overwritten before the next generation (the
        step's update phases), so the engine may drop them instead of saving them to host memory."""
        from megarl.engines.megatron.offload import reload_engine

        if (self.rollout is not None and not self._rollout_asleep and self.rollout.supports_sleep
                and self.cfg.actor_rollout_ref.rollout.free_cache_engine):
            self.rollout.sleep(discard_weights=weight_sync_follows)
            self._rollout_asleep = True
        if self._actor_offloaded is not None:
            reload_engine(self._actor_offloaded)
            self._actor_offloaded = None
        if self._reference_offloaded is not None:
            reload_engine(self._reference_offloaded)
            self._reference_offloaded = None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def attach_rollout_peers(self, peers: list) -> None:
        """Separate placement: rank 0 streams every weight bucket to these rollout workers (and, with the
        broadcast transport, opens the process group it broadcasts over)."""
        self.rollout_peers = list(peers)
        rollout = self.cfg.actor_rollout_ref.rollout
        if self.rank_info.rank == 0 and rollout.weight_sync_transport == "broadcast":
            self.weight_group = open_weight_group(self.rollout_peers, self.context.device,
                                                  self.cfg.trainer.worker_timeout_s)

    def _num_local_experts(self) -> Optional[int]:
        num_experts = self.bridge.dims.num_experts
        return num_experts // self.layout.expert_parallel if num_experts else None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def sync_weights(self) -> dict:
        from megarl.engines.megatron.offload import reload_engine
        from megarl.weight_sync import ColocatedTransport, DiscardTransport, sync_weights

        if self._actor_offloaded is not None:  # the gather reads the actor's parameters
            reload_engine(self._actor_offloaded)
            self._actor_offloaded = None
        if self._rollout_asleep:  # the engine must hold its weights to be written into; the KV cache can wait
            self.rollout.wake_up(weights_only=True)
        if self.rollout is not None:
            transport = ColocatedTransport(self.rollout)
        elif self.rollout_peers and self.rank_info.rank == 0:
            timeout_s = self.cfg.trainer.worker_timeout_s
            if self.weight_group is not None:
                transport = BroadcastTransport(self.rollout_peers, self.weight_group, timeout_s)
            else:
                transport = ObjectStoreTransport(self.rollout_peers, timeout_s)
        else:  # the other ranks take part in the gather collectives only
            transport = DiscardTransport()
        with self.memory_peaks.track("weight_sync"):
            stats = sync_weights(self.actor.model, self.bridge, transport, bucket_bytes=self.bucket_bytes,
                                 dtype=self.rollout_dtype, num_local_experts=self._num_local_experts())
        if self.rollout is not None:
            self._enter_rollout_mode()  # generation comes next
        return {**stats.as_metrics(), **self.memory_peaks.as_metrics()}

    # ---------------------------------------------------------------- training
    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT)
    def compute_log_probs(self, batch: TrainBatch) -> LogProbs:
        self._enter_train_mode(weight_sync_follows=True)
        rollout = self.cfg.actor_rollout_ref.rollout
        with self.memory_peaks.track("old_log_prob"):
            log_probs, entropy = self.actor.compute_log_probs(
                batch, micro_batch_size=min(rollout.log_prob_micro_batch_size_per_gpu, len(batch)),
                max_tokens=rollout.log_prob_max_token_len_per_gpu)
        # The driver's batches live on the CPU (it may have no GPU at all); never hand it device tensors.
        return LogProbs(log_probs.cpu(), entropy.cpu())

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT)
    def compute_ref_log_probs(self, batch: TrainBatch):
        self._enter_train_mode(weight_sync_follows=True)
        if self.reference is None:
            raise RuntimeError("this actor worker was built without a reference model")
        mbs = self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        with self.memory_peaks.track("ref"):
            log_probs, _ = self.reference.compute_log_probs(batch, micro_batch_size=min(mbs, len(batch)))
        return log_probs.cpu()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0)
    def update_actor(self, batch: TrainBatch) -> dict:
        self._enter_train_mode(weight_sync_follows=True)
        a = self.cfg.actor_rollout_ref.actor
        n = self.cfg.actor_rollout_ref.rollout.n
        mini_rows = a.ppo_mini_batch_size * n // self.rank_info.dp_size
        with self.memory_peaks.track("update_actor"):
            return self.actor.update_policy(
                batch, ppo_epochs=a.ppo_epochs, mini_batch_size=mini_rows, **policy_loss_arguments(a),
                entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
                kl_loss_type=a.kl_loss_type, loss_agg_mode=a.loss_agg_mode,
                norm_length=self.cfg.data.max_response_length,
            )

    # ---------------------------------------------------------------- checkpoints
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint(self, root: str) -> str:
        from megarl.engines.megatron.checkpoint import save_checkpoint

        self._enter_train_mode(weight_sync_follows=False)
        return save_checkpoint(self.actor, root, step=0, before_commit=lambda: kill_point("save_checkpoint"))

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, root: str) -> int:
        from megarl.engines.megatron.checkpoint import load_checkpoint

        self._enter_train_mode(weight_sync_follows=True)  # the trainer syncs the restored weights next
        return load_checkpoint(self.actor, root)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_hf(self, out_dir: str) -> dict:
        """The actor as a Hugging Face checkpoint in ``out_dir``, in its parameters' dtype: every rank takes
        part in the gather, rank 0 writes."""
        from megarl.models.embedded import resolve_model_path
        from megarl.weight_sync import DiscardTransport, sync_weights
        from megarl.weight_sync.hf_writer import HFCheckpointWriter

        self._enter_train_mode(weight_sync_follows=False)
        tokenizer = self.cfg.actor_rollout_ref.model.tokenizer_path
        writer = (HFCheckpointWriter(out_dir, source_dir=self.model_path,
                                     tokenizer_dir=str(resolve_model_path(tokenizer)) if tokenizer else None)
                  if self.rank_info.rank == 0 else DiscardTransport())
        return sync_weights(self.actor.model, self.bridge, writer, bucket_bytes=self.bucket_bytes,
                            dtype=self.params_dtype, num_local_experts=self._num_local_experts()).as_metrics("hf_export")


class CriticWorker(_MegatronRole):
    def __init__(self, cfg: MegarlConfig, *, total_steps: int):
        from megarl.engines.megatron.critic import CriticEngine

        c = cfg.critic
        self._bring_up(cfg, c.megatron, c.model_path or cfg.actor_rollout_ref.model.path)
        config = self._new_transformer_config()
        self.critic = CriticEngine(
            model_provider=self._provider(config, tie_embeddings=False), config=config,
            optimizer_config=megatron_optimizer_config(c.optim, c.megatron),
            lr_schedule=lr_schedule(c.optim, total_steps), ddp_config=ddp_config(c.megatron),
            micro_batch_size=c.ppo_micro_batch_size_per_gpu,
            micro_batching=MicroBatching(bool(c.use_sequence_packing), c.ppo_max_token_len_per_gpu),
        )
        self._load_critic_trunk()

    def _load_critic_trunk(self) -> None:
        """The value model starts from the policy's transformer; its scalar head is freshly initialised."""
        from megarl.models.hf_checkpoint import load_hf_weights

        load_hf_weights([unwrap_model(chunk) for chunk in self.critic.model], self.model_path, self.bridge,
                        exclude_prefixes=("output_layer.",))
        self.critic.optimizer.reload_model_params()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT)
    def compute_values(self, batch: TrainBatch):
        return self.critic.compute_values(batch).cpu()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0)
    def update_critic(self, batch: TrainBatch) -> dict:
        c = self.cfg.critic
        mini_rows = c.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n // self.rank_info.dp_size
        return self.critic.update_critic(batch, ppo_epochs=c.ppo_epochs, mini_batch_size=mini_rows,
                                         cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint(self, root: str) -> str:
        from megarl.engines.megatron.checkpoint import save_checkpoint

        return save_checkpoint(self.critic, root, step=0)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, root: str) -> int:
        from megarl.engines.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self.critic, root)


def check_rollout_tensor_parallel(cfg: MegarlConfig, *, colocated: bool) -> None:
    """Rollout replicas spanning several ranks exist for vLLM inside the colocated actor group only."""
    rollout = cfg.actor_rollout_ref.rollout
    tp = rollout.tensor_model_parallel_size
    if tp > 1 and (rollout.name != "vllm" or not colocated):
        raise NotImplementedError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: rollout replicas spanning several ranks "
            f"need actor_rollout_ref.rollout.name=vllm and trainer.placement=colocate (got name={rollout.name!r}, "
            f"placement={'colocate' if colocated else 'separate'})")


def build_rollout_engine_for(cfg: MegarlConfig, model_path: str, *, seed_offset: int, colocated: bool,
                             device: str, local_device_index: Optional[int]):
    """This rank's rollout engine; ``seed_offset`` is its replica's index (the same on all ranks of a
    replica that spans several ranks, see :mod:`megarl.controller.rollout_replicas`). Callers have run
    :func:`check_rollout_tensor_parallel`. vLLM runs in this process (its engine core too), so weight
    buckets reach it as device tensors; colocated on a GPU it is built with sleep mode, to hand the
    device to training between rollouts (``rollout.free_cache_engine``)."""
    from megarl.engines.rollout.base import build_rollout_engine

    rollout = cfg.actor_rollout_ref.rollout
    engine_kwargs = {"dtype": _DTYPES[rollout.dtype]}
    if rollout.name == "vllm":
        engine_kwargs.update(gpu_memory_utilization=rollout.gpu_memory_utilization,
                             enforce_eager=rollout.enforce_eager,
                             max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                             seed=cfg.trainer.seed + seed_offset, in_process=True,
                             tensor_parallel_size=rollout.tensor_model_parallel_size,
                             local_device_index=local_device_index if device == "cuda" else None,
                             enable_sleep_mode=colocated and device == "cuda" and rollout.free_cache_engine)
        if rollout.kv_cache_memory_mb:
            engine_kwargs["kv_cache_memory_bytes"] = rollout.kv_cache_memory_mb * 2**20
    return build_rollout_engine(rollout.name, model_path, **engine_kwargs)


class _RolloutPeersTransport(WeightTransport):
    """Buckets from training rank 0 to the separate rollout workers; ``finish`` resets their caches."""

    def __init__(self, peers: list, timeout_s: float):
        self.peers, self.timeout_s = peers, timeout_s

    def _on_every_peer(self, method: str, *args):
        return [peer.execute.remote(method, *args) for peer in self.peers]

    def _wait(self, pending: list) -> None:
        import ray

        ray.get(pending, timeout=self.timeout_s)

    def finish(self) -> None:
        self._wait(self._on_every_peer("finish_weight_update"))


class ObjectStoreTransport(_RolloutPeersTransport):
    """Each bucket goes once into Ray's object store (host memory) and every rollout worker loads it.

    Waiting for all workers before the next bucket keeps the extra memory at one bucket.
    """

    def send(self, bucket) -> None:
        import ray

        self._wait(self._on_every_peer("load_weight_bucket", ray.put(bucket)))


class BroadcastTransport(_RolloutPeersTransport):
    """Each bucket is broadcast as one flat buffer over the weight group (:mod:`megarl.weight_sync.broadcast`);
    its layout goes ahead by RPC. Device to device with NCCL; one bucket of extra memory per side."""

    def __init__(self, peers: list, group, timeout_s: float):
        super().__init__(peers, timeout_s)
        self.group = group

    def send(self, bucket) -> None:
        from megarl.weight_sync.broadcast import bucket_layout, pack_bucket, start_broadcast

        layout = bucket_layout(bucket)
        buffer = pack_bucket(bucket, layout, bucket[0][1].device)
        pending = self._on_every_peer("receive_weight_bucket", layout)
        work = start_broadcast(self.group, buffer)
        _watch_peers(pending, work.is_completed, timeout_s=self.timeout_s,
                     what=f"weight broadcast of {len(layout)} tensors")
        work.wait()
        self._wait(pending)


def _watch_peers(pending: list, is_done, *, timeout_s: Optional[float] = None, what: str = "") -> None:
    """Wait until ``is_done()``, raising the first error among the peers' ``pending`` calls meanwhile: a
    peer that failed or died never joins the collective being waited on, so its error is the reason to
    stop rather than the collective's timeout."""
    import time

    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not is_done():
        finished, _ = ray.wait(pending, num_returns=len(pending), timeout=0.05)
        ray.get(finished)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s:.0f}s (trainer.worker_timeout_s)")


def open_weight_group(peers: list, device: str, timeout_s: float):
    """On training rank 0: the weight group of this process (its root) and ``peers`` (ranks 1..N)."""
    import socket
    import threading

    import ray

    from megarl.weight_sync.broadcast import create_group

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    world = len(peers) + 1
    joins = [peer.execute.remote("join_weight_group", host, port, rank, world, timeout_s)
             for rank, peer in enumerate(peers, start=1)]
    # Joining blocks until every member is there: wait in a thread and watch the peers' joins, so a peer
    # that fails to join ends this at once with its error instead of at the group's timeout.
    # (A daemon thread: one left blocked must not keep the process from exiting.)
    outcome: dict = {}

    def join_as_root():
        try:
            outcome["group"] = create_group(host, port, 0, world, device, timeout_s)
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err

    joining = threading.Thread(target=join_as_root, name="weight-group-join", daemon=True)
    joining.start()
    _watch_peers(joins, lambda: not joining.is_alive())
    if "error" in outcome:
        raise outcome["error"]
    ray.get(joins, timeout=timeout_s)
    return outcome["group"]


class RolloutWorker:
    """Separate placement: a rollout engine replica on its own device, fed weights by the trainer."""

    def __init__(self, cfg: MegarlConfig):
        from megarl.controller.worker_env import read_worker_context
        from megarl.models.embedded import resolve_model_path

        self.context = read_worker_context()
        if self.context.device == "cuda":
            torch.cuda.set_device(self.context.local_device_index)
        check_rollout_tensor_parallel(cfg, colocated=False)
        self.engine = build_rollout_engine_for(cfg, str(resolve_model_path(cfg.actor_rollout_ref.model.path)),
                                               seed_offset=self.context.rank, colocated=False,
                                               device=self.context.device,
                                               local_device_index=self.context.local_device_index)
        self.replica = RolloutReplica(index=self.context.rank, size=1, group=None)

    @register(dispatch=Dispatch.ALL_TO_ALL, collect=Collect.ALL)
    def generate(self, prompt_token_ids: list[list[int]], sampling):
        return generate_in_replica(self.engine, prompt_token_ids, sampling, self.replica)

    def load_weight_bucket(self, bucket) -> None:
        self.engine.update_weights(bucket)

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        from megarl.weight_sync.broadcast import create_group

        self.weight_group = create_group(host, port, rank, world_size, self.context.device, timeout_s)

    def receive_weight_bucket(self, layout) -> None:
        from megarl.weight_sync.broadcast import receive_bucket

        device = torch.device("cuda", torch.cuda.current_device()) if self.context.device == "cuda" else "cpu"
        self.engine.update_weights(receive_bucket(self.weight_group, layout, device))

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()


def policy_loss_arguments(actor: ActorConfig) -> dict:
    """The policy loss and its clip bounds as verl means them: PPO-clip always takes the dual clip
    (``clip_ratio_c``, 3.0 by default; null turns it off), so ``dual_clip`` is PPO-clip under its older name;
    GSPO clips per sequence and has no dual clip."""
    name = "ppo_clip" if actor.policy_loss == "dual_clip" else actor.policy_loss
    return dict(policy_loss_name=name, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
                clip_ratio_c=None if name == "gspo" else actor.clip_ratio_c)


def worker_env_for(device: str) -> dict[str, str]:
    """Environment every worker needs on ``device`` (threads: CPU workers must not oversubscribe the cores)."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return env
