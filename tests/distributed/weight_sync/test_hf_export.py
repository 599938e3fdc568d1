"""The actor exported as a Hugging Face checkpoint: gathered from TP/PP/EP shards, written in bounded
shards, loadable by transformers with the trainer's logits; an unfinished export has no index."""

import json
import zlib

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.distributed.models.bridge_workers import build_chunks, forward_logits, hf_logits, sample_tokens

SHARD_BYTES = 64 * 1024


def _export_world(rank, hf_dir, out_dir, layout_kwargs):
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.weight_sync import DiscardTransport, sync_weights
    from megarl.weight_sync.hf_writer import HFCheckpointWriter

    layout = ParallelLayout(**layout_kwargs)
    initialize_megatron_parallel(layout=layout, seed=5)
    bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
    chunks = build_chunks(bridge, bridge.transformer_config(layout=layout))
    load_hf_weights(chunks, hf_dir, bridge)
    with torch.no_grad():  # the "trained" weights: noise seeded by name, so replicas agree
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.add_(0.05 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    writer = HFCheckpointWriter(out_dir, source_dir=hf_dir, max_shard_bytes=SHARD_BYTES) if rank == 0 \
        else DiscardTransport()
    num_experts = bridge.dims.num_experts
    sync_weights(chunks, bridge, writer, bucket_bytes=16 * 1024,
                 num_local_experts=num_experts // layout.expert_parallel if num_experts else None)
    return forward_logits(chunks, sample_tokens(bridge.dims.vocab_size), bridge.dims.vocab_size)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch, layout", [("qwen2", dict(tensor_parallel=2)), ("qwen3_moe", dict(expert_parallel=2))])
def test_exported_checkpoint_loads_in_transformers_with_the_trainers_logits(tmp_path, arch, layout):
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = str(save_tiny_hf_checkpoint(arch, tmp_path / "source", seed=0))
    (tmp_path / "source" / "tokenizer_config.json").write_text('{"model_max_length": 64}')  # an asset
    out_dir = tmp_path / "exported"
    trainer_logits = [r for r in run_distributed(_export_world, 2, hf_dir, str(out_dir), layout) if r is not None]
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out_dir / s).is_file() for s in shards)
    assert json.loads((out_dir / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    tokens = sample_tokens(json.loads((out_dir / "config.json").read_text())["vocab_size"])
    exported = hf_logits(str(out_dir), tokens)
    for logits in trainer_logits:
        torch.testing.assert_close(exported, logits, rtol=1e-4, atol=1e-4)
    assert (exported - hf_logits(hf_dir, tokens)).abs().max() > 1e-2  # the export holds the changed weights


def test_export_writes_the_index_last_takes_tokenizer_files_and_refuses_a_finished_directory(tmp_path):
    from megarl.weight_sync.hf_writer import HFCheckpointWriter

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16",
                                                    "quantization_config": {"quant_method": "fp8"}}))
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    writer = HFCheckpointWriter(tmp_path / "out", source_dir=source, tokenizer_dir=tokenizer, max_shard_bytes=1)
    writer.send([("a.weight", torch.ones(2)), ("b.weight", torch.zeros(3))])
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()  # not loadable until finish
    with pytest.raises(ValueError, match="a.weight was exported twice"):
        writer.send([("a.weight", torch.ones(2))])
    writer.finish()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "quantization_config" not in config
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"  # from the tokenizer directory
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        HFCheckpointWriter(tmp_path / "out", source_dir=source)
