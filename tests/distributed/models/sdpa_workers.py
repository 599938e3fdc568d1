"""Per-rank body for the SDPA core-attention tests (module-level so spawned processes can import it).

``compare_core_attentions`` builds the same HF checkpoint twice per layout through the bridge, once with
megatron's local ``DotProductAttention`` and once with ``SDPADotProductAttention``, runs one forward and
backward on a left-padded batch (the engines' mask: causal | padded keys) and returns, per core
attention, the full-vocab logits, the summed next-token log-prob loss and every parameter's gradient.
"""

from __future__ import annotations

import torch


def left_padded_batch(vocab_size: int, pads=(0, 3, 7), seq: int = 12, seed: int = 5):
    """tokens [B, S], real-token mask [B, S] (long) with ``pads[i]`` leading padding tokens in row i."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab_size, (len(pads), seq), generator=generator)
    real = torch.ones(len(pads), seq, dtype=torch.long)
    for row, pad in enumerate(pads):
        tokens[row, :pad] = 0
        real[row, :pad] = 0
    return tokens, real


def compare_core_attentions(rank: int, layouts: list, hf_dirs: dict, device_name: str = "cpu",
                            dtype_name: str = "float32", pads=(0, 3, 7)) -> dict:
    """``device_name="cuda"`` (one rank) runs the same comparison on the GPU, in ``dtype_name``."""
    if device_name == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.packing import build_attention_mask
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.models.sdpa_attention import SDPADotProductAttention
    from tests.distributed.models.bridge_workers import build_chunks

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    results = {}
    for label, layout_kwargs in layouts:
        layout = ParallelLayout(**layout_kwargs)
        initialize_megatron_parallel(layout=layout, seed=11)
        tp_group = mpu.get_tensor_model_parallel_group()
        for arch, hf_dir in hf_dirs.items():
            for core in ("local", "sdpa"):
                bridge = ModelBridge.from_hf_config(hf_dir, spec="local", core_attention=core)
                config = bridge.transformer_config(layout=layout, perform_initialization=False,
                                                   params_dtype=dtype)
                (model,) = build_chunks(bridge, config)
                model = model.to(device)
                load_hf_weights([model], hf_dir, bridge)
                cores = {type(m).__name__ for m in model.modules() if "DotProductAttention" in type(m).__name__}
                tokens, real = left_padded_batch(bridge.dims.vocab_size, pads=pads)
                positions = (real.cumsum(dim=1) - 1).clamp(min=0)
                tokens, real, positions = tokens.to(device), real.to(device), positions.to(device)
                mask = build_attention_mask(real)
                model.eval()  # MoE refuses training mode with TP but no sequence parallel; autograd still runs
                logits = model(input_ids=tokens, position_ids=positions, attention_mask=mask)
                # Next-token log-probs where both the predicting and the predicted token are real,
                # as the engines' losses use them (a padding query's output is not the local spec's).
                log_probs, _ = compute_vocab_parallel_log_probs(
                    logits[:, :-1], tokens[:, 1:], tp_group=tp_group, vocab_size=bridge.dims.vocab_size)
                loss = -(log_probs * (real[:, 1:] * real[:, :-1])).sum()
                loss.backward()
                full = logits.detach()
                if mpu.get_tensor_model_parallel_world_size() > 1:
                    parts = [torch.empty_like(full) for _ in range(mpu.get_tensor_model_parallel_world_size())]
                    torch.distributed.all_gather(parts, full.contiguous(), group=tp_group)
                    full = torch.cat(parts, dim=-1)
                entry = dict(logits=full[..., :bridge.dims.vocab_size].float().cpu(), real=real.cpu(),
                             loss=loss.detach().cpu(),
                             grads={n: p.grad.float().cpu() for n, p in model.named_parameters()
                                    if p.grad is not None},
                             core_modules=cores)
                if core == "sdpa":
                    attention = next(m for m in model.modules() if isinstance(m, SDPADotProductAttention))
                    q = torch.zeros(4, 1, attention.num_attention_heads_per_partition, 8, device=device)
                    from megatron.core.packed_seq_params import PackedSeqParams

                    try:  # packing is thd only: another format must be refused, not misread
                        attention(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
                        entry["packed_error"] = None
                    except NotImplementedError as exc:
                        entry["packed_error"] = str(exc)
                results[(label, arch, core)] = entry
    return results
