"""The trainer starts from a torch_dist checkpoint (converters/hf_to_mcore.py's output) at a layout no
conversion was made for, exactly as it starts from the HF weights; and its own training checkpoint converts
back to HF (converters/mcore_to_hf.py) bit for bit as the trainer's HF export of the same step."""

from pathlib import Path

import pytest
import torch

from megarl.run_config import load_config
from tests.paths import REPO

TP2 = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.use_kl_loss=true")


def _config(out: Path, *overrides: str):
    return load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"trainer.default_local_dir={out}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.total_training_steps=1", *overrides])


@pytest.mark.timeout(900)
def test_training_starts_from_a_converted_checkpoint_and_its_checkpoint_converts_back(tmp_path):
    from megarl.checkpoint_io.hf_index import index_hf_safetensors
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf
    from megarl.checkpoint_io.safetensors_stream import read_tensor
    from megarl.models.embedded import resolve_model_path
    from megarl.trainer.main import run

    hf_dir = resolve_model_path("embedded:tiny-qwen2")
    convert_hf_to_mcore(hf_dir, tmp_path / "converted")  # no layout chosen: TP=2 below loads it
    from_hf = run(_config(tmp_path / "from_hf", *TP2, "trainer.save_freq=-1"))
    from_dist = run(_config(tmp_path / "from_dist", *TP2, "trainer.save_freq=1", "trainer.save_hf=true",
                            "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                            f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={tmp_path / 'converted'}"))
    assert len(from_hf) == len(from_dist) == 1
    for want, got in zip(from_hf, from_dist):  # the same weights (actor and reference): the same step
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/ref_kl",
                    "rollout/log_prob_diff_max"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (want["step"], key)
    assert from_dist[0]["rollout/log_prob_diff_max"] < 1e-4  # the rollout engine's HF weights agree with them

    step = tmp_path / "from_dist" / "checkpoints" / "global_step_1"
    convert_mcore_to_hf(step / "actor", tmp_path / "back", hf_config_dir=hf_dir)  # saved at TP=2 by training
    exported = {n: read_tensor(loc) for n, loc in index_hf_safetensors(step / "actor_hf").items()}
    back = {n: read_tensor(loc) for n, loc in index_hf_safetensors(tmp_path / "back").items()}
    assert sorted(back) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(back[name].to(tensor.dtype), tensor), name
    original = {n: read_tensor(loc) for n, loc in index_hf_safetensors(hf_dir).items()}
    assert any(not torch.equal(original[n], exported[n]) for n in exported)  # the update moved the weights

    # and the weights really come from the torch_dist checkpoint: one of a changed model (its final norm
    # scaled) gives another first step than the HF weights did
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(tmp_path / "changed_hf")
    convert_hf_to_mcore(tmp_path / "changed_hf", tmp_path / "changed")
    (first,) = run(_config(tmp_path / "from_changed", *TP2, "trainer.save_freq=-1",
                           "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                           f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={tmp_path / 'changed'}"))
    assert first["actor/entropy"] != pytest.approx(from_hf[0]["actor/entropy"], rel=1e-3), first["actor/entropy"]
