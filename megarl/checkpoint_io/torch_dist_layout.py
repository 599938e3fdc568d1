"""megatron-core's ``torch_dist`` checkpoint format (what Megatron-LM's ``--load`` and
``dist_checkpointing.load`` read): what a checkpoint of a model holds, and where its iteration lives.

**What the checkpoint holds** is whatever megatron says a model's ``sharded_state_dict()`` is: its keys
(layers stacked on a leading axis for uniform decoders, per layer otherwise), global shapes, and how each
parameter maps onto them (SwiGLU's ``linear_fc1`` is two chunks, experts sit on an expert axis).
:func:`checkpoint_layout` asks megatron: it builds the model at TP = PP = EP = 1 on the meta device (no memory,
seconds even for 671B) and records every chunk as a :class:`TensorItem` -- key, global shape, offset, and
which global megarl parameter (the bridge's names) it is a view of. Models built at any other layout load
the result through megatron's resharding; vocabulary padding that differs by TP is megatron's
``allow_shape_mismatch`` on embeddings and output layers.

Writing is :mod:`megarl.checkpoint_io.torch_dist_writer`'s, reading :mod:`megarl.checkpoint_io.torch_dist_reader`'s.
Left out: optimizer state (conversion is of weights), FP8 storage (weights are written in bf16/fp32).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from megarl.checkpoint_io.files import RELEASE, TRACKER_FILE, tracked_iteration

ITERATION_DIR = "iter_0000000"
PARTS_DIR = "parts"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}

# what a conversion worker reading or writing this format imports: loaded once, in the fork server
WORKER_MODULES = ("megarl.checkpoint_io.torch_dist_writer", "megarl.checkpoint_io.torch_dist_reader",
                  "torch.distributed.checkpoint")


@dataclass(frozen=True)
class TensorItem:
    key: str  # megatron's sharded key (the DCP fully qualified name)
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # the leading axes megatron prepends (layer, expert) are 1 here
    param: str  # the bridge's global megatron name this chunk is a view of (a TP=PP=EP=1 model's parameter)
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, stride, storage offset) into that parameter

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk of the parameter ``full`` (contiguous, the parameter's shape)."""
        shape, stride, storage_offset = self.view
        return torch.as_strided(full, shape, stride, storage_offset).reshape(self.chunk_shape)


@dataclass(frozen=True)
class ObjectItem:
    key: str  # megatron's unique key of a ShardedObject (key/shard_<offset>_<shape>)
    payload: bytes  # torch.save of [the object], as megatron writes it


@dataclass
class CheckpointLayout:
    tensors: list[TensorItem]
    objects: list[ObjectItem]
    param_shapes: dict[str, tuple[int, ...]]

    def items_of(self) -> dict[str, list[TensorItem]]:
        by_param: dict[str, list[TensorItem]] = {}
        for item in self.tensors:
            by_param.setdefault(item.param, []).append(item)
        return by_param


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """megatron's parallel state for one process (TP = PP = EP = 1), set up if this process has none and torn
    down after; building a model needs it."""
    import torch.distributed as dist
    from datetime import timedelta

    from megatron.core import parallel_state as mpu

    created_group = not dist.is_initialized()
    if created_group:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    created_state = not mpu.model_parallel_is_initialized()
    if created_state:
        mpu.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if created_state:
            mpu.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


def checkpoint_layout(bridge) -> CheckpointLayout:
    """Every chunk megatron's ``sharded_state_dict`` describes for ``bridge``'s model (see the module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    from megarl.models.parallel_layout import ParallelLayout

    if not torch.cuda.is_available():
        from megarl.models.cpu_compat import enable_cpu_compat

        enable_cpu_compat()  # MLA and MoE layers assume CUDA while they are built
    with single_process_megatron():
        # the token dispatcher does not change the keys; the all-to-all one wants a CUDA stream at construction
        overrides = {"moe_token_dispatcher_type": "allgather"} if bridge.architecture.has_moe else {}
        config = bridge.transformer_config(layout=ParallelLayout(), perform_initialization=False,
                                           fused_kernels=False, **overrides)
        with torch.device("meta"):
            model = bridge.build_model(config=config, pre_process=True, post_process=True)
        sharded = model.sharded_state_dict()
        apply_factories(sharded)
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(b): n for n, b in model.named_buffers()})
    wanted = set(bridge.iter_global_mcore_names())
    tensors, objects, seen = [], [], set()
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor):
            if value.flattened_range is not None or any(r != 0 for r in _replica(value.replica_id)):
                raise RuntimeError(f"{value.key}: a TP=PP=EP=1 model should hold whole, main-replica chunks")
            base = value.data if value.data._base is None else value.data._base
            param = names.get(id(base))
            if param not in wanted:
                raise RuntimeError(f"{value.key} is a view of {param!r}, which the {bridge.hf_architecture} bridge "
                                   f"does not map")
            seen.add(param)
            chunk_shape = (1,) * value.prepend_axis_num + tuple(value.local_shape)
            tensors.append(TensorItem(value.key, tuple(value.global_shape), tuple(value.global_offset), chunk_shape,
                                      param, (tuple(value.data.shape), tuple(value.data.stride()),
                                              value.data.storage_offset())))
        elif isinstance(value, ShardedObject):
            buffer = io.BytesIO()
            torch.save([value.data], buffer)  # megatron stores a key's objects as one list
            objects.append(ObjectItem(value.unique_key, buffer.getvalue()))
    missing = sorted(wanted - seen)
    if missing:
        raise RuntimeError(f"megatron's sharded state dict has no chunk of {missing[:5]}")
    shapes = {n: tuple(p.shape) for n, p in list(model.named_parameters()) + list(model.named_buffers())
              if n in wanted}
    return CheckpointLayout(tensors, objects, shapes)


def _replica(replica_id) -> tuple:
    return replica_id if isinstance(replica_id, tuple) else (replica_id,)


def iteration_dir_name(iteration: int) -> str:
    return "release" if iteration == RELEASE else f"iter_{iteration:07d}"


def find_iteration_dir(path: str) -> str:
    """``path`` itself when it holds a ``.metadata``; else the iteration directory its tracker file names."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    iteration = tracked_iteration(path)
    if iteration is None:
        raise FileNotFoundError(f"{path}: neither a torch_dist checkpoint (.metadata) nor a directory with "
                                f"{TRACKER_FILE}")
    found = os.path.join(path, iteration_dir_name(iteration))
    if not os.path.isfile(os.path.join(found, ".metadata")):
        raise FileNotFoundError(f"{path}'s tracker file names {iteration_dir_name(iteration)}, which holds no "
                                f".metadata")
    return found


