"""HF -> mcore (TP/PP/EP shards) -> HF is bit exact for every architecture, and the result loads with
transformers; the per-rank files hold megatron's rank-local names and pass the validator."""

import json
import os

import pytest
import torch

from megarl.checkpoint_io.hf_index import index_hf_safetensors
from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf
from megarl.checkpoint_io.safetensors_stream import read_tensor
from megarl.models.mcore_checkpoint import read_metadata, read_rank_state_dict, validate_mcore_checkpoint

LAYOUTS = {  # arch: (tp, pp, ep, overrides)
    "llama": (2, 2, 1, {}),
    "qwen2": (2, 2, 1, {}),  # tied embeddings: the last stage also holds output_layer.weight
    "qwen3": (2, 2, 1, {}),
    "qwen3_moe": (2, 2, 2, {}),
    "deepseek_v3": (2, 2, 2, {"num_hidden_layers": 4}),
}


def _all_tensors(hf_dir):
    return {name: read_tensor(location) for name, location in index_hf_safetensors(hf_dir).items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_hf_mcore_hf_roundtrip_is_bit_exact(arch, tmp_path):
    import transformers

    from megarl.models.tiny import save_tiny_hf_checkpoint

    tp, pp, ep, overrides = LAYOUTS[arch]
    source = save_tiny_hf_checkpoint(arch, tmp_path / "hf", seed=3, **overrides)
    with open(os.path.join(source, "model.safetensors.index.json")) as handle:
        assert len(set(json.load(handle)["weight_map"].values())) >= 3  # really several input shards
    convert_hf_to_mcore(source, tmp_path / "mc", tp=tp, pp=pp, ep=ep, max_file_bytes=40_000, format="per_rank")
    assert validate_mcore_checkpoint(tmp_path / "mc") == []
    metadata = read_metadata(tmp_path / "mc")
    assert (metadata.tp, metadata.pp, metadata.ep) == (tp, pp, ep)
    assert sorted(metadata.raw["ranks"]) == sorted(f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(tp)
                                                   for p in range(pp) for e in range(ep))
    last = read_rank_state_dict(tmp_path / "mc", tp_rank=1, pp_rank=pp - 1, ep_rank=ep - 1)
    assert all(not n.startswith("decoder.layers.") or int(n.split(".")[2]) < metadata.pipeline_layers[-1][1]
               for n in last)  # rank-local layer numbers
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last

    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", max_shard_bytes=30_000)
    original, back = _all_tensors(source), _all_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name
    assert len(set(json.load(open(tmp_path / "back" / "model.safetensors.index.json"))["weight_map"].values())) > 1
    assert os.path.isfile(tmp_path / "back" / "generation_config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    loaded, expected = model.state_dict(), reference.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_non_expert_tensors_live_only_under_ep0(tmp_path):
    from megarl.models.tiny import save_tiny_hf_checkpoint

    source = save_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=4)
    convert_hf_to_mcore(source, tmp_path / "mc", tp=1, ep=2, format="per_rank")
    ranks = read_metadata(tmp_path / "mc").raw["ranks"]
    ep1 = ranks["mp_rank_00_000_001"]["tensors"]
    assert ep1 and all(info["expert"] for info in ep1.values())
    assert "embedding.word_embeddings.weight" in ranks["mp_rank_00_000_000"]["tensors"]
    # an ep=1 model still gets everything: shared tensors from ep 0, its experts (local index 0, 1) from ep 1
    state = read_rank_state_dict(tmp_path / "mc", tp_rank=0, pp_rank=0, ep_rank=1)
    assert "embedding.word_embeddings.weight" in state
    names = read_metadata(tmp_path / "mc").rank_tensors(0, 0, 1)
    expert = names["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert expert.global_name == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"


def test_validator_and_loader_refuse_damaged_checkpoints(tmp_path):
    from megarl.models.tiny import save_tiny_hf_checkpoint

    source = save_tiny_hf_checkpoint("llama", tmp_path / "hf", seed=2)
    convert_hf_to_mcore(source, tmp_path / "mc", tp=2, format="per_rank")
    victim = tmp_path / "mc" / "mp_rank_01_000_000" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = validate_mcore_checkpoint(tmp_path / "mc")
    assert len(problems) == 1 and "mp_rank_01_000_000/model.safetensors: CRC32" in problems[0]
    victim.write_bytes(bytes(data[:-10]))
    assert "size" in validate_mcore_checkpoint(tmp_path / "mc")[0]
    meta = json.loads((tmp_path / "mc" / "metadata.json").read_text())
    meta["complete"] = False
    (tmp_path / "mc" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not marked complete"):
        read_metadata(tmp_path / "mc")
    with pytest.raises(FileExistsError, match="already holds a finished checkpoint"):
        convert_hf_to_mcore(source, tmp_path / "mc", tp=2, format="per_rank")
