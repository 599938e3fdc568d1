"""Save and load a MegatronEngine with megatron dist-checkpointing (resharding-capable, any TP/PP/DP).

Layout under ``root``::

    root/iter_0000012/        one dist-checkpoint: model chunks, optimizer, LR scheduler, per-rank RNG
    root/latest_checkpointed_iteration.txt   the step of the newest complete checkpoint (written last;
                                             Megatron-LM's tracker file, so Megatron-LM's --load reads root)

A save writes ``root/iter_XXXXXXX`` in place and, after every rank finished, global rank 0 writes the tracker file
(atomically, last): it is what says this engine's part is complete. Atomicity of a checkpoint is its caller's: the
trainer has every role write into one staging directory that becomes ``global_step_N`` by one rename
(:mod:`megarl.trainer.checkpoint`), so there is one commit protocol, not one per engine nested in another.
``root`` must be a filesystem shared by all ranks. Strategy: megatron's ``torch_dist`` format
(torch.distributed.checkpoint) for the sharded tensors, written in process (:func:`in_process_save_strategy`),
which works on CPU/gloo as well as on GPU/NCCL; model weights saved at one layout load at another.
RNG states are saved per (PP, TP) rank (a ``ShardedObject`` replicated over DP) and only restored when
the layout matches. Leaves out: async save, and HF-format export (see ``converters/``).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megarl.checkpoint_io.files import TRACKER_FILE, mark_latest, tracked_iteration
from megarl.checkpoint_io.torch_dist_layout import iteration_dir_name
from megarl.models.cpu_compat import cuda_tensors_on_cpu



def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _ensure_optimizer_state(optimizer) -> None:
    """A distributed optimizer that has not stepped yet has no Adam state to describe for loading; give it
    placeholder state (megatron's own helper) that the load then overwrites in place."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        init_dummy = getattr(inner, "_init_optimizer_states_with_dummy_values", None)
        if init_dummy is not None and not inner.optimizer.state:
            init_dummy()


def _restore_adam_steps(optimizer) -> None:
    """torch Adam keeps its step count per parameter; megatron's distributed optimizer saves it once per
    param group and, when the state already existed (our placeholder state), leaves the per-parameter
    counts at the placeholder's 1. Copy the group's count back, or bias correction would restart."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _model_state(engine, chunk) -> dict:
    """The chunk's sharded state; with LoRA only what trains (the adapters, a critic's head): the frozen base
    comes back from where the run starts (the HF checkpoint or the seeded initialisation), so a 32B LoRA
    checkpoint is megabytes, not 64 GB."""
    state = _unwrap(chunk).sharded_state_dict()
    if getattr(engine, "lora", None) is None:
        return state
    return {key: value for key, value in state.items()
            if isinstance(getattr(value, "data", None), torch.Tensor) and value.data.requires_grad}


def _sharded_state_dict(engine, *, is_loading: bool, with_optimizer: bool, with_rng: bool) -> dict:
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state: dict = {}
    if len(engine.model) == 1:
        state["model"] = _model_state(engine, engine.model[0])
        model_state = state["model"]
    else:
        model_state = {}
        for i, chunk in enumerate(engine.model):
            state[f"model{i}"] = _model_state(engine, chunk)
            model_state.update(state[f"model{i}"])
    if with_optimizer and engine.optimizer is not None:
        # torch_dist cannot save the flattened ranges of 'fully_sharded_model_space' (the distributed
        # optimizer's default); 'fully_reshardable' stores the canonical per-parameter state instead,
        # so the checkpoint still loads at another TP/PP/DP layout.
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        if is_loading:
            _ensure_optimizer_state(engine.optimizer)
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                                 metadata=metadata)
        state["lr_scheduler"] = engine.lr_scheduler.state_dict()
    if with_rng:
        pp, tp = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        pp_size, tp_size = mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()
        state["rng_state"] = ShardedObject(
            # CP peers share the TP rank's seeds: one of them (like one DP replica) writes the state
            "rng_state", [_rng_state()], (pp_size, tp_size), (pp, tp),
            replica_id=mpu.get_data_parallel_rank(with_context_parallel=True),
        )
        state["rng_layout"] = {"pp": pp_size, "tp": tp_size}
    return state


def in_process_save_strategy():
    """megatron's ``torch_dist`` format, written by torch.distributed.checkpoint's plain file writer in
    this process.

    megatron's own writer (``FileSystemWriterAsync``), also when saving synchronously, starts a
    ``multiprocessing`` Manager through *spawn* for its results queue (a fresh interpreter that re-imports
    the worker's main module: ~10 s for a 1.4 MB model inside a Ray worker on the H200) and, before 0.19,
    forks writer processes from the training process; the Manager then outlives a killed worker. The
    bytes and the metadata are the same, so megatron's loader reads what this writes.
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(sharded_state_dict, False),
                     storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return InProcessTorchDistSave("torch_dist", 1)


def save_checkpoint(engine, root: str, *, step: int, before_commit=None) -> str:
    """Collective over all ranks: write ``root/iter_<step>`` and then point the tracker file at it. Returns its
    path. ``before_commit()`` runs on every rank once the shards are written and before the tracker (a test's
    crash point: the hardest moment to die)."""
    from megatron.core import dist_checkpointing

    final = os.path.join(root, iteration_dir_name(step))
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(final, ignore_errors=True)  # an earlier save of the same step (a test's, or a crashed run's)
        os.makedirs(final)
    dist.barrier()
    with cuda_tensors_on_cpu():
        state = _sharded_state_dict(engine, is_loading=False, with_optimizer=True, with_rng=True)
        state["step"] = step
        dist_checkpointing.save(state, final, sharded_strategy=in_process_save_strategy())
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if dist.get_rank() == 0:
        mark_latest(root, step)
    dist.barrier()
    return final


def latest_step(root: str) -> Optional[int]:
    """The step named by ``root``'s tracker file (Megatron-LM's ``latest_checkpointed_iteration.txt``, or
    ``latest``), or None when no complete checkpoint exists."""
    return tracked_iteration(root)


def has_complete_checkpoint(root: str) -> bool:
    return latest_step(root) is not None


_SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def _report_schedule_changes(scheduler, saved: dict, path: str) -> None:
    """Say on rank 0 what a resume takes from where: the LR schedule from the config (see
    ``build_lr_scheduler``), the position in it, the weights and the optimizer state from the checkpoint."""
    if dist.get_rank() != 0:
        return
    changed = [f"{name} {saved[name]} -> {getattr(scheduler, name)}" for name in _SCHEDULE_FIELDS
               if name in saved and saved[name] != getattr(scheduler, name)]
    print(f"[megarl] resuming from {path}: weights, optimizer state and schedule position (step "
          f"{saved.get('num_steps')}) from the checkpoint; LR schedule from the config"
          + (f" (changed since the checkpoint: {', '.join(changed)})" if changed else ""), flush=True)


def load_checkpoint(engine, root: str, *, step: Optional[int] = None, load_optimizer: bool = True,
                    load_rng: bool = True) -> int:
    """Collective: restore ``engine`` from ``root`` (its tracker file's step when ``step`` is None). Returns the
    step. ``root`` may be any torch_dist checkpoint directory with a tracker file: megarl's, Megatron-LM's, or
    converters/hf_to_mcore.py's output.

    A frozen engine (reference) or ``load_optimizer=False`` loads weights only; RNG states are restored only
    when the checkpoint was written at the same TP/PP layout.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {root} (missing {TRACKER_FILE!r} marker)")
    path = os.path.join(root, iteration_dir_name(step))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    with_optimizer = load_optimizer and engine.optimizer is not None
    with cuda_tensors_on_cpu():
        common = dist_checkpointing.load_common_state_dict(path)
        layout = common.get("rng_layout")
        same_layout = layout == {"pp": mpu.get_pipeline_model_parallel_world_size(),
                                 "tp": mpu.get_tensor_model_parallel_world_size()}
        request = _sharded_state_dict(engine, is_loading=True, with_optimizer=with_optimizer,
                                      with_rng=load_rng and same_layout)
        request.pop("rng_layout", None)
        loaded = dist_checkpointing.load(request, path)
        for i, chunk in enumerate(engine.model):
            key = "model" if len(engine.model) == 1 else f"model{i}"
            # with LoRA the checkpoint holds what trains; the frozen base stays as the run started it
            _unwrap(chunk).load_state_dict(loaded[key], strict=getattr(engine, "lora", None) is None)
        if with_optimizer:
            with torch.no_grad():  # the distributed optimizer copies into fp32 main params that are leaves
                engine.optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(engine.optimizer)
            _report_schedule_changes(engine.lr_scheduler, loaded["lr_scheduler"], path)
            # megatron's param groups carry their own max_lr/min_lr, restored with the optimizer state above;
            # the schedule reads those first, so they take the config's values too
            for group in engine.optimizer.param_groups:
                group.update(max_lr=engine.lr_scheduler.max_lr, min_lr=engine.lr_scheduler.min_lr)
            engine.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
        if load_rng and same_layout:
            _set_rng_state(loaded["rng_state"][0])
    return step
