"""Per-rank body of the converted-checkpoint logits test (module-level so spawned ranks can import it):
each model built through the bridge for the given layout, the torch_dist checkpoint loaded with plain
megatron-core, full-vocab logits on the last stage from the bridge tests' forward-only pipeline schedule.
"""

from __future__ import annotations


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
