"""The rollout side of a worker: building a rank's rollout engine from the config, and ``RolloutWorker``, a
rollout replica on its own device (``trainer.placement=separate``) fed weights by training rank 0."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megarl.config.schema import MegarlConfig
from megarl.controller.profiling import ProfiledWorker
from megarl.controller.dispatch import Collect, Dispatch, register
from megarl.controller.engine_specs import DTYPES
from megarl.controller.fault_injection import kill_point
from megarl.controller.rollout_replicas import RolloutReplica, generate_in_replica


def check_rollout_tensor_parallel(cfg: MegarlConfig, *, colocated: bool) -> None:
    """Rollout replicas spanning several ranks exist for vLLM and SGLang inside the colocated actor group only."""
    rollout = cfg.actor_rollout_ref.rollout
    tp = rollout.tensor_model_parallel_size
    if tp > 1 and (rollout.name not in ("vllm", "sglang") or not colocated):
        raise NotImplementedError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: rollout replicas spanning several ranks "
            f"need actor_rollout_ref.rollout.name=vllm or sglang and trainer.placement=colocate (got "
            f"name={rollout.name!r}, placement={'colocate' if colocated else 'separate'})")


def build_rollout_engine_for(cfg: MegarlConfig, model_path: str, *, replica: RolloutReplica, colocated: bool,
                             device: str, local_device_index: Optional[int], adapter_rank: Optional[int] = None):
    """This rank's rollout engine, seeded by its ``replica``'s index (the same on all ranks of a replica that spans
    several ranks, see :mod:`megarl.controller.rollout_replicas`). Callers have run
    :func:`check_rollout_tensor_parallel`. vLLM runs in this process (its engine core too), so weight
    buckets reach it as device tensors, and a replica over several ranks is a shard in each; SGLang runs its
    scheduler in a process of its own and maps them by CUDA IPC, and a replica over several ranks is one engine in
    its first rank (:mod:`megarl.controller.first_rank_replica`). Colocated on a GPU either is built with sleep
    mode, to hand the device to training between rollouts (``rollout.free_cache_engine``). ``adapter_rank``: the
    engine serves a LoRA adapter of that rank (vLLM's LoRA; the HF engine needs nothing to serve one)."""
    from megarl.engines.rollout.factory import build_rollout_engine

    seed_offset = replica.index
    rollout = cfg.actor_rollout_ref.rollout
    engine_kwargs = {"dtype": DTYPES[rollout.dtype], "load_format": rollout.load_format}
    if rollout.name in ("vllm", "sglang"):  # the production engines: sized, seeded and put to sleep alike
        engine_kwargs.update(gpu_memory_utilization=rollout.gpu_memory_utilization,
                             enforce_eager=rollout.enforce_eager,
                             max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                             seed=cfg.trainer.seed + seed_offset,
                             local_device_index=local_device_index if device == "cuda" else None,
                             enable_sleep_mode=colocated and device == "cuda" and rollout.free_cache_engine)
    if rollout.name == "vllm":  # its engine core runs in this process: weight buckets reach it as device tensors
        engine_kwargs.update(in_process=True, tensor_parallel_size=rollout.tensor_model_parallel_size)
        if rollout.kv_cache_memory_mb:
            engine_kwargs["kv_cache_memory_bytes"] = rollout.kv_cache_memory_mb * 2**20
        if adapter_rank:
            engine_kwargs["lora_rank"] = adapter_rank
        if rollout.quantization:  # vLLM quantizes what it loads, and again at every weight sync (layerwise)
            engine_kwargs["quantization"] = rollout.quantization
        engine_kwargs["engine_args"] = dict(rollout.engine_kwargs.vllm)  # refused where megarl sets the option
    if rollout.name == "sglang":
        engine_kwargs["server_args"] = dict(rollout.engine_kwargs.sglang)  # refused where megarl sets the option
    if rollout.enable_rollout_routing_replay:
        engine_kwargs["return_routed_experts"] = True
    if rollout.name == "sglang" and replica.size > 1:
        from megarl.controller.first_rank_replica import serve_from_first_rank
        from megarl.engines.rollout.sglang_compat import serialize_for_tp_worker

        return serve_from_first_rank(
            replica, lambda visible: build_rollout_engine(rollout.name, model_path, **engine_kwargs,
                                                          tensor_parallel_size=replica.size, visible_devices=visible),
            sleeps=engine_kwargs["enable_sleep_mode"], serialize_bucket=serialize_for_tp_worker,
            local_device_index=local_device_index if device == "cuda" else None)
    return build_rollout_engine(rollout.name, model_path, **engine_kwargs)


class WeightReceiver(ProfiledWorker):
    """The receiving side of a weight sync to separate rollout workers: what training rank 0 calls on each of
    them, through :class:`~megarl.controller.worker_group.PeerGroup` (:mod:`megarl.controller.peer_transports`).
    A subclass says where the tensors go (:meth:`apply_bucket`, :meth:`apply_finished`)."""

    weight_group = None  # the broadcast transport's process group with training rank 0

    def apply_bucket(self, bucket) -> None:
        raise NotImplementedError

    def apply_finished(self) -> None:
        raise NotImplementedError

    def weight_device(self) -> torch.device:
        """Where received buckets land (and, by its kind, gloo or NCCL for the weight group)."""
        return torch.device("cpu")

    def load_weight_bucket(self, bucket) -> None:
        """One bucket of ``(name, tensor)`` pairs handed over through Ray's object store."""
        kill_point("rollout_receive_weights")
        self.apply_bucket(bucket)

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Join the broadcast group rooted at training rank 0: this worker's rank in it is its rank in its own
        group + 1 (the group's rank comes with the worker's environment, see :mod:`megarl.controller.worker_env`)."""
        from megarl.weight_sync.broadcast import create_group

        rank = int(os.environ["RANK"]) + 1
        self.weight_group = create_group(host, port, rank, world_size, self.weight_device().type, timeout_s)

    def receive_weight_bucket(self, layout) -> None:
        """One bucket broadcast over the weight group; ``layout`` (names, shapes, dtypes) came ahead by RPC."""
        from megarl.weight_sync.broadcast import receive_bucket

        kill_point("rollout_receive_weights")
        self.apply_bucket(receive_bucket(self.weight_group, layout, self.weight_device()))

    def finish_weight_update(self) -> None:
        self.apply_finished()


class RolloutWorker(WeightReceiver):
    """Separate placement: a rollout engine replica on its own device, fed weights by the trainer."""

    def __init__(self, cfg: MegarlConfig):
        from megarl.controller.worker_env import read_worker_context
        from megarl.models.embedded import resolve_model_path

        self.context = read_worker_context()
        if self.context.device == "cuda":
            torch.cuda.set_device(self.context.local_device_index)
        check_rollout_tensor_parallel(cfg, colocated=False)
        self.replica = RolloutReplica(index=self.context.rank, size=1, group=None)
        self.engine = build_rollout_engine_for(cfg, str(resolve_model_path(cfg.actor_rollout_ref.model.path)),
                                               replica=self.replica, colocated=False, device=self.context.device,
                                               local_device_index=self.context.local_device_index)

    @register(dispatch=Dispatch.ALL_TO_ALL, collect=Collect.ALL)
    def generate(self, prompt_token_ids: list[list[int]], sampling, multi_modal_inputs=None) -> list:
        kill_point("rollout_generate")
        return generate_in_replica(self.engine, prompt_token_ids, sampling, self.replica, multi_modal_inputs)

    def weight_device(self) -> torch.device:
        if self.context.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def apply_bucket(self, bucket) -> None:
        self.engine.update_weights(bucket)

    def apply_finished(self) -> None:
        self.engine.finish_weight_update()
