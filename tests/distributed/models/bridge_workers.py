"""Per-rank bodies for the bridge tests (module-level so spawned processes can import them).

``mcore_logits_for_layout`` brings up megatron for one layout, then for each tiny HF checkpoint builds
the model chunks through the bridge, loads the HF weights and runs a forward-only pipeline schedule
(``get_forward_backward_func`` with the Megatron ``forward_step_func(data_iterator, model)`` contract);
the last stage gathers the vocab-parallel logits over TP and returns them, trimmed to the HF vocab.
"""

from __future__ import annotations

import time

import torch


# (architecture, layout) pairs a two-rank weight-sync test covers: TP split, pipeline stages, expert parallelism
TWO_RANK_LAYOUTS = [
    ("qwen2", dict(tensor_parallel=2)),
    ("llama", dict(pipeline_parallel=2)),
    ("qwen3_moe", dict(expert_parallel=2)),
]


def sample_tokens(vocab_size: int, batch: int = 2, seq: int = 12, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def build_chunks(bridge, config):
    from megatron.core import parallel_state as mpu

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        chunks.append(bridge.build_model(
            config=config, vp_stage=stage,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)))
    return chunks


def forward_logits(chunks, tokens: torch.Tensor, vocab_size: int):
    """Forward-only schedule over all chunks; returns full-vocab logits on the last stage, else None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        output = model(input_ids=data["tokens"], position_ids=data["positions"], attention_mask=data["mask"])

        def loss_func(logits):
            return logits.float().sum() * 0.0, {"logits": logits.detach()}

        return output, loss_func

    iterators = [iter([dict(tokens=tokens, positions=positions, mask=mask)]) for _ in chunks]
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1, seq_length=seq,
            micro_batch_size=batch, forward_only=True)
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = outputs[0]["logits"].contiguous()
    tp = mpu.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=mpu.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    return local[..., :vocab_size]


def mcore_logits_for_layout(rank: int, layout_kwargs: dict, hf_dirs: dict, tokens: dict, spec: str = "local"):
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=11)
    results = {}
    for arch, hf_dir in hf_dirs.items():
        started = time.monotonic()
        bridge = ModelBridge.from_hf_config(hf_dir, spec=spec)
        config = bridge.transformer_config(layout=layout, perform_initialization=False)
        chunks = build_chunks(bridge, config)
        counts = load_hf_weights(chunks, hf_dir, bridge)
        logits = forward_logits(chunks, tokens[arch], bridge.dims.vocab_size)
        results[arch] = dict(logits=logits, loaded=counts["params"], seconds=time.monotonic() - started,
                             tp_rank=mpu.get_tensor_model_parallel_rank(),
                             pp_rank=mpu.get_pipeline_model_parallel_rank(),
                             ep_rank=mpu.get_expert_model_parallel_rank())
    return results


def local_names_and_shapes(chunks) -> dict[str, tuple[int, ...]]:
    from megarl.models.hf_checkpoint import iter_loadable_tensors

    return {name: tuple(t.shape) for chunk in chunks for name, t in iter_loadable_tensors(chunk)}


def mcore_logits_for_layouts(rank: int, runs: list, hf_dirs: dict, tokens: dict, spec: str = "local"):
    """``runs``: [(label, layout_kwargs, archs, {arch: config overrides})]; each layout in turn."""
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights

    results = {}
    for label, layout_kwargs, archs, overrides in runs:
        layout = ParallelLayout(**layout_kwargs)
        initialize_megatron_parallel(layout=layout, seed=11)
        for arch in archs:
            started = time.monotonic()
            bridge = ModelBridge.from_hf_config(hf_dirs[arch], spec=spec)
            config = bridge.transformer_config(layout=layout, perform_initialization=False,
                                               **overrides.get(arch, {}))
            chunks = build_chunks(bridge, config)
            counts = load_hf_weights(chunks, hf_dirs[arch], bridge)
            logits = forward_logits(chunks, tokens[arch], bridge.dims.vocab_size)
            results[(label, arch)] = dict(
                logits=logits, loaded=counts["params"], seconds=time.monotonic() - started,
                names=local_names_and_shapes(chunks), tp_rank=mpu.get_tensor_model_parallel_rank(),
                pp_rank=mpu.get_pipeline_model_parallel_rank(), ep_rank=mpu.get_expert_model_parallel_rank())
    return results
