"""MoE routing replay: megatron's routers take the experts a batch names instead of choosing their own.

Why: the trainer recomputes log-probs with its own routers, which pick other experts than the rollout engine
did for some tokens (bf16 kernels differ, and one flipped top-k choice changes a token's whole MLP). The
rollout-vs-trainer gap that follows is what collapses long MoE RL runs. Replaying the rollout's routing in
the old-log-prob pass and the update (R3), or the old-log-prob pass's own routing in the update (R2), removes
that source of mismatch (verl's ``router_replay.mode``).

The batch field ``routed_experts`` is ``[B, P + R, L_moe, K]`` integer expert ids aligned with ``input_ids``
(position t: the experts of the token at t, for each MoE layer in layer order), ``-1`` where nothing is known:
padding, a row's last token (no engine computes it) and prompt tokens an engine served from its prefix cache.
:mod:`megarl.engines.megatron.packing` carries it into each micro-batch's token layout (padded rows, a packed
stream, a context-parallel rank's positions); :meth:`RoutingReplay.router_layout` cuts that to the tokens one
router sees (sequence-major ``[s, b]`` flattened; this TP rank's share under sequence parallelism). An unknown
entry keeps the router's own choice, so padding and the last token route exactly as without replay.

Megatron's top-k routing asks ``router.router_replay.get_replay_topk(...)`` for its choice when the attribute
is set (megatron-core 0.16 and 0.19 alike); :class:`LayerReplay` is that object, one per router, installed by
:class:`RoutingReplay` (megatron's own ``RouterReplay`` keeps one process-wide list of every router, which two
models in one worker, actor and reference, would mix). Activation recomputation calls the routers again inside
the backward pass: each forward queues its targets, and after the forward the routers switch to popping that
queue, in the order the schedule runs the backward passes (the forward order, for every megatron schedule).
"""

from __future__ import annotations

import collections
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megarl.batch import UNKNOWN_EXPERT
from megarl.engines.megatron.parallel import device_for_this_process


class LayerReplay:
    """One router's routing in a pass: its own top-k, or the batch's experts where known (``replay``); the
    choice kept (``record``); and how often its own choice differs from the batch's (``compare``, any pass
    with targets). After the forward (``in_backward``) a recomputation pops the targets its forward queued."""

    def __init__(self, layer_number: int):
        self.layer_number = layer_number  # megatron 0.19 writes it too
        self.replay = self.record = False
        self.in_backward = False
        self.target: Optional[torch.Tensor] = None
        self.backward_targets: collections.deque = collections.deque()
        self.recorded: list[torch.Tensor] = []
        self.differing = self.compared = 0  # tokens whose expert set differs from the batch's / tokens compared

    def set_target(self, target: Optional[torch.Tensor]) -> None:
        self.target, self.in_backward = target, False
        if target is not None:
            self.backward_targets.append(target)

    def clear(self) -> None:
        self.replay = self.record = self.in_backward = False
        self.target = None
        self.backward_targets.clear()
        self.recorded.clear()
        self.differing = self.compared = 0

    def _current_target(self) -> Optional[torch.Tensor]:
        if not self.in_backward:
            return self.target
        if self.target is None:
            return None
        if not self.backward_targets:
            raise RuntimeError(f"routing replay: layer {self.layer_number} recomputed in the backward pass more "
                               "often than it ran forward")
        return self.backward_targets.popleft()

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self._current_target()
        chosen = own
        if target is not None:
            if target.shape != own.shape:
                raise ValueError(f"routing replay: layer {self.layer_number} routes {tuple(own.shape)} token x "
                                 f"top-k but the batch gives {tuple(target.shape)}")
            target = target.to(own.device, torch.long)
            known = target[:, 0] >= 0
            if not self.in_backward:
                differs = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & known
                self.differing = self.differing + differs.sum()  # tensors: no device sync per layer
                self.compared = self.compared + known.sum()
            if self.replay:
                chosen = torch.where(known[:, None], target, own)
        if self.record and not self.in_backward:
            self.recorded.append(chosen.detach().to(torch.int16))  # kept for the whole pass: a quarter of int64
        if chosen is own:
            return values, own
        return scores.gather(1, chosen), chosen


def moe_layer_numbers(config) -> list[int]:
    """The 1-based numbers of the MoE layers of a megatron ``TransformerConfig``, in order."""
    freq = config.moe_layer_freq
    layers = config.num_layers
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(layers)]
    else:
        pattern = list(freq)
    if len(pattern) != layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for {layers} layers")
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]


