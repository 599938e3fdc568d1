"""A converted checkpoint, loaded into real megatron GPTModels (2 gloo processes) through the strict
per-rank loader, gives the HF model's logits: every architecture at tp=2, the tied-embedding and MoE
models at pp=2 (the last stage's output_layer copy) and the MoE models at ep=2 (non-expert tensors read
from the ep=0 directory). A checkpoint that does not match the model is refused, naming the tensor."""

import pytest
import torch

from tests.distributed.converters import mcore_load_workers
from tests.dist_harness import run_distributed
from tests.distributed.models.bridge_workers import hf_logits, sample_tokens

LAYOUTS = {
    "tp2": (dict(tensor_parallel=2), dict(tp=2), ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")),
    "pp2": (dict(pipeline_parallel=2), dict(pp=2), ("qwen2", "qwen3_moe")),
    "ep2": (dict(expert_parallel=2), dict(ep=2), ("qwen3_moe", "deepseek_v3")),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_converted_checkpoint_matches_hf_logits(layout_name, tmp_path):
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    layout, sizes, archs = LAYOUTS[layout_name]
    ckpts, tokens, expected = {}, {}, {}
    for arch in archs:
        hf_dir = save_tiny_hf_checkpoint(arch, tmp_path / arch / "hf", seed=7)
        convert_hf_to_mcore(hf_dir, tmp_path / arch / "mc", **sizes, format="per_rank")
        ckpts[arch] = str(tmp_path / arch / "mc")
        tokens[arch] = sample_tokens(250)
        expected[arch] = hf_logits(hf_dir, tokens[arch])
    results = run_distributed(mcore_load_workers.converted_checkpoint_logits, 2, layout, ckpts, tokens,
                              timeout_s=280)
    compared = 0
    for rank_result in results:
        for arch in archs:
            got = rank_result[arch]["logits"]
            assert rank_result[arch]["loaded"] > 5
            if got is None:  # not the last pipeline stage
                continue
            assert not torch.allclose(got, torch.zeros_like(got))
            torch.testing.assert_close(got, expected[arch], rtol=2e-4, atol=2e-4, msg=lambda m: f"{arch}: {m}")
            compared += 1
    assert compared == len(archs) * (1 if layout_name == "pp2" else 2)


@pytest.mark.timeout(200)
def test_strict_loader_names_missing_and_misshapen_tensors(tmp_path):
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("llama", tmp_path / "hf", seed=7)
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2, format="per_rank")
    for errors in run_distributed(mcore_load_workers.strict_load_errors, 2, str(tmp_path / "mc"), timeout_s=180):
        assert len(errors) == 2
        assert "missing from checkpoint: ['decoder.layers.2." in errors[0]
        assert "decoder.layers.0.mlp.linear_fc1.weight has shape (96, 64) in the checkpoint, (192, 64)" in errors[1]
