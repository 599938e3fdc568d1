"""LoRA RL end to end on CPU through real Ray: the trainer's adapters reach the rollout engine (merged into the
weight sync, or served by vLLM from the adapter's tensors alone) so that every step the rollout engine's
log-probs of what it sampled equal the trainer's recomputation; KL to the base (the reference with the adapters
off) enters the loss; a LoRA critic trains beside; checkpoints hold the adapters, export the merged model and the
PEFT adapter, and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.run_config import load_config
from tests.paths import REPO

LORA = ("actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2")


def _config(tmp_path: Path, *overrides: str, recipe: str = "grpo_tiny.yaml"):
    return load_config(REPO / "configs" / recipe, [
        f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", *LORA, *overrides,
    ])


def _run(cfg):
    from megarl.trainer.main import run

    return run(cfg)


PPO_LORA = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "critic.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.1", "critic.model.lora.rank=8", "trainer.save_freq=2",
            "trainer.save_hf=true")


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """Two steps of PPO with a LoRA actor and a LoRA critic at TP=2, checkpointed with the HF exports."""
    out = tmp_path_factory.mktemp("lora_ppo")
    return out, _run(_config(out, "trainer.total_training_steps=2", *PPO_LORA, recipe="ppo_tiny.yaml"))


@pytest.mark.timeout(600)
def test_lora_ppo_merged_sync_kl_to_the_base_critic_lora_checkpoint_and_resume(ppo_run):
    tmp_path, history = ppo_run
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["rollout/log_prob_diff_max"] < 1e-4, (h["step"], h["rollout/log_prob_diff_max"])
    # the reference is the base with the adapters off: KL 0 before the first optimizer step (B = 0), then positive
    # as the adapters move the policy (step 1's four mini-batches average one zero and three after updates)
    assert 0 < history[0]["actor/kl_loss"] < 0.1 and history[1]["actor/kl_loss"] > 0
    assert history[1]["actor/ppo_kl"] != 0 and history[1]["critic/vf_loss"] == history[1]["critic/vf_loss"]
    step_dir = tmp_path / "checkpoints" / "global_step_2"
    adapter = step_dir / "actor_hf_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert (adapter / "adapter_model.safetensors").stat().st_size < 2**20
    assert (step_dir / "actor_hf" / "config.json").is_file()  # the merged model
    actor_bytes = sum(f.stat().st_size for f in (step_dir / "actor").rglob("*") if f.is_file())
    merged_bytes = sum(f.stat().st_size for f in (step_dir / "actor_hf").rglob("*.safetensors"))
    assert actor_bytes < merged_bytes / 2  # the checkpoint holds the adapters (and their Adam state), not the base
    resumed = _run(_config(tmp_path, "trainer.total_training_steps=3", *PPO_LORA, recipe="ppo_tiny.yaml"))
    assert [h["step"] for h in resumed] == [3]
    assert resumed[0]["rollout/log_prob_diff_max"] < 1e-4  # the resumed adapters reached the rollout engine


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_serves_the_adapter_and_follows_the_trainer(tmp_path):
    pytest.importorskip("vllm")
    history = _run(_config(
        tmp_path, "trainer.total_training_steps=3", "actor_rollout_ref.model.lora.merge=false",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.kv_cache_memory_mb=64", "actor_rollout_ref.rollout.free_cache_engine=false"))
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[-1]["actor/ppo_kl"] != 0  # the policy moved: the later syncs carried new adapters
    for h in history:
        # fp32 on both sides; a stale adapter or a wrong scale would show as O(0.1-1) differences
        assert h["rollout/log_prob_diff_max"] < 1e-3, (h["step"], h["rollout/log_prob_diff_max"])
        assert 0 < h["weight_sync/bytes"] < 2**20  # the adapter alone, not the model


@pytest.mark.timeout(600)
def test_a_run_starts_from_an_exported_peft_adapter(ppo_run, tmp_path):
    """verl's ``lora_adapter_path``: a new run (another layout: TP=1) starts from the adapter the PPO run exported;
    its first rollout is already the adapted policy (KL to the base before any update, the rollout matching the
    trainer). Without the adapter loaded that KL is exactly 0 (B = 0 is the base: docs/wiring_mutations.md, 13)."""
    adapter = ppo_run[0] / "checkpoints" / "global_step_2" / "actor_hf_adapter"
    started = _run(_config(tmp_path / "started", "trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=true",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=16",  # one optimizer step: KL before any update
                           "actor_rollout_ref.model.lora.rank=0", "actor_rollout_ref.model.lora_rank=8",
                           "actor_rollout_ref.model.lora_alpha=16", f"actor_rollout_ref.model.lora_adapter_path={adapter}"))
    assert started[0]["actor/kl_loss"] > 1e-4  # the exported adapter, loaded: not the base
    assert started[0]["rollout/log_prob_diff_max"] < 1e-4  # and the rollout engine generated with it