class RoutingReplay:
    """The routers of one engine's model chunks: :meth:`start` a pass (replay, record, or only compare),
    :meth:`before_forward` / :meth:`after_forward` around each micro-batch's forward of one chunk, then
    :meth:`take_recorded` / :meth:`take_mismatch` and :meth:`finish`."""

    def __init__(self, model_chunks: Iterable[torch.nn.Module], config):
        from megatron.core.transformer.moe.router import TopKRouter

        if getattr(config, "moe_router_fusion", False):
            raise ValueError("routing replay needs megatron's unfused router (moe_router_fusion=False): the fused "
                             "kernel picks its experts itself")
        self.sequence_parallel = bool(config.sequence_parallel)
        self.moe_layers = moe_layer_numbers(config)
        ordinal = {layer: index for index, layer in enumerate(self.moe_layers)}
        self._chunk_layers: dict[int, list[tuple[int, LayerReplay]]] = {}
        for chunk in model_chunks:
            entries = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.layer_number not in ordinal:
                        raise ValueError(f"routing replay: router of layer {module.layer_number} is not one of "
                                         f"the MoE layers {self.moe_layers}")
                    replay = LayerReplay(module.layer_number)
                    module.router_replay = replay
                    entries.append((ordinal[module.layer_number], replay))
            self._chunk_layers[id(chunk)] = entries
        self.replay = False

    @property
    def _layers(self) -> list[tuple[int, LayerReplay]]:
        return [entry for entries in self._chunk_layers.values() for entry in entries]

    def _chunk(self, model: torch.nn.Module) -> list[tuple[int, LayerReplay]]:
        for candidate in (model, getattr(model, "module", None)):
            if candidate is not None and id(candidate) in self._chunk_layers:
                return self._chunk_layers[id(candidate)]
        raise KeyError("routing replay: a model chunk this engine did not build")

    def start(self, *, replay: bool = False, record: bool = False) -> None:
        """Begin a pass: ``replay`` the micro-batches' ``routed_experts`` (where known), ``record`` what the
        routers choose; whenever a micro-batch carries ``routed_experts``, the routers' own choice is compared
        with it (:meth:`take_mismatch`)."""
        for _, layer in self._layers:
            layer.clear()
            layer.replay, layer.record = replay, record
        self.replay = replay

    def finish(self) -> None:
        self.start()

    def new_schedule(self) -> None:
        """A schedule run begins: targets queued for recomputation in an earlier run are not needed (without
        recomputation nothing pops them)."""
        for _, layer in self._layers:
            layer.backward_targets.clear()

    def before_forward(self, model: torch.nn.Module, mb: dict) -> None:
        layers = self._chunk(model)
        routed = mb.get("routed_experts")
        if routed is None:
            if self.replay:
                raise ValueError("routing replay: the micro-batch carries no routed_experts (the rollout engine "
                                 "returned none, or the batch lost them)")
            for _, layer in layers:
                layer.set_target(None)
            return
        per_router = self.router_layout(routed)
        for ordinal, layer in layers:
            layer.set_target(per_router[:, ordinal])

    def after_forward(self, model: torch.nn.Module) -> None:
        for _, layer in self._chunk(model):
            layer.in_backward = True

    def take_mismatch(self) -> Optional[float]:
        """Of the (token, MoE layer) pairs with a known batch routing, the fraction whose expert set the routers
        would have chosen differently, over every rank (tensor-parallel ranks without sequence parallelism see
        the same tokens: counted alike in both sums, the ratio holds); None when nothing was compared."""
        device = device_for_this_process()
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for _, layer in self._layers:
            counts += torch.stack([torch.as_tensor(layer.differing), torch.as_tensor(layer.compared)]).to(counts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        differing, compared = counts.tolist()
        return differing / compared if compared else None

    def router_layout(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` per-token values of a micro-batch (this CP rank's positions) -> ``[n, ...]`` in the
        order this rank's routers see the tokens: sequence-major, and this TP rank's share of the sequence
        under sequence parallelism."""
        from megatron.core import parallel_state as mpu

        seq_major = tokens.transpose(0, 1)
        if self.sequence_parallel:
            tp = mpu.get_tensor_model_parallel_world_size()
            if seq_major.shape[0] % tp:
                raise ValueError(f"sequence parallelism splits {seq_major.shape[0]} positions over {tp} ranks")
            seq_major = seq_major.chunk(tp, dim=0)[mpu.get_tensor_model_parallel_rank()]
        return seq_major.reshape(-1, *tokens.shape[2:])

    def take_recorded(self, micro_batches: list[dict], rows: int, seq_len: int, topk: int) -> torch.Tensor:
        """What the routers chose in a ``record`` pass, as ``[rows, seq_len, L_moe, topk]`` rows of the batch
        shard (``-1`` where no token was routed), identical on every rank of the model-parallel replica. Each
        micro-batch needs ``token_codes`` (row * seq_len + position per token, -1 on padding; packing.py)."""
        from megatron.core import parallel_state as mpu

        device = micro_batches[0]["input_ids"].device
        # int32: NCCL reduces no int16
        out = torch.full((rows * seq_len, len(self.moe_layers), topk), UNKNOWN_EXPERT, dtype=torch.int32,
                         device=device)
        layers = self._layers
        for _, layer in layers:
            if len(layer.recorded) != len(micro_batches):
                raise RuntimeError(f"routing replay: layer {layer.layer_number} recorded "
                                   f"{len(layer.recorded)} forwards for {len(micro_batches)} micro-batches")
        for index, mb in enumerate(micro_batches):
            codes = self.router_layout(mb["token_codes"])  # the same tokens for every router of the rank
            real = codes >= 0
            for ordinal, layer in layers:
                out[codes[real], ordinal] = layer.recorded[index][real].to(device, torch.int32)
        # Sequence and context parallelism split the tokens, pipeline stages the layers: each entry was
        # written by exactly one rank of the replica, the others hold -1.
        for group in (mpu.get_tensor_and_context_parallel_group(), mpu.get_pipeline_model_parallel_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out.view(rows, seq_len, len(self.moe_layers), topk)
