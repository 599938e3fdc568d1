"""Per-rank body of the reward-model engine test (module level, so spawned processes can import it)."""

from __future__ import annotations


def rm_scores_for_layouts(rank: int, runs: list, hf_dirs: dict, batch) -> dict:
    """``runs``: [(label, layout kwargs, sequence packing)]; every checkpoint of ``hf_dirs`` scored at each."""
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.engines.megatron.reward_model import RewardModelEngine
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights

    results = {}
    for label, layout_kwargs, packing in runs:
        layout = ParallelLayout(**layout_kwargs)
        initialize_megatron_parallel(layout=layout, seed=11)
        for arch, hf_dir in hf_dirs.items():
            bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
            config = bridge.transformer_config(layout=layout, perform_initialization=False)

            def provide(pre_process, post_process, vp_stage=None):
                return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process,
                                          vp_stage=vp_stage, tie_embeddings=False)

            engine = RewardModelEngine(model_provider=provide, config=config, micro_batch_size=3,
                                       micro_batching=MicroBatching(packing, 40 if packing else None))
            load_hf_weights(engine.model, hf_dir, bridge)
            results[(label, arch)] = engine.compute_scores(batch)
    return results
