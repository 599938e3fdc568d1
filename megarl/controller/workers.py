"""The worker classes the trainer drives: thin per-rank wrappers around the engines.

``ActorRolloutRefWorker`` is the hybrid engine of one rank: the Megatron actor (and, when the algorithm
needs it, a frozen reference copy) plus a rollout engine replica, sharing the rank's device. Weight sync
is in-process (:class:`megarl.weight_sync.ColocatedTransport`). ``CriticWorker`` holds the value model.
Both are plain classes whose methods declare how the driver's arguments are split and results gathered
(:mod:`megarl.controller.dispatch`); what is on the device in which phase is decided by
:class:`~megarl.controller.device_residency.DeviceResidency`, and the engines' arguments come from
:mod:`megarl.controller.engine_specs`. Generation is data parallel over every rank (each rank holds a whole
rollout replica, or with rollout TP > 1 a replica spans consecutive ranks); training is split by Megatron's
data-parallel rank.
With ``trainer.placement=separate`` the rollout replicas are ``RolloutWorker``s
(:mod:`megarl.controller.rollout_worker`) on their own pool, and training rank 0 streams the gathered buckets
to them: broadcast over a process group of rank 0 and the rollout workers (NCCL on GPUs, gloo on CPU), or
through Ray's object store (host memory), per ``actor_rollout_ref.rollout.weight_sync_transport``
(:mod:`megarl.controller.peer_transports`).
With LoRA (``model.lora``) the actor's engine trains adapters on a frozen base, the reference log-probs come from
the same engine with its adapters off, and the rollout engine gets merged weights or serves the adapter
(``lora.merge``; :meth:`ActorRolloutRefWorker.sync_weights`).
Leaves out: separate rollout replicas spanning several workers (rollout TP > 1 needs colocation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.batch import MODEL_INPUTS, TrainBatch
from megarl.config.lora import block_lora, model_lora
from megarl.config.schema import MegarlConfig
from megarl.controller.device_residency import DeviceResidency, OffloadPolicy
from megarl.controller.dispatch import Collect, Dispatch, register
from megarl.controller.engine_specs import (DTYPES, actor_update_arguments, critic_update_arguments, ddp_config,
                                            lora_serving, lora_spec, lr_schedule, megatron_optimizer_config,
                                            routes_with_replay)
from megarl.controller.fault_injection import kill_point
from megarl.controller.megatron_role import MegatronRole
from megarl.controller.peer_transports import BroadcastTransport, ObjectStoreTransport, open_weight_group
from megarl.controller.phase_memory import PhaseMemory
from megarl.controller.rollout_replicas import form_rollout_replicas, generate_in_replica
from megarl.controller.rollout_worker import build_rollout_engine_for, check_rollout_tensor_parallel
from megarl.engines.megatron.micro_batches import MicroBatching
from megarl.engines.megatron.model_chunks import copy_model_weights
from megarl.models.bridge import unwrap_model


@dataclass
class LogProbs:
    """Per-token results of a DP shard; a dataclass so DP_COLLECT concatenates field by field. MoE: the routing
    the old-log-prob pass recorded (router_replay R2, ``[B, P + R, L_moe, K]``), and the fraction of routings
    that differ from the rollout's (the same on every rank)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    routed_experts: Optional[torch.Tensor] = None
    routing_mismatch: Optional[float] = None


