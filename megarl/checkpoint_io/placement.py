"""Which (pp, ep) rank holds a global megatron parameter, and under which rank-local name.

The pipeline split is even (``num_layers % pp == 0``), as megatron does without
``decoder_first/last_pipeline_num_layers``; experts are split evenly over EP ranks. Non-expert
parameters are placed on ``ep=0`` only (see :mod:`megarl.models.mcore_checkpoint`). With tied
embeddings and PP > 1 the last stage also holds ``output_layer.weight``, a copy of the embedding
(megatron allocates it there and keeps it in sync), so it is placed twice.

Left out: uneven pipeline splits and virtual pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    pp_rank: int
    ep_rank: int
    local_name: str


def pipeline_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """``[(layer_offset, num_layers_this_stage)]`` per stage."""
    if pp < 1 or num_layers % pp:
        raise ValueError(f"num_hidden_layers={num_layers} does not split evenly over pp={pp} pipeline stages")
    per_stage = num_layers // pp
    return [(stage * per_stage, per_stage) for stage in range(pp)]


def num_local_experts(num_experts: int, ep: int) -> int | None:
    if num_experts == 0:
        if ep != 1:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model; this one has no experts")
        return None
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split evenly over ep={ep} expert-parallel ranks")
    return num_experts // ep


def place_global_tensor(bridge, global_name: str, *, pp: int, ep: int) -> list[Placement]:
    stages = pipeline_layers(bridge.dims.num_layers, pp)
    per_rank = num_local_experts(bridge.dims.num_experts, ep)
    ep_ranks = range(ep) if bridge.is_expert_param(global_name) else range(1)
    placements = []
    for pp_rank, (offset, count) in enumerate(stages):
        for ep_rank in ep_ranks:
            local = bridge.global_to_local_name(
                global_name, layer_offset=offset, num_layers_this_stage=count, ep_rank=ep_rank,
                num_local_experts=per_rank, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
            if local is not None:
                placements.append(Placement(pp_rank, ep_rank, local))
    if bridge.tied_embeddings and pp > 1 and global_name == "embedding.word_embeddings.weight":
        placements.append(Placement(pp - 1, 0, "output_layer.weight"))
    if not placements:
        raise ValueError(f"{global_name}: no pipeline stage / expert rank holds it (pp={pp}, ep={ep})")
    return placements
