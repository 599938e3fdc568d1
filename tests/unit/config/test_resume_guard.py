"""Which config changes make a resume another run (megarl.trainer.resume_guard), and config.yaml's history."""

import yaml

from megarl.config.loader import to_dict
from megarl.run_config import load_config
from megarl.trainer.resume_guard import identity_changes, save_run_config


def _tree(*overrides):
    return to_dict(load_config(None, list(overrides)))


def test_the_run_identity_changes_are_listed_and_the_knobs_are_not():
    base = _tree()
    changed = _tree("algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=512",
                    "actor_rollout_ref.model.path=/models/other", "actor_rollout_ref.actor.clip_ratio_high=0.28")
    assert identity_changes(base, changed) == [
        "actor_rollout_ref.actor.clip_ratio_high: 0.2 -> 0.28",
        "actor_rollout_ref.model.path: 'embedded:tiny-qwen2' -> '/models/other'",
        "actor_rollout_ref.rollout.n: 8 -> 4",
        "algorithm.adv_estimator: 'grpo' -> 'rloo'",
        "data.train_batch_size: 1024 -> 512",
    ]
    knobs = _tree("trainer.total_training_steps=99", "actor_rollout_ref.actor.optim.lr=3e-6",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.save_freq=5",
                  "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.actor.megatron.param_offload=true",
                  "trainer.logger=[console]")
    assert identity_changes(base, knobs) == []
    # a key one side lacks (a config written by an older megarl) counts as a change only for identity keys
    older = dict(base, algorithm={k: v for k, v in base["algorithm"].items() if k != "norm_adv_by_std_in_grpo"})
    assert identity_changes(older, base) == ["algorithm.norm_adv_by_std_in_grpo: '<absent>' -> True"]


def test_config_yaml_keeps_its_history(tmp_path):
    first, second = load_config(None, ["trainer.seed=1"]), load_config(None, ["trainer.seed=2"])
    save_run_config(first, tmp_path)
    save_run_config(second, tmp_path)
    save_run_config(first, tmp_path)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["seed"] == 1
    history = sorted((tmp_path / "config_history").iterdir())
    assert [p.name for p in history] == ["config.1.yaml", "config.2.yaml"]
    assert [yaml.safe_load(p.read_text())["trainer"]["seed"] for p in history] == [1, 2]
