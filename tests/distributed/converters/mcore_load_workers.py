"""Per-rank body of the converted-checkpoint logits test (module-level so spawned ranks can import it).

Builds each model through the bridge for the given layout, loads the CONVERTED per-rank checkpoint with
:func:`~megarl.models.mcore_checkpoint.load_mcore_checkpoint_into` (not the HF loader), and runs the
bridge tests' forward-only pipeline schedule to get full-vocab logits on the last stage.
"""

from __future__ import annotations


def converted_checkpoint_logits(rank: int, layout_kwargs: dict, ckpt_dirs: dict, tokens: dict):
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.mcore_checkpoint import load_mcore_checkpoint_into, read_metadata
    from tests.distributed.models.bridge_workers import build_chunks, forward_logits

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=11)
    results = {}
    for arch, ckpt_dir in ckpt_dirs.items():
        bridge = ModelBridge.from_hf_config(read_metadata(ckpt_dir).hf_config, spec="local")
        overrides = {}
        if bridge.architecture.has_moe and layout.expert_parallel > 1:
            # megatron's alltoall dispatcher passes split sizes gloo's all_to_all_single does not accept
            overrides["moe_token_dispatcher_type"] = "allgather"
        config = bridge.transformer_config(layout=layout, perform_initialization=False, **overrides)
        chunks = build_chunks(bridge, config)
        loaded = load_mcore_checkpoint_into(
            chunks, ckpt_dir, tp_rank=mpu.get_tensor_model_parallel_rank(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(), ep_rank=mpu.get_expert_model_parallel_rank())
        results[arch] = dict(logits=forward_logits(chunks, tokens[arch], bridge.dims.vocab_size), loaded=loaded)
    return results


def strict_load_errors(rank: int, ckpt_dir: str):
    """Load a tp=2 checkpoint into models that do not match it; return the error messages."""
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.mcore_checkpoint import load_mcore_checkpoint_into, read_metadata
    from tests.distributed.models.bridge_workers import build_chunks

    layout = ParallelLayout(tensor_parallel=2)
    initialize_megatron_parallel(layout=layout, seed=11)
    errors = []
    tp_rank = mpu.get_tensor_model_parallel_rank()
    hf = read_metadata(ckpt_dir).hf_config
    for variant in (dict(hf, num_hidden_layers=3), dict(hf, intermediate_size=2 * hf["intermediate_size"])):
        bridge = ModelBridge.from_hf_config(variant, spec="local")
        chunks = build_chunks(bridge, bridge.transformer_config(layout=layout, perform_initialization=False))
        try:
            load_mcore_checkpoint_into(chunks, ckpt_dir, tp_rank=tp_rank, pp_rank=0, ep_rank=0)
        except ValueError as err:
            errors.append(str(err))
    return errors


def torch_dist_checkpoint_logits(rank: int, layout_kwargs: dict, ckpt_dirs: dict, tokens: dict):
    """Build each model for the given layout and load the torch_dist checkpoint with plain megatron-core
    (``dist_checkpointing.load`` of the models' own sharded state dicts): no megarl loader involved."""
    import json
    import os

    from megatron.core import dist_checkpointing

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from tests.distributed.models.bridge_workers import build_chunks, forward_logits

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=11)
    results = {}
    for arch, ckpt_dir in ckpt_dirs.items():
        with open(os.path.join(ckpt_dir, "megarl_conversion.json")) as handle:
            hf_config = json.load(handle)["hf_config"]
        bridge = ModelBridge.from_hf_config(hf_config, spec="local")
        overrides = {}
        if bridge.architecture.has_moe and layout.expert_parallel > 1:
            overrides["moe_token_dispatcher_type"] = "allgather"  # gloo's all_to_all_single: see above
        config = bridge.transformer_config(layout=layout, perform_initialization=False, **overrides)
        chunks = build_chunks(bridge, config)
        request = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
        loaded = dist_checkpointing.load(request, os.path.join(ckpt_dir, "iter_0000000"))
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
        results[arch] = dict(logits=forward_logits(chunks, tokens[arch], bridge.dims.vocab_size),
                             loaded=sum(len(loaded[f"model{i}"]) for i in range(len(chunks))))
    return results