class ActorRolloutRefWorker(MegatronRole):
    def __init__(self, cfg: MegarlConfig, *, total_steps: int, with_reference: bool, separate_rollout: bool = False):
        from megarl.engines.megatron.actor import ActorEngine, ReferenceEngine

        arr = cfg.actor_rollout_ref
        lora = model_lora(arr.model)
        self._bring_up(cfg, arr.actor.megatron, arr.model.path, lora=lora is not None)
        actor_config = self._new_transformer_config()
        self.lora = lora_spec(lora, seed=arr.actor.megatron.seed)
        self.actor = ActorEngine(
            model_provider=self._provider(actor_config, train_vision_tower=not arr.actor.freeze_vision_tower),
            config=actor_config,
            optimizer_config=megatron_optimizer_config(arr.actor.optim, arr.actor.megatron),
            lr_schedule=lr_schedule(arr.actor.optim, total_steps), ddp_config=ddp_config(arr.actor.megatron),
            micro_batch_size=arr.actor.ppo_micro_batch_size_per_gpu, temperature=arr.rollout.temperature or 1.0,
            vocab_size=self.bridge.dims.vocab_size,
            micro_batching=MicroBatching(arr.model.use_sequence_packing, arr.actor.ppo_max_token_len_per_gpu),
            lora=self.lora, routing_replay=routes_with_replay(cfg),
        )
        self.routing_mode = arr.actor.megatron.router_replay.mode
        if arr.actor.load_weight:
            self._load_hf(self.actor)
        if lora is not None and lora.adapter_path:
            self._load_adapter(self.actor, lora.adapter_path)
        self.update_arguments = actor_update_arguments(cfg, self.rank_info.dp_size)
        self.reference = None
        # LoRA: the reference policy is the actor's base, its adapters switched off (no second model)
        self.reference_is_base = with_reference and self.lora is not None
        # LoRA served by the rollout engine (only the adapters move per sync) or merged into a full sync
        self.serve_adapter = self.lora is not None and not lora_serving(lora, separate_rollout)
        self._rollout_has_base = False
        if with_reference and not self.reference_is_base:
            ref_config = self._new_transformer_config()
            self.reference = ReferenceEngine(
                model_provider=self._provider(ref_config), config=ref_config,
                micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                temperature=arr.rollout.temperature or 1.0, vocab_size=self.bridge.dims.vocab_size,
                micro_batching=MicroBatching(arr.model.use_sequence_packing, arr.ref.log_prob_max_token_len_per_gpu),
                routing_replay=self.routing_mode != "disabled",
            )
            if arr.actor.load_weight:
                self._load_hf(self.reference)
            else:  # the reference is the policy at step 0: here, megatron's random initialisation of the actor
                copy_model_weights(self.actor.model, self.reference.model)
        self.rollout_dtype = DTYPES[arr.rollout.dtype]
        self.bucket_bytes = arr.rollout.weight_sync_bucket_mb * 2**20
        self.rollout_peers = None  # separate placement: the rollout workers' PeerGroup
        self.weight_group = None  # separate placement, broadcast transport, rank 0: the group with them
        self.rollout = None
        self.memory_peaks = PhaseMemory(self.context.device)
        m = arr.actor.megatron
        self.residency = DeviceResidency(
            actor=self.actor, reference=self.reference,
            offload=OffloadPolicy(actor_params=m.param_offload, actor_grads=m.grad_offload,
                                  actor_optimizer=m.optimizer_offload, reference_params=arr.ref.param_offload))
        if not separate_rollout:
            check_rollout_tensor_parallel(cfg, colocated=True)
            self.rollout_replica = form_rollout_replicas(arr.rollout.tensor_model_parallel_size)
            self.residency.make_room_for_rollout()  # the engine sizes its share from the memory free at its start
            self.rollout = build_rollout_engine_for(
                cfg, self.model_path, replica=self.rollout_replica, colocated=True,
                device=self.context.device, local_device_index=self.context.local_device_index,
                adapter_rank=self.lora.rank if self.serve_adapter else None)
            # an engine serving an adapter keeps its base weights while asleep: a sync brings only the adapter
            self.residency.attach_rollout(self.rollout, rollout_sleeps=arr.rollout.free_cache_engine,
                                          keeps_weights=self.serve_adapter)
            self.sync_weights()  # the rollout replica starts from exactly the trainer's weights

    # ---------------------------------------------------------------- rollout
    @register(dispatch=Dispatch.ALL_TO_ALL, collect=Collect.ALL)
    def generate(self, prompt_token_ids: list[list[int]], sampling, multi_modal_inputs=None):
        if self.rollout is None:
            raise RuntimeError("trainer.placement=separate: generation runs on the RolloutWorker group")
        self.residency.for_generation()
        with self.memory_peaks.track("gen"):
            return generate_in_replica(self.rollout, prompt_token_ids, sampling, self.rollout_replica,
                                       multi_modal_inputs)

    # ---------------------------------------------------------------- the device's phases (hybrid engine)
    # Each method below enters the phase it needs (self.residency, DeviceResidency): the driver never names
    # phases, and entering the current phase again is free.

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def attach_rollout_peers(self, peers) -> None:
        """Separate placement: rank 0 streams every weight bucket to the rollout workers of ``peers`` (their
        group's :class:`~megarl.controller.worker_group.PeerGroup`) and, with the broadcast transport, opens the
        process group it broadcasts over."""
        self.rollout_peers = peers
        rollout = self.cfg.actor_rollout_ref.rollout
        if self.rank_info.rank == 0 and rollout.weight_sync_transport == "broadcast":
            self.weight_group = open_weight_group(self.rollout_peers, self.context.device,
                                                  self.cfg.trainer.worker_timeout_s)

    def _num_local_experts(self) -> Optional[int]:
        num_experts = self.bridge.dims.num_experts
        return num_experts // self.layout.expert_parallel if num_experts else None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def sync_weights(self) -> dict:
        from megarl.weight_sync import ColocatedTransport, DiscardTransport

        self.residency.for_weight_sync()
        if self.rollout is not None:
            transport = ColocatedTransport(self.rollout)
        elif self.rollout_peers is not None and self.rank_info.rank == 0:
            timeout_s = self.cfg.trainer.worker_timeout_s
            if self.weight_group is not None:
                transport = BroadcastTransport(self.rollout_peers, self.weight_group, timeout_s)
            else:
                transport = ObjectStoreTransport(self.rollout_peers, timeout_s)
        else:  # the other ranks take part in the gather collectives only
            transport = DiscardTransport()
        with self.memory_peaks.track("weight_sync"):
            metrics = self._sync_adapter(transport) if self.serve_adapter else self._send_model(transport).as_metrics()
        return {**metrics, **self.memory_peaks.as_metrics()}

    def _send_model(self, transport, dtype: Optional[torch.dtype] = None):
        """The whole model as HF tensors through ``transport`` (collective), in ``dtype`` (default: the rollout's)."""
        from megarl.weight_sync import sync_weights

        return sync_weights(self.actor.model, self.bridge, transport, bucket_bytes=self.bucket_bytes,
                            dtype=dtype or self.rollout_dtype, num_local_experts=self._num_local_experts())

    def _sync_adapter(self, transport) -> dict:
        """LoRA served by the rollout engine: the base once (adapters off), then only the adapter per sync."""
        from megarl.models.lora import adapters_disabled
        from megarl.weight_sync.adapters import peft_adapter_config
        from megarl.weight_sync.sync import sync_adapter

        metrics = {}
        if not self._rollout_has_base:
            with adapters_disabled(self.actor.model):
                metrics = self._send_model(transport).as_metrics("weight_sync_base")
            self._rollout_has_base = True
        stats = sync_adapter(self.actor.model, self.bridge, self.rollout,
                             lambda named: peft_adapter_config(self.lora, named), dtype=self.rollout_dtype,
                             num_local_experts=self._num_local_experts())
        return {**metrics, **stats.as_metrics()}

    # ---------------------------------------------------------------- training
    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT, reads=MODEL_INPUTS + ("routed_experts",))
    def compute_log_probs(self, batch: TrainBatch) -> LogProbs:
        """The old log-probs; MoE: R3 replays the rollout's routing, R2 records the routers' own for the update."""
        self.residency.for_training(weight_sync_follows=True)
        rollout = self.cfg.actor_rollout_ref.rollout
        with self.memory_peaks.track("old_log_prob"):
            result = self.actor.log_prob_pass(
                batch, micro_batch_size=min(rollout.log_prob_micro_batch_size_per_gpu, len(batch)),
                max_tokens=rollout.log_prob_max_token_len_per_gpu, replay_routing=self.routing_mode == "R3",
                record_routing=self.routing_mode == "R2")
        # The driver's batches live on the CPU (it may have no GPU at all); never hand it device tensors.
        routed = None if result.routed_experts is None else result.routed_experts.to("cpu", torch.int16)
        return LogProbs(result.log_probs.cpu(), result.entropy.cpu(), routed, result.routing_mismatch)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT, reads=MODEL_INPUTS + ("routed_experts",))
    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference's log-probs; MoE: it replays the routing the actor's mode replays."""
        self.residency.for_training(weight_sync_follows=True)
        mbs = self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        replay = self.routing_mode != "disabled"
        if self.reference_is_base:
            from megarl.models.lora import adapters_disabled

            with self.memory_peaks.track("ref"), adapters_disabled(self.actor.model):
                log_probs, _ = self.actor.compute_log_probs(batch, micro_batch_size=min(mbs, len(batch)),
                                                            replay_routing=replay)
            return log_probs.cpu()
        if self.reference is None:
            raise RuntimeError("this actor worker was built without a reference model")
        with self.memory_peaks.track("ref"):
            log_probs, _ = self.reference.compute_log_probs(batch, micro_batch_size=min(mbs, len(batch)),
                                                            replay_routing=replay)
        return log_probs.cpu()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0,
              reads=MODEL_INPUTS + ("old_log_probs", "ref_log_probs", "advantages", "rollout_is_weights", "loss_mask",
                                    "teacher_log_probs", "routed_experts"))
    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        self.residency.for_training(weight_sync_follows=True)
        with self.memory_peaks.track("update_actor"):
            return self.actor.update_policy(batch, **self.update_arguments)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def update_reference(self) -> None:
        """The reference policy becomes the actor's current weights (SPIN's next iteration plays against them)."""
        if self.reference is None:
            raise RuntimeError("update_reference: this actor worker has no reference engine of its own")
        copy_model_weights(self.actor.model, self.reference.model)

    def _load_adapter(self, engine, adapter_path: str) -> None:
        from megarl.weight_sync.adapters import load_peft_adapter

        load_peft_adapter(engine.model, self.bridge, adapter_path, engine.lora,
                          num_local_experts=self._num_local_experts())
        engine.optimizer.reload_model_params()  # the fp32 main params must see the adapter

    # ---------------------------------------------------------------- checkpoints
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint(self, root: str, step: int) -> str:
        from megarl.engines.megatron.checkpoint import save_checkpoint

        self.residency.for_training(weight_sync_follows=False)
        return save_checkpoint(self.actor, root, step=step, before_commit=lambda: kill_point("save_checkpoint"))

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, root: str) -> int:
        from megarl.engines.megatron.checkpoint import load_checkpoint

        self.residency.for_training(weight_sync_follows=True)  # the trainer syncs the restored weights next
        return load_checkpoint(self.actor, root)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_hf(self, out_dir: str) -> dict:
        """The actor as a Hugging Face checkpoint in ``out_dir``, in its parameters' dtype: every rank takes
        part in the gather, rank 0 writes."""
        from megarl.models.embedded import resolve_model_path
        from megarl.weight_sync import DiscardTransport
        from megarl.weight_sync.hf_writer import HFCheckpointWriter

        self.residency.for_training(weight_sync_follows=False)
        tokenizer = self.cfg.actor_rollout_ref.model.tokenizer_path
        writer = (HFCheckpointWriter(out_dir, source_dir=self.model_path,
                                     tokenizer_dir=str(resolve_model_path(tokenizer)) if tokenizer else None)
                  if self.rank_info.rank == 0 else DiscardTransport())
        return self._send_model(writer, self.params_dtype).as_metrics("hf_export")

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_hf_adapter(self, out_dir: str) -> dict:
        """The actor's LoRA adapter as a PEFT adapter directory (``adapter_config.json`` +
        ``adapter_model.safetensors``) that peft and vLLM load; every rank gathers, rank 0 writes."""
        from megarl.weight_sync.adapters import gather_peft_adapter, peft_adapter_config, save_peft_adapter

        if self.lora is None:
            raise RuntimeError("save_hf_adapter: the actor has no LoRA adapters (model.lora.rank is 0)")
        self.residency.for_training(weight_sync_follows=False)
        named = gather_peft_adapter(self.actor.model, self.bridge, num_local_experts=self._num_local_experts(),
                                    dtype=self.params_dtype)
        if self.rank_info.rank == 0:
            save_peft_adapter(named, peft_adapter_config(self.lora, named, base_model=self.model_path), out_dir)
        return {"hf_adapter/tensors": float(len(named))}


class CriticWorker(MegatronRole):
    def __init__(self, cfg: MegarlConfig, *, total_steps: int):
        from megarl.engines.megatron.critic import CriticEngine

        c = cfg.critic
        lora = block_lora(c.model.lora, "critic.model.lora")
        self._bring_up(cfg, c.megatron, c.model_path or cfg.actor_rollout_ref.model.path, lora=lora is not None)
        config = self._new_transformer_config()
        self.replay_routing = c.megatron.router_replay.mode != "disabled"
        self.critic = CriticEngine(
            model_provider=self._provider(config, tie_embeddings=False), config=config,
            optimizer_config=megatron_optimizer_config(c.optim, c.megatron),
            lr_schedule=lr_schedule(c.optim, total_steps), ddp_config=ddp_config(c.megatron),
            micro_batch_size=c.ppo_micro_batch_size_per_gpu,
            micro_batching=MicroBatching(bool(c.use_sequence_packing), c.ppo_max_token_len_per_gpu),
            lora=lora_spec(lora, seed=c.megatron.seed), routing_replay=self.replay_routing,
        )
        self._load_critic_trunk()
        self.update_arguments = critic_update_arguments(cfg, self.rank_info.dp_size)

    def _load_critic_trunk(self) -> None:
        """The value model starts from the policy's transformer; its scalar head is freshly initialised."""
        from megarl.models.hf_checkpoint import load_hf_weights

        load_hf_weights([unwrap_model(chunk) for chunk in self.critic.model], self.model_path, self.bridge,
                        exclude_prefixes=("output_layer.",))
        self.critic.optimizer.reload_model_params()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT, reads=MODEL_INPUTS + ("routed_experts",))
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self.critic.compute_values(batch, replay_routing=self.replay_routing).cpu()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0,
              reads=MODEL_INPUTS + ("values", "returns", "generated_mask", "routed_experts"))
    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return self.critic.update_critic(batch, **self.update_arguments)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint(self, root: str, step: int) -> str:
        from megarl.engines.megatron.checkpoint import save_checkpoint

        return save_checkpoint(self.critic, root, step=step)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, root: str) -> int:
        from megarl.engines.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self.critic, root)


